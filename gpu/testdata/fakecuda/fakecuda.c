// A fake CUDA driver for testing troupe's GPU loader and cuda backend on
// machines without a GPU. It implements the handful of driver entry points
// the loader resolves, on host memory: device memory is a shared memfd, streams
// are queues drained by one pthread each (asynchronous and in order), events
// mark points in them, stream memory operations write and poll 64-bit words.
// cuMemFree, cuMemFreeHost, cuIpcCloseMemHandle, cuModuleLoadDataEx and
// cuModuleUnload wait until the device's streams are idle (stream waits and
// resident kernels included), as the real driver's do.
// It is a test double only; nothing here is a model of real performance.
//
// Device memory (cuMemAlloc) is a memfd mapped MAP_SHARED, so another process
// can map it: an IPC handle names the exporting process, the memfd's
// descriptor there and the allocation's id and size, and cuIpcOpenMemHandle
// opens /proc/<pid>/fd/<fd>, checks that it is still that allocation and maps
// it. The memory lives until the exporter frees it and every importer has
// closed its mapping (or exited), as with the real driver.
//
// Modules: cuModuleLoadDataEx keeps the PTX text; cuModuleGetFunction finds
// kernel <name> when the image has an entry of that name and this library
// was built with the kernel's source compiled for the host (see
// gpu/troupe_kernel.h), which defines fakecuda_kernel_<name>; cuLaunchKernel
// copies the one by-value parameter and runs the grid's threads one after
// another, in stream order, on the stream's thread.
//
// Build: cc -shared -fPIC -o libcuda.so.1 fakecuda.c -lpthread -ldl
//        [-x c++ -I gpu kernels.cu ...]
// Env:   FAKECUDA_INIT=<n> makes cuInit return CUresult n.
//        FAKECUDA_IPC=1 lets cuIpcOpenMemHandle succeed in the exporting
//        process (it maps a second view of the memory there).
//        FAKECUDA_DEVICES=<n> sets the device count (default 1).
//        FAKECUDA_IPC_OPEN=<n> makes cuIpcOpenMemHandle return CUresult n
//        (a driver refusing another process's handle, as for a device this
//        process cannot reach).

#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct { char reserved[64]; } CUipcMemHandle;

enum {
	OK = 0,
	ERR_INVALID_VALUE = 1,
	ERR_NOT_INITIALIZED = 3,
	ERR_NO_DEVICE = 100,
	ERR_INVALID_DEVICE = 101,
	ERR_INVALID_CONTEXT = 201,
	ERR_INVALID_IMAGE = 200,
	ERR_MAP_FAILED = 205,
	ERR_ALREADY_MAPPED = 208,
	ERR_INVALID_HANDLE = 400,
	ERR_NOT_FOUND = 500,
	ERR_NOT_READY = 600,
	ERR_NOT_SUPPORTED = 801,
};

static pthread_mutex_t g = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gc = PTHREAD_COND_INITIALIZER;
static int inited;
static int ndev = 1;
static char ctxs[8];

// ---- allocations ------------------------------------------------------

enum { M_DEVICE = 2, M_HOST = 1 };

typedef struct alloc {
	uintptr_t base;
	size_t size;
	int type;
	int managed;
	int dev;
	int fd;                 // memfd of a device allocation, -1 otherwise
	unsigned long long id;  // names the memfd; part of IPC handles
	int mapped;             // an IPC mapping (cuIpcOpenMemHandle)
	int src_pid;            // mapped: the exporting process and its
	unsigned long long src; // allocation id
	struct alloc *next;
} alloc;

static alloc *allocs;
static unsigned long long next_id;

static alloc *find(uintptr_t p) {
	for (alloc *a = allocs; a; a = a->next)
		if (p >= a->base && p - a->base < a->size) return a;
	return NULL;
}

static int cur_dev(void *ctx) {
	if (ctx == NULL) return 0;
	return (int)((char *)ctx - ctxs);
}

static __thread void *current;

static void link_alloc(alloc *a) {
	pthread_mutex_lock(&g);
	a->next = allocs;
	allocs = a;
	pthread_mutex_unlock(&g);
}

// shared_alloc backs n bytes of device memory with a memfd mapped
// MAP_SHARED (zero-filled, page-aligned).
static CUresult shared_alloc(alloc *a, size_t n) {
	char name[64];
	snprintf(name, sizeof name, "fakecuda-%d-%llu", (int)getpid(), a->id);
	int fd = memfd_create(name, MFD_CLOEXEC);
	if (fd < 0) return 2; // OUT_OF_MEMORY
	if (ftruncate(fd, (off_t)n) != 0) {
		close(fd);
		return 2;
	}
	void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED) {
		close(fd);
		return 2;
	}
	a->fd = fd;
	a->base = (uintptr_t)p;
	return OK;
}

static CUresult add_alloc(void **out, size_t n, int type, int managed) {
	if (!inited) return ERR_NOT_INITIALIZED;
	if (n == 0) return ERR_INVALID_VALUE;
	alloc *a = calloc(1, sizeof *a);
	a->size = n;
	a->type = type;
	a->managed = managed;
	a->dev = cur_dev(current);
	a->fd = -1;
	pthread_mutex_lock(&g);
	a->id = ++next_id;
	pthread_mutex_unlock(&g);
	if (type == M_DEVICE && !managed) {
		CUresult r = shared_alloc(a, n);
		if (r != OK) {
			free(a);
			return r;
		}
	} else {
		void *p = NULL;
		if (posix_memalign(&p, 256, n) != 0) {
			free(a);
			return 2; // OUT_OF_MEMORY
		}
		memset(p, 0, n);
		a->base = (uintptr_t)p;
	}
	link_alloc(a);
	*out = (void *)a->base;
	return OK;
}

static void release(alloc *a) {
	if (a->fd >= 0 || a->mapped) {
		munmap((void *)a->base, a->size);
		if (a->fd >= 0) close(a->fd);
	} else {
		free((void *)a->base);
	}
	free(a);
}

static void device_idle_locked(int dev);

// drop_alloc frees an allocation of the type (IPC mappings are closed with
// cuIpcCloseMemHandle, not freed), once the device is idle.
static CUresult drop_alloc(uintptr_t p, int type) {
	pthread_mutex_lock(&g);
	device_idle_locked(cur_dev(current));
	for (alloc **pp = &allocs; *pp; pp = &(*pp)->next) {
		alloc *a = *pp;
		if (a->base == p && a->type == type && !a->mapped) {
			*pp = a->next;
			pthread_mutex_unlock(&g);
			release(a);
			return OK;
		}
	}
	pthread_mutex_unlock(&g);
	return ERR_INVALID_VALUE;
}

// ---- streams and events -------------------------------------------------

// An event's records are numbered 1, 2, ... (target is the latest); those
// enqueued and not yet reached by their stream are listed in pending. A
// record is complete once it is off the list: records on different streams
// complete in any order, and a cuStreamWaitEvent waits for the record it
// saw, not for whichever record completes next.
typedef struct pending_rec {
	unsigned long long gen;
	struct pending_rec *next;
} pending_rec;

typedef struct event {
	unsigned long long target;
	pending_rec *pending;
} event;

static int rec_done_locked(event *e, unsigned long long gen) {
	for (pending_rec *p = e->pending; p; p = p->next)
		if (p->gen == gen) return 0;
	return 1;
}

static void rec_complete_locked(event *e, unsigned long long gen) {
	for (pending_rec **pp = &e->pending; *pp; pp = &(*pp)->next)
		if ((*pp)->gen == gen) {
			pending_rec *p = *pp;
			*pp = p->next;
			free(p);
			return;
		}
}

enum { OP_COPY, OP_SET, OP_WRITE, OP_WAIT, OP_RECORD, OP_WAITEV, OP_LAUNCH };

struct function;
static void run_launch(struct function *f, const unsigned *dims, void *args);

typedef struct op {
	int kind;
	uintptr_t dst, src;
	size_t n;
	unsigned long long v;
	unsigned flags;
	event *ev;
	unsigned long long gen;
	struct function *fn; // OP_LAUNCH: the kernel, its dims and its parameter copy (src)
	unsigned dims[6];
	struct op *next;
} op;

typedef struct stream {
	op *head, *tail;
	unsigned long long enq, done;
	int destroyed;
	int dev;             // the device of the context it was created in
	struct stream *next; // all streams whose threads run (streams)
	pthread_t th;
} stream;

static stream *streams;

// device_idle_locked waits (holding g) until every stream of device dev,
// destroyed ones with work left included, has run all its work. The real
// driver's cuMemFree, cuMemFreeHost and cuIpcCloseMemHandle synchronize the
// device like this before they release memory: they wait for stream waits
// (cuStreamWaitValue64) and resident kernels too, so a free from the code a
// stream waits for deadlocks, as it does on a GPU.
static void device_idle_locked(int dev) {
	for (;;) {
		stream *busy = NULL;
		for (stream *s = streams; s; s = s->next)
			if (s->dev == dev && s->done < s->enq) busy = s;
		if (busy == NULL) return;
		pthread_cond_wait(&gc, &g);
	}
}

static int holds(unsigned long long cur, unsigned long long v, unsigned flags) {
	switch (flags & 3) {
	case 0: return (long long)(cur - v) >= 0;
	case 1: return cur == v;
	case 2: return (cur & v) != 0;
	case 3: return ~(cur | v) != 0;
	}
	return 0;
}

static void timed_wait(void) {
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	ts.tv_nsec += 200000;
	if (ts.tv_nsec >= 1000000000) {
		ts.tv_sec++;
		ts.tv_nsec -= 1000000000;
	}
	pthread_cond_timedwait(&gc, &g, &ts);
}

static void *worker(void *arg) {
	stream *s = arg;
	pthread_mutex_lock(&g);
	for (;;) {
		while (s->head == NULL && !s->destroyed) pthread_cond_wait(&gc, &g);
		if (s->head == NULL) break;
		op *o = s->head;
		s->head = o->next;
		if (s->head == NULL) s->tail = NULL;
		switch (o->kind) {
		case OP_COPY:
			pthread_mutex_unlock(&g);
			memmove((void *)o->dst, (void *)o->src, o->n);
			pthread_mutex_lock(&g);
			break;
		case OP_SET:
			pthread_mutex_unlock(&g);
			memset((void *)o->dst, (int)o->v, o->n);
			pthread_mutex_lock(&g);
			break;
		case OP_WRITE:
			__atomic_store_n((unsigned long long *)o->dst, o->v, __ATOMIC_SEQ_CST);
			break;
		case OP_WAIT:
			// Host code writes these words without telling us: poll.
			while (!holds(__atomic_load_n((unsigned long long *)o->dst, __ATOMIC_SEQ_CST), o->v, o->flags))
				timed_wait();
			break;
		case OP_RECORD:
			rec_complete_locked(o->ev, o->gen);
			break;
		case OP_WAITEV:
			while (!rec_done_locked(o->ev, o->gen)) pthread_cond_wait(&gc, &g);
			break;
		case OP_LAUNCH:
			pthread_mutex_unlock(&g);
			run_launch(o->fn, o->dims, (void *)o->src);
			free((void *)o->src);
			pthread_mutex_lock(&g);
			break;
		}
		free(o);
		s->done++;
		pthread_cond_broadcast(&gc);
	}
	for (stream **pp = &streams; *pp; pp = &(*pp)->next)
		if (*pp == s) {
			*pp = s->next;
			break;
		}
	pthread_mutex_unlock(&g);
	free(s);
	return NULL;
}

// The implicit streams (CU_STREAM_LEGACY 0x1, CU_STREAM_PER_THREAD 0x2)
// take copies and memsets only, and run them at once: they are complete
// when the call returns, so synchronizing such a stream has nothing to do.
static int implicit_stream(stream *s) { return (uintptr_t)s == 1 || (uintptr_t)s == 2; }

static CUresult push(stream *s, op o) {
	if (s == NULL || implicit_stream(s)) return ERR_INVALID_HANDLE;
	op *p = malloc(sizeof *p);
	*p = o;
	p->next = NULL;
	pthread_mutex_lock(&g);
	if (s->tail) s->tail->next = p; else s->head = p;
	s->tail = p;
	s->enq++;
	pthread_cond_broadcast(&gc);
	pthread_mutex_unlock(&g);
	return OK;
}

// ---- entry points -----------------------------------------------------

CUresult cuInit(unsigned flags) {
	(void)flags;
	const char *e = getenv("FAKECUDA_INIT");
	if (e && atoi(e) != 0) return atoi(e);
	const char *d = getenv("FAKECUDA_DEVICES");
	if (d) ndev = atoi(d);
	if (ndev < 0 || ndev > 8) ndev = 1;
	inited = 1;
	return OK;
}

CUresult cuDriverGetVersion(int *v) { *v = 12040; return OK; }

CUresult cuGetErrorName(CUresult r, const char **s) {
	switch (r) {
	case OK: *s = "CUDA_SUCCESS"; return OK;
	case ERR_INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; return OK;
	case ERR_NOT_INITIALIZED: *s = "CUDA_ERROR_NOT_INITIALIZED"; return OK;
	case ERR_NO_DEVICE: *s = "CUDA_ERROR_NO_DEVICE"; return OK;
	case ERR_INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; return OK;
	case ERR_MAP_FAILED: *s = "CUDA_ERROR_MAP_FAILED"; return OK;
	case ERR_ALREADY_MAPPED: *s = "CUDA_ERROR_ALREADY_MAPPED"; return OK;
	case ERR_INVALID_HANDLE: *s = "CUDA_ERROR_INVALID_HANDLE"; return OK;
	case ERR_NOT_READY: *s = "CUDA_ERROR_NOT_READY"; return OK;
	case ERR_NOT_SUPPORTED: *s = "CUDA_ERROR_NOT_SUPPORTED"; return OK;
	}
	*s = NULL;
	return ERR_INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult r, const char **s) {
	switch (r) {
	case ERR_NO_DEVICE: *s = "no CUDA-capable device is detected"; return OK;
	case ERR_INVALID_CONTEXT: *s = "invalid device context"; return OK;
	}
	*s = NULL;
	return ERR_INVALID_VALUE;
}

CUresult cuDeviceGetCount(int *n) {
	if (!inited) return ERR_NOT_INITIALIZED;
	*n = ndev;
	return OK;
}

CUresult cuDeviceGet(CUdevice *d, int ord) {
	if (ord < 0 || ord >= ndev) return ERR_INVALID_DEVICE;
	*d = ord;
	return OK;
}

CUresult cuDeviceGetName(char *buf, int n, CUdevice d) {
	(void)d;
	strncpy(buf, "troupe fake CUDA device", n - 1);
	buf[n - 1] = 0;
	return OK;
}

CUresult cuDeviceTotalMem_v2(size_t *n, CUdevice d) { (void)d; *n = (size_t)1 << 30; return OK; }

CUresult cuDevicePrimaryCtxRetain(void **ctx, CUdevice d) {
	if (d < 0 || d >= ndev) return ERR_INVALID_DEVICE;
	*ctx = &ctxs[d];
	return OK;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { (void)d; return OK; }

CUresult cuCtxSetCurrent(void *ctx) {
	if (ctx != NULL && ((char *)ctx < ctxs || (char *)ctx >= ctxs + ndev)) return ERR_INVALID_CONTEXT;
	current = ctx;
	return OK;
}

CUresult cuMemGetInfo_v2(size_t *fr, size_t *tot) {
	*tot = (size_t)1 << 30;
	*fr = *tot / 2;
	return OK;
}

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
	void *q;
	CUresult r = add_alloc(&q, n, M_DEVICE, 0);
	if (r == OK) *p = (CUdeviceptr)(uintptr_t)q;
	return r;
}

CUresult cuMemAllocManaged(CUdeviceptr *p, size_t n, unsigned flags) {
	(void)flags;
	void *q;
	CUresult r = add_alloc(&q, n, M_DEVICE, 1);
	if (r == OK) *p = (CUdeviceptr)(uintptr_t)q;
	return r;
}

CUresult cuMemFree_v2(CUdeviceptr p) { return drop_alloc((uintptr_t)p, M_DEVICE); }
CUresult cuMemHostAlloc(void **p, size_t n, unsigned flags) { (void)flags; return add_alloc(p, n, M_HOST, 0); }
CUresult cuMemFreeHost(void *p) { return drop_alloc((uintptr_t)p, M_HOST); }

CUresult cuStreamCreate(stream **out, unsigned flags) {
	(void)flags;
	stream *s = calloc(1, sizeof *s);
	s->dev = cur_dev(current);
	pthread_mutex_lock(&g);
	s->next = streams;
	streams = s;
	pthread_mutex_unlock(&g);
	pthread_create(&s->th, NULL, worker, s);
	pthread_detach(s->th);
	*out = s;
	return OK;
}

CUresult cuStreamDestroy_v2(stream *s) {
	if (s == NULL) return ERR_INVALID_HANDLE;
	pthread_mutex_lock(&g);
	s->destroyed = 1;
	pthread_cond_broadcast(&gc);
	pthread_mutex_unlock(&g);
	return OK;
}

CUresult cuStreamSynchronize(stream *s) {
	if (implicit_stream(s)) return OK;
	if (s == NULL) return ERR_INVALID_HANDLE;
	pthread_mutex_lock(&g);
	unsigned long long target = s->enq;
	while (s->done < target) pthread_cond_wait(&gc, &g);
	pthread_mutex_unlock(&g);
	return OK;
}

CUresult cuStreamQuery(stream *s) {
	if (s == NULL) return ERR_INVALID_HANDLE;
	pthread_mutex_lock(&g);
	int done = s->done == s->enq;
	pthread_mutex_unlock(&g);
	return done ? OK : ERR_NOT_READY;
}

CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, stream *st) {
	if (implicit_stream(st)) {
		memmove((void *)(uintptr_t)d, (void *)(uintptr_t)s, n);
		return OK;
	}
	return push(st, (op){.kind = OP_COPY, .dst = (uintptr_t)d, .src = (uintptr_t)s, .n = n});
}

CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, stream *st) {
	pthread_mutex_lock(&g);
	alloc *a = find((uintptr_t)d);
	pthread_mutex_unlock(&g);
	if (a == NULL) return ERR_INVALID_VALUE;
	if (implicit_stream(st)) {
		memset((void *)(uintptr_t)d, v, n);
		return OK;
	}
	return push(st, (op){.kind = OP_SET, .dst = (uintptr_t)d, .v = v, .n = n});
}

// memop_refused: like the real driver's stream memory operations, the
// fake's refuse managed memory ("None of the operations accepts pointers to
// managed memory buffers"), and all memory with FAKECUDA_MEMOPS=801, as on a
// device without them (CUDA_ERROR_NOT_SUPPORTED).
static CUresult memop_refused(CUdeviceptr p) {
	const char *e = getenv("FAKECUDA_MEMOPS");
	if (e != NULL && atoi(e) != 0) return (CUresult)atoi(e);
	pthread_mutex_lock(&g);
	alloc *a = find((uintptr_t)p);
	int m = a != NULL && a->managed;
	pthread_mutex_unlock(&g);
	return m ? ERR_INVALID_VALUE : OK;
}

CUresult cuStreamWriteValue64_v2(stream *st, CUdeviceptr p, unsigned long long v, unsigned flags) {
	(void)flags;
	CUresult r = memop_refused(p);
	if (r != OK) return r;
	return push(st, (op){.kind = OP_WRITE, .dst = (uintptr_t)p, .v = v});
}

CUresult cuStreamWaitValue64_v2(stream *st, CUdeviceptr p, unsigned long long v, unsigned flags) {
	CUresult r = memop_refused(p);
	if (r != OK) return r;
	return push(st, (op){.kind = OP_WAIT, .dst = (uintptr_t)p, .v = v, .flags = flags});
}

CUresult cuEventCreate(event **out, unsigned flags) {
	(void)flags;
	*out = calloc(1, sizeof(event));
	return OK;
}

CUresult cuEventRecord(event *e, stream *st) {
	if (e == NULL) return ERR_INVALID_HANDLE;
	if (st == NULL || implicit_stream(st)) return ERR_INVALID_HANDLE; // as push
	pending_rec *p = malloc(sizeof *p);
	pthread_mutex_lock(&g);
	p->gen = ++e->target;
	p->next = e->pending;
	e->pending = p;
	unsigned long long gen = p->gen;
	pthread_mutex_unlock(&g);
	return push(st, (op){.kind = OP_RECORD, .ev = e, .gen = gen});
}

CUresult cuEventSynchronize(event *e) {
	pthread_mutex_lock(&g);
	unsigned long long target = e->target;
	while (!rec_done_locked(e, target)) pthread_cond_wait(&gc, &g);
	pthread_mutex_unlock(&g);
	return OK;
}

CUresult cuEventQuery(event *e) {
	pthread_mutex_lock(&g);
	int done = rec_done_locked(e, e->target);
	pthread_mutex_unlock(&g);
	return done ? OK : ERR_NOT_READY;
}

CUresult cuEventDestroy_v2(event *e) { (void)e; return OK; } // leaked: streams may still reference it

CUresult cuStreamWaitEvent(stream *st, event *e, unsigned flags) {
	(void)flags;
	pthread_mutex_lock(&g);
	unsigned long long gen = e->target;
	pthread_mutex_unlock(&g);
	return push(st, (op){.kind = OP_WAITEV, .ev = e, .gen = gen});
}

CUresult cuPointerGetAttribute(void *out, int attr, CUdeviceptr p) {
	pthread_mutex_lock(&g);
	alloc *a = find((uintptr_t)p);
	alloc c = a ? *a : (alloc){0};
	pthread_mutex_unlock(&g);
	if (a == NULL) return ERR_INVALID_VALUE;
	switch (attr) {
	case 2: *(unsigned *)out = (unsigned)c.type; return OK;
	case 8: *(unsigned *)out = (unsigned)c.managed; return OK;
	case 9: *(int *)out = c.dev; return OK;
	}
	return ERR_INVALID_VALUE;
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *n, CUdeviceptr p) {
	pthread_mutex_lock(&g);
	alloc *a = find((uintptr_t)p);
	alloc c = a ? *a : (alloc){0};
	pthread_mutex_unlock(&g);
	if (a == NULL) return ERR_INVALID_VALUE;
	if (base) *base = c.base;
	if (n) *n = c.size;
	return OK;
}

// IPC handle layout: magic(8) pid(4) fd(4) id(8) size(8), zero-padded.
static const char ipc_magic[8] = "FKCUIPC1";

typedef struct {
	char magic[8];
	int32_t pid;
	int32_t fd;
	unsigned long long id;
	unsigned long long size;
} ipc_handle;

CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) {
	pthread_mutex_lock(&g);
	alloc *a = find((uintptr_t)p);
	alloc c = a ? *a : (alloc){0};
	pthread_mutex_unlock(&g);
	if (a == NULL || c.fd < 0 || c.mapped) return ERR_INVALID_VALUE;
	ipc_handle x = {.pid = (int32_t)getpid(), .fd = c.fd, .id = c.id, .size = c.size};
	memcpy(x.magic, ipc_magic, sizeof x.magic);
	memset(h, 0, sizeof *h);
	memcpy(h->reserved, &x, sizeof x);
	return OK;
}

// cuIpcOpenMemHandle_v2 maps the exporter's memfd. Like the real driver it
// refuses a handle exported by this process (unless FAKECUDA_IPC=1) and a
// second open of one allocation in one context (CUDA_ERROR_ALREADY_MAPPED):
// each device's context maps it once.
// A handle whose allocation was freed fails: its descriptor is gone or now
// names another allocation (the memfd's name carries the id).
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned flags) {
	(void)flags;
	const char *refuse = getenv("FAKECUDA_IPC_OPEN");
	if (refuse != NULL && atoi(refuse) != 0) return (CUresult)atoi(refuse);
	ipc_handle x;
	memcpy(&x, h.reserved, sizeof x);
	if (memcmp(x.magic, ipc_magic, sizeof x.magic) != 0 || x.size == 0) return ERR_INVALID_HANDLE;
	if (x.pid == (int32_t)getpid()) {
		const char *e = getenv("FAKECUDA_IPC");
		if (e == NULL || atoi(e) != 1) return ERR_INVALID_CONTEXT;
	}
	pthread_mutex_lock(&g);
	for (alloc *a = allocs; a; a = a->next) {
		if (a->mapped && a->src_pid == x.pid && a->src == x.id && a->dev == cur_dev(current)) {
			pthread_mutex_unlock(&g);
			return ERR_ALREADY_MAPPED;
		}
	}
	pthread_mutex_unlock(&g);
	char path[64], want[64], got[128];
	snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)x.pid, (int)x.fd);
	int fd = open(path, O_RDWR | O_CLOEXEC);
	if (fd < 0) return ERR_INVALID_HANDLE;
	// Still the allocation the handle names?
	snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
	ssize_t n = readlink(path, got, sizeof got - 1);
	int wl = snprintf(want, sizeof want, "/memfd:fakecuda-%d-%llu", (int)x.pid, x.id);
	struct stat st;
	if (n < wl || strncmp(got, want, (size_t)wl) != 0 || (n > wl && got[wl] != ' ') ||
	    fstat(fd, &st) != 0 || (unsigned long long)st.st_size != x.size) {
		close(fd);
		return ERR_INVALID_HANDLE;
	}
	void *m = mmap(NULL, x.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (m == MAP_FAILED) return ERR_MAP_FAILED;
	alloc *a = calloc(1, sizeof *a);
	a->base = (uintptr_t)m;
	a->size = x.size;
	a->type = M_DEVICE;
	a->dev = cur_dev(current);
	a->fd = -1;
	a->mapped = 1;
	a->src_pid = x.pid;
	a->src = x.id;
	link_alloc(a);
	*p = (CUdeviceptr)a->base;
	return OK;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
	pthread_mutex_lock(&g);
	device_idle_locked(cur_dev(current));
	for (alloc **pp = &allocs; *pp; pp = &(*pp)->next) {
		alloc *a = *pp;
		if (a->base == (uintptr_t)p && a->mapped) {
			*pp = a->next;
			pthread_mutex_unlock(&g);
			release(a);
			return OK;
		}
	}
	pthread_mutex_unlock(&g);
	return ERR_INVALID_VALUE;
}

// ---- modules and kernels ------------------------------------------------

typedef struct { unsigned x, y, z; } dim3;
__thread dim3 fakecuda_threadIdx, fakecuda_blockIdx, fakecuda_blockDim, fakecuda_gridDim;

typedef size_t (*kernel_fn)(const void *);

typedef struct module {
	char *image;
} module;

typedef struct function {
	kernel_fn fn;
	size_t argsz;
} function;

static void run_launch(function *f, const unsigned *d, void *args) {
	fakecuda_gridDim = (dim3){d[0], d[1], d[2]};
	fakecuda_blockDim = (dim3){d[3], d[4], d[5]};
	for (unsigned bz = 0; bz < d[2]; bz++)
		for (unsigned by = 0; by < d[1]; by++)
			for (unsigned bx = 0; bx < d[0]; bx++)
				for (unsigned tz = 0; tz < d[5]; tz++)
					for (unsigned ty = 0; ty < d[4]; ty++)
						for (unsigned tx = 0; tx < d[3]; tx++) {
							fakecuda_blockIdx = (dim3){bx, by, bz};
							fakecuda_threadIdx = (dim3){tx, ty, tz};
							f->fn(args);
						}
}

CUresult cuModuleLoadDataEx(module **out, const void *image, unsigned n, int *opts, void **vals) {
	(void)n, (void)opts, (void)vals;
	if (!inited) return ERR_NOT_INITIALIZED;
	if (out == NULL || image == NULL) return ERR_INVALID_VALUE;
	if (strstr(image, ".entry") == NULL) return ERR_INVALID_IMAGE;
	pthread_mutex_lock(&g); // the real driver waits for the device's work too
	device_idle_locked(cur_dev(current));
	pthread_mutex_unlock(&g);
	module *m = calloc(1, sizeof *m);
	m->image = strdup(image);
	*out = m;
	return OK;
}

CUresult cuModuleUnload(module *m) {
	if (m == NULL) return ERR_INVALID_HANDLE;
	pthread_mutex_lock(&g); // kernels already launched finish first
	device_idle_locked(cur_dev(current));
	pthread_mutex_unlock(&g);
	free(m->image);
	free(m); // its functions are leaked: launches may still reference them
	return OK;
}

CUresult cuModuleGetFunction(function **out, module *m, const char *name) {
	if (m == NULL) return ERR_INVALID_HANDLE;
	char entry[256], sym[256];
	snprintf(entry, sizeof entry, ".entry %s(", name);
	if (strstr(m->image, entry) == NULL) return ERR_NOT_FOUND;
	snprintf(sym, sizeof sym, "fakecuda_kernel_%s", name);
	Dl_info info;
	if (!dladdr((void *)cuModuleGetFunction, &info)) return ERR_NOT_FOUND;
	void *self = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
	if (self == NULL) return ERR_NOT_FOUND;
	kernel_fn fn = (kernel_fn)dlsym(self, sym);
	dlclose(self);
	if (fn == NULL) return ERR_NOT_FOUND; // not compiled into this driver
	function *f = calloc(1, sizeof *f);
	f->fn = fn;
	f->argsz = fn(NULL);
	*out = f;
	return OK;
}

CUresult cuLaunchKernel(function *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shmem, stream *st, void **params, void **extra) {
	if (f == NULL) return ERR_INVALID_HANDLE;
	if (params == NULL || params[0] == NULL || extra != NULL || shmem != 0) return ERR_INVALID_VALUE;
	if ((unsigned long long)bx * by * bz > 1024 || gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0)
		return ERR_INVALID_VALUE;
	void *args = malloc(f->argsz);
	memcpy(args, params[0], f->argsz); // the driver copies parameters at launch
	op o = {.kind = OP_LAUNCH, .src = (uintptr_t)args, .fn = f, .dims = {gx, gy, gz, bx, by, bz}};
	CUresult r = push(st, o);
	if (r != OK) free(args);
	return r;
}
