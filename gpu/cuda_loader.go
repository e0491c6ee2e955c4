//go:build cgo && linux

package gpu

// The GPU loader: the only cgo in this package. It dlopens libcuda.so.1 at
// run time and calls the CUDA driver API through function pointers, so
// building needs neither the CUDA toolkit nor its headers: the few types and
// prototypes used are declared here by hand, following the driver API's
// documented ABI (64-bit CUdeviceptr, opaque handle pointers, int CUresult).
//
// Every helper makes the given context current on the calling thread in the
// same C call, so goroutines moving between threads do not matter.

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct { char reserved[64]; } CUipcMemHandle;

#define TR_CTX_FAIL 0x40000000

static struct {
	void *lib;
	CUresult (*cuInit)(unsigned int);
	CUresult (*cuDriverGetVersion)(int *);
	CUresult (*cuGetErrorName)(CUresult, const char **);
	CUresult (*cuGetErrorString)(CUresult, const char **);
	CUresult (*cuDeviceGetCount)(int *);
	CUresult (*cuDeviceGet)(CUdevice *, int);
	CUresult (*cuDeviceGetName)(char *, int, CUdevice);
	CUresult (*cuDeviceTotalMem)(size_t *, CUdevice);
	CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
	CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
	CUresult (*cuCtxSetCurrent)(CUcontext);
	CUresult (*cuMemGetInfo)(size_t *, size_t *);
	CUresult (*cuMemAlloc)(CUdeviceptr *, size_t);
	CUresult (*cuMemAllocManaged)(CUdeviceptr *, size_t, unsigned int);
	CUresult (*cuMemFree)(CUdeviceptr);
	CUresult (*cuMemHostAlloc)(void **, size_t, unsigned int);
	CUresult (*cuMemFreeHost)(void *);
	CUresult (*cuMemcpyAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
	CUresult (*cuMemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream);
	CUresult (*cuStreamCreate)(CUstream *, unsigned int);
	CUresult (*cuStreamDestroy)(CUstream);
	CUresult (*cuStreamSynchronize)(CUstream);
	CUresult (*cuStreamQuery)(CUstream);
	CUresult (*cuStreamWaitEvent)(CUstream, CUevent, unsigned int);
	CUresult (*cuEventCreate)(CUevent *, unsigned int);
	CUresult (*cuEventRecord)(CUevent, CUstream);
	CUresult (*cuEventSynchronize)(CUevent);
	CUresult (*cuEventQuery)(CUevent);
	CUresult (*cuEventDestroy)(CUevent);
	CUresult (*cuStreamWriteValue64)(CUstream, CUdeviceptr, unsigned long long, unsigned int);
	CUresult (*cuStreamWaitValue64)(CUstream, CUdeviceptr, unsigned long long, unsigned int);
	CUresult (*cuPointerGetAttribute)(void *, int, CUdeviceptr);
	CUresult (*cuMemGetAddressRange)(CUdeviceptr *, size_t *, CUdeviceptr);
	CUresult (*cuIpcGetMemHandle)(CUipcMemHandle *, CUdeviceptr);
	CUresult (*cuIpcOpenMemHandle)(CUdeviceptr *, CUipcMemHandle, unsigned int);
	CUresult (*cuIpcCloseMemHandle)(CUdeviceptr);
	CUresult (*cuModuleLoadDataEx)(CUmodule *, const void *, unsigned int, int *, void **);
	CUresult (*cuModuleGetFunction)(CUfunction *, CUmodule, const char *);
	CUresult (*cuModuleUnload)(CUmodule);
	CUresult (*cuLaunchKernel)(CUfunction, unsigned int, unsigned int, unsigned int,
		unsigned int, unsigned int, unsigned int, unsigned int, CUstream, void **, void **);
} tr;

// Symbol table: field address, then candidate names (newest first).
typedef struct { void **slot; const char *names[3]; int optional; } tr_sym;

static char tr_errbuf[512];

// tr_load dlopens the driver and resolves the symbols. On failure it returns
// a message (static storage); on success NULL.
static const char *tr_load(const char *path) {
	tr_sym syms[] = {
		{(void **)&tr.cuInit, {"cuInit"}, 0},
		{(void **)&tr.cuDriverGetVersion, {"cuDriverGetVersion"}, 0},
		{(void **)&tr.cuGetErrorName, {"cuGetErrorName"}, 1},
		{(void **)&tr.cuGetErrorString, {"cuGetErrorString"}, 1},
		{(void **)&tr.cuDeviceGetCount, {"cuDeviceGetCount"}, 0},
		{(void **)&tr.cuDeviceGet, {"cuDeviceGet"}, 0},
		{(void **)&tr.cuDeviceGetName, {"cuDeviceGetName"}, 0},
		{(void **)&tr.cuDeviceTotalMem, {"cuDeviceTotalMem_v2"}, 0},
		{(void **)&tr.cuDevicePrimaryCtxRetain, {"cuDevicePrimaryCtxRetain"}, 0},
		{(void **)&tr.cuDevicePrimaryCtxRelease, {"cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"}, 0},
		{(void **)&tr.cuCtxSetCurrent, {"cuCtxSetCurrent"}, 0},
		{(void **)&tr.cuMemGetInfo, {"cuMemGetInfo_v2"}, 0},
		{(void **)&tr.cuMemAlloc, {"cuMemAlloc_v2"}, 0},
		{(void **)&tr.cuMemAllocManaged, {"cuMemAllocManaged"}, 1},
		{(void **)&tr.cuMemFree, {"cuMemFree_v2"}, 0},
		{(void **)&tr.cuMemHostAlloc, {"cuMemHostAlloc"}, 0},
		{(void **)&tr.cuMemFreeHost, {"cuMemFreeHost"}, 0},
		{(void **)&tr.cuMemcpyAsync, {"cuMemcpyAsync"}, 0},
		{(void **)&tr.cuMemsetD8Async, {"cuMemsetD8Async"}, 0},
		{(void **)&tr.cuStreamCreate, {"cuStreamCreate"}, 0},
		{(void **)&tr.cuStreamDestroy, {"cuStreamDestroy_v2", "cuStreamDestroy"}, 0},
		{(void **)&tr.cuStreamSynchronize, {"cuStreamSynchronize"}, 0},
		{(void **)&tr.cuStreamQuery, {"cuStreamQuery"}, 0},
		{(void **)&tr.cuStreamWaitEvent, {"cuStreamWaitEvent"}, 0},
		{(void **)&tr.cuEventCreate, {"cuEventCreate"}, 0},
		{(void **)&tr.cuEventRecord, {"cuEventRecord"}, 0},
		{(void **)&tr.cuEventSynchronize, {"cuEventSynchronize"}, 0},
		{(void **)&tr.cuEventQuery, {"cuEventQuery"}, 0},
		{(void **)&tr.cuEventDestroy, {"cuEventDestroy_v2", "cuEventDestroy"}, 0},
		{(void **)&tr.cuStreamWriteValue64, {"cuStreamWriteValue64_v2", "cuStreamWriteValue64"}, 1},
		{(void **)&tr.cuStreamWaitValue64, {"cuStreamWaitValue64_v2", "cuStreamWaitValue64"}, 1},
		{(void **)&tr.cuPointerGetAttribute, {"cuPointerGetAttribute"}, 0},
		{(void **)&tr.cuMemGetAddressRange, {"cuMemGetAddressRange_v2"}, 0},
		{(void **)&tr.cuIpcGetMemHandle, {"cuIpcGetMemHandle"}, 1},
		{(void **)&tr.cuIpcOpenMemHandle, {"cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"}, 1},
		{(void **)&tr.cuIpcCloseMemHandle, {"cuIpcCloseMemHandle"}, 1},
		{(void **)&tr.cuModuleLoadDataEx, {"cuModuleLoadDataEx"}, 1},
		{(void **)&tr.cuModuleGetFunction, {"cuModuleGetFunction"}, 1},
		{(void **)&tr.cuModuleUnload, {"cuModuleUnload"}, 1},
		{(void **)&tr.cuLaunchKernel, {"cuLaunchKernel"}, 1},
	};
	dlerror();
	tr.lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (tr.lib == NULL) {
		const char *e = dlerror();
		snprintf(tr_errbuf, sizeof tr_errbuf, "dlopen(%s): %s", path, e ? e : "unknown error");
		return tr_errbuf;
	}
	for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
		void *p = NULL;
		for (int j = 0; j < 3 && syms[i].names[j] != NULL && p == NULL; j++) {
			p = dlsym(tr.lib, syms[i].names[j]);
		}
		*syms[i].slot = p;
		if (p == NULL && !syms[i].optional) {
			snprintf(tr_errbuf, sizeof tr_errbuf, "dlsym(%s) in %s: symbol not found", syms[i].names[0], path);
			return tr_errbuf;
		}
	}
	return NULL;
}

static int tr_has(int which) {
	switch (which) {
	case 0: return tr.cuStreamWriteValue64 != NULL && tr.cuStreamWaitValue64 != NULL;
	case 1: return tr.cuIpcGetMemHandle != NULL && tr.cuIpcOpenMemHandle != NULL && tr.cuIpcCloseMemHandle != NULL;
	case 2: return tr.cuMemAllocManaged != NULL;
	case 3: return tr.cuModuleLoadDataEx != NULL && tr.cuModuleGetFunction != NULL && tr.cuModuleUnload != NULL && tr.cuLaunchKernel != NULL;
	}
	return 0;
}

static const char *tr_error_name(CUresult r) {
	const char *s = NULL;
	if (tr.cuGetErrorName == NULL || tr.cuGetErrorName(r, &s) != 0) return NULL;
	return s;
}

static const char *tr_error_string(CUresult r) {
	const char *s = NULL;
	if (tr.cuGetErrorString == NULL || tr.cuGetErrorString(r, &s) != 0) return NULL;
	return s;
}

#define SETCTX(ctx) do { CUresult r_ = tr.cuCtxSetCurrent(ctx); if (r_ != 0) return r_ | TR_CTX_FAIL; } while (0)

static CUresult tr_init(void) { return tr.cuInit(0); }
static CUresult tr_driver_version(int *v) { return tr.cuDriverGetVersion(v); }
static CUresult tr_device_count(int *n) { return tr.cuDeviceGetCount(n); }
static CUresult tr_device_get(CUdevice *d, int ord) { return tr.cuDeviceGet(d, ord); }
static CUresult tr_device_name(char *buf, int n, CUdevice d) { return tr.cuDeviceGetName(buf, n, d); }
static CUresult tr_device_total_mem(size_t *n, CUdevice d) { return tr.cuDeviceTotalMem(n, d); }
static CUresult tr_ctx_retain(CUcontext *c, CUdevice d) { return tr.cuDevicePrimaryCtxRetain(c, d); }
static CUresult tr_ctx_release(CUdevice d) { return tr.cuDevicePrimaryCtxRelease(d); }

static CUresult tr_mem_get_info(CUcontext c, size_t *fr, size_t *tot) { SETCTX(c); return tr.cuMemGetInfo(fr, tot); }
static CUresult tr_mem_alloc(CUcontext c, CUdeviceptr *p, size_t n) { SETCTX(c); return tr.cuMemAlloc(p, n); }
static CUresult tr_mem_alloc_managed(CUcontext c, CUdeviceptr *p, size_t n) { SETCTX(c); return tr.cuMemAllocManaged(p, n, 1); }
static CUresult tr_mem_free(CUcontext c, CUdeviceptr p) { SETCTX(c); return tr.cuMemFree(p); }
// CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP
static CUresult tr_mem_host_alloc(CUcontext c, void **p, size_t n) { SETCTX(c); return tr.cuMemHostAlloc(p, n, 0x01 | 0x02); }
static CUresult tr_mem_free_host(CUcontext c, void *p) { SETCTX(c); return tr.cuMemFreeHost(p); }
// Synchronous copies and memsets run on the calling thread's default stream
// (CU_STREAM_PER_THREAD) and wait for it. cuMemcpy and cuMemsetD8 are not
// synchronous enough: a copy from pageable memory or a memset may return
// before the bytes reach device memory, and they run on the legacy stream,
// which our non-blocking streams do not wait for.
#define TR_STREAM_PER_THREAD ((CUstream)0x2)
static CUresult tr_memcpy(CUcontext c, CUdeviceptr d, CUdeviceptr s, size_t n) {
	SETCTX(c);
	CUresult r = tr.cuMemcpyAsync(d, s, n, TR_STREAM_PER_THREAD);
	return r != 0 ? r : tr.cuStreamSynchronize(TR_STREAM_PER_THREAD);
}
// The host side of tr_memcpy_htod and tr_memcpy_dtoh is Go memory passed as
// a pointer, so cgo's rules keep it in place for the call.
static CUresult tr_memcpy_htod(CUcontext c, CUdeviceptr d, const void *s, size_t n) { return tr_memcpy(c, d, (CUdeviceptr)(size_t)s, n); }
static CUresult tr_memcpy_dtoh(CUcontext c, void *d, CUdeviceptr s, size_t n) { return tr_memcpy(c, (CUdeviceptr)(size_t)d, s, n); }
static CUresult tr_memcpy_async(CUcontext c, CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) { SETCTX(c); return tr.cuMemcpyAsync(d, s, n, st); }
static CUresult tr_memset(CUcontext c, CUdeviceptr d, unsigned char v, size_t n) {
	SETCTX(c);
	CUresult r = tr.cuMemsetD8Async(d, v, n, TR_STREAM_PER_THREAD);
	return r != 0 ? r : tr.cuStreamSynchronize(TR_STREAM_PER_THREAD);
}
static CUresult tr_memset_async(CUcontext c, CUdeviceptr d, unsigned char v, size_t n, CUstream st) { SETCTX(c); return tr.cuMemsetD8Async(d, v, n, st); }
// CU_STREAM_NON_BLOCKING
static CUresult tr_stream_create(CUcontext c, CUstream *s) { SETCTX(c); return tr.cuStreamCreate(s, 0x1); }
static CUresult tr_stream_destroy(CUcontext c, CUstream s) { SETCTX(c); return tr.cuStreamDestroy(s); }
static CUresult tr_stream_synchronize(CUcontext c, CUstream s) { SETCTX(c); return tr.cuStreamSynchronize(s); }
static CUresult tr_stream_query(CUcontext c, CUstream s) { SETCTX(c); return tr.cuStreamQuery(s); }
static CUresult tr_stream_wait_event(CUcontext c, CUstream s, CUevent e) { SETCTX(c); return tr.cuStreamWaitEvent(s, e, 0); }
// CU_EVENT_DISABLE_TIMING
static CUresult tr_event_create(CUcontext c, CUevent *e, unsigned int flags) { SETCTX(c); return tr.cuEventCreate(e, flags); }
static CUresult tr_event_record(CUcontext c, CUevent e, CUstream s) { SETCTX(c); return tr.cuEventRecord(e, s); }
static CUresult tr_event_synchronize(CUcontext c, CUevent e) { SETCTX(c); return tr.cuEventSynchronize(e); }
static CUresult tr_event_query(CUcontext c, CUevent e) { SETCTX(c); return tr.cuEventQuery(e); }
static CUresult tr_event_destroy(CUcontext c, CUevent e) { SETCTX(c); return tr.cuEventDestroy(e); }
static CUresult tr_write_value64(CUcontext c, CUstream s, CUdeviceptr p, unsigned long long v) { SETCTX(c); return tr.cuStreamWriteValue64(s, p, v, 0); }
static CUresult tr_wait_value64(CUcontext c, CUstream s, CUdeviceptr p, unsigned long long v, unsigned int flags) { SETCTX(c); return tr.cuStreamWaitValue64(s, p, v, flags); }
static CUresult tr_pointer_attr(CUcontext c, void *out, int attr, CUdeviceptr p) { SETCTX(c); return tr.cuPointerGetAttribute(out, attr, p); }
static CUresult tr_address_range(CUcontext c, CUdeviceptr *base, size_t *n, CUdeviceptr p) { SETCTX(c); return tr.cuMemGetAddressRange(base, n, p); }
static CUresult tr_ipc_get(CUcontext c, void *out64, CUdeviceptr p) {
	SETCTX(c);
	CUipcMemHandle h;
	CUresult r = tr.cuIpcGetMemHandle(&h, p);
	if (r == 0) memcpy(out64, h.reserved, 64);
	return r;
}
// CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
static CUresult tr_ipc_open(CUcontext c, CUdeviceptr *p, const void *in64) {
	SETCTX(c);
	CUipcMemHandle h;
	memcpy(h.reserved, in64, 64);
	return tr.cuIpcOpenMemHandle(p, h, 0x1);
}
static CUresult tr_ipc_close(CUcontext c, CUdeviceptr p) { SETCTX(c); return tr.cuIpcCloseMemHandle(p); }
// CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES: the JIT
// compiler's complaints about a PTX image land in log.
static CUresult tr_module_load(CUcontext c, CUmodule *m, const void *image, char *log, unsigned int logsz) {
	SETCTX(c);
	int opts[2] = {5, 6};
	void *vals[2] = {log, (void *)(size_t)logsz};
	return tr.cuModuleLoadDataEx(m, image, 2, opts, vals);
}
static CUresult tr_module_function(CUcontext c, CUfunction *f, CUmodule m, const char *name) { SETCTX(c); return tr.cuModuleGetFunction(f, m, name); }
static CUresult tr_module_unload(CUcontext c, CUmodule m) { SETCTX(c); return tr.cuModuleUnload(m); }
// tr_launch launches f with its n parameters at params + offs[i] (the driver
// copies them before returning).
#define TR_MAX_PARAMS 64
static CUresult tr_launch(CUcontext c, CUfunction f, const unsigned int *dims, CUstream s, char *params, const size_t *offs, int n) {
	SETCTX(c);
	void *ptrs[TR_MAX_PARAMS];
	if (n < 0 || n > TR_MAX_PARAMS) return 1; // CUDA_ERROR_INVALID_VALUE
	for (int i = 0; i < n; i++) ptrs[i] = params + offs[i];
	return tr.cuLaunchKernel(f, dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], 0, s, ptrs, NULL);
}
*/
import "C"

import (
	"fmt"
	"os"
	"sync"
	"unsafe"
)

// cuLibPath is the driver library the loader opens, unless
// TROUPE_CUDA_LIBRARY names another file.
const cuLibPath = "libcuda.so.1"

// CUresult values the package interprets.
const (
	cuSuccess       = 0
	cuErrorNotReady = 600
	trCtxFail       = C.TR_CTX_FAIL
)

type (
	cuDevice   = C.CUdevice
	cuContext  = C.CUcontext
	cuStream   = C.CUstream
	cuEvent    = C.CUevent
	cuModule   = C.CUmodule
	cuFunction = C.CUfunction
)

// cuErr turns a CUresult from a loader helper into an error naming call.
func cuErr(call string, r C.CUresult) error {
	if r == cuSuccess {
		return nil
	}
	if r&trCtxFail != 0 {
		call, r = "cuCtxSetCurrent (before "+call+")", r&^trCtxFail
	}
	e := &CUDAError{Call: call, Result: int(r)}
	if s := C.tr_error_name(r); s != nil {
		e.Name = C.GoString(s)
	}
	if s := C.tr_error_string(r); s != nil {
		e.Text = C.GoString(s)
	}
	return e
}

// cuLib is the loaded driver.
type cuLib struct {
	version int
}

var (
	loadOnce sync.Once
	loaded   *cuLib
	loadErr  error
)

// loadCUDA dlopens the driver and calls cuInit, once per process.
func loadCUDA() (*cuLib, error) {
	loadOnce.Do(func() {
		path := cuLibPath
		if v := os.Getenv(EnvCUDALibrary); v != "" {
			path = v
		}
		p := C.CString(path)
		defer C.free(unsafe.Pointer(p))
		if msg := C.tr_load(p); msg != nil {
			loadErr = fmt.Errorf("gpu: cuda: no CUDA driver: %s", C.GoString(msg))
			return
		}
		if err := cuErr("cuInit", C.tr_init()); err != nil {
			loadErr = err
			return
		}
		var v C.int
		if err := cuErr("cuDriverGetVersion", C.tr_driver_version(&v)); err != nil {
			loadErr = err
			return
		}
		loaded = &cuLib{version: int(v)}
	})
	return loaded, loadErr
}

func (l *cuLib) hasMemOps() bool  { return C.tr_has(0) != 0 }
func (l *cuLib) hasIPC() bool     { return C.tr_has(1) != 0 }
func (l *cuLib) hasManaged() bool { return C.tr_has(2) != 0 }
func (l *cuLib) hasModules() bool { return C.tr_has(3) != 0 }

func (l *cuLib) deviceCount() (int, error) {
	var n C.int
	return int(n), cuErr("cuDeviceGetCount", C.tr_device_count(&n))
}

func (l *cuLib) deviceGet(ord int) (cuDevice, error) {
	var d C.CUdevice
	return d, cuErr("cuDeviceGet", C.tr_device_get(&d, C.int(ord)))
}

func (l *cuLib) deviceName(d cuDevice) (string, error) {
	var buf [256]C.char
	if err := cuErr("cuDeviceGetName", C.tr_device_name(&buf[0], C.int(len(buf)), d)); err != nil {
		return "", err
	}
	return C.GoString(&buf[0]), nil
}

func (l *cuLib) deviceTotalMem(d cuDevice) (uint64, error) {
	var n C.size_t
	return uint64(n), cuErr("cuDeviceTotalMem_v2", C.tr_device_total_mem(&n, d))
}

func (l *cuLib) primaryCtxRetain(d cuDevice) (cuContext, error) {
	var c C.CUcontext
	return c, cuErr("cuDevicePrimaryCtxRetain", C.tr_ctx_retain(&c, d))
}

func (l *cuLib) primaryCtxRelease(d cuDevice) error {
	return cuErr("cuDevicePrimaryCtxRelease", C.tr_ctx_release(d))
}

func (l *cuLib) memGetInfo(c cuContext) (uint64, uint64, error) {
	var fr, tot C.size_t
	err := cuErr("cuMemGetInfo_v2", C.tr_mem_get_info(c, &fr, &tot))
	return uint64(fr), uint64(tot), err
}

func (l *cuLib) memAlloc(c cuContext, n int) (uint64, error) {
	var p C.CUdeviceptr
	return uint64(p), cuErr("cuMemAlloc_v2", C.tr_mem_alloc(c, &p, C.size_t(n)))
}

func (l *cuLib) memAllocManaged(c cuContext, n int) (uint64, error) {
	var p C.CUdeviceptr
	return uint64(p), cuErr("cuMemAllocManaged", C.tr_mem_alloc_managed(c, &p, C.size_t(n)))
}

func (l *cuLib) memFree(c cuContext, p uint64) error {
	return cuErr("cuMemFree_v2", C.tr_mem_free(c, C.CUdeviceptr(p)))
}

// memHostAlloc returns pinned, portable, device-mapped host memory as a Go
// slice over C memory (never Go heap).
func (l *cuLib) memHostAlloc(c cuContext, n int) ([]byte, error) {
	var p unsafe.Pointer
	if err := cuErr("cuMemHostAlloc", C.tr_mem_host_alloc(c, &p, C.size_t(n))); err != nil {
		return nil, err
	}
	return unsafe.Slice((*byte)(p), n), nil
}

func (l *cuLib) memFreeHost(c cuContext, mem []byte) error {
	return cuErr("cuMemFreeHost", C.tr_mem_free_host(c, unsafe.Pointer(unsafe.SliceData(mem))))
}

func (l *cuLib) memcpy(c cuContext, dst, src uint64, n int) error {
	return cuErr("cuMemcpyAsync (per-thread stream, synchronized)", C.tr_memcpy(c, C.CUdeviceptr(dst), C.CUdeviceptr(src), C.size_t(n)))
}

// memcpyHtoD copies n bytes at src, Go memory, to dst, and memcpyDtoH n
// bytes at src to Go memory at dst. The Go memory is passed to C as a
// pointer, never a uintptr, so it cannot move during the copy (a uintptr to
// a stack variable goes stale when the goroutine's stack grows before the C
// call).
func (l *cuLib) memcpyHtoD(c cuContext, dst uint64, src unsafe.Pointer, n int) error {
	return cuErr("cuMemcpyAsync (per-thread stream, synchronized)", C.tr_memcpy_htod(c, C.CUdeviceptr(dst), src, C.size_t(n)))
}

func (l *cuLib) memcpyDtoH(c cuContext, dst unsafe.Pointer, src uint64, n int) error {
	return cuErr("cuMemcpyAsync (per-thread stream, synchronized)", C.tr_memcpy_dtoh(c, dst, C.CUdeviceptr(src), C.size_t(n)))
}

func (l *cuLib) memcpyAsync(c cuContext, dst, src uint64, n int, s cuStream) error {
	return cuErr("cuMemcpyAsync", C.tr_memcpy_async(c, C.CUdeviceptr(dst), C.CUdeviceptr(src), C.size_t(n), s))
}

func (l *cuLib) memsetD8(c cuContext, dst uint64, v byte, n int) error {
	return cuErr("cuMemsetD8Async (per-thread stream, synchronized)", C.tr_memset(c, C.CUdeviceptr(dst), C.uchar(v), C.size_t(n)))
}

func (l *cuLib) memsetD8Async(c cuContext, dst uint64, v byte, n int, s cuStream) error {
	return cuErr("cuMemsetD8Async", C.tr_memset_async(c, C.CUdeviceptr(dst), C.uchar(v), C.size_t(n), s))
}

func (l *cuLib) streamCreate(c cuContext) (cuStream, error) {
	var s C.CUstream
	return s, cuErr("cuStreamCreate", C.tr_stream_create(c, &s))
}

func (l *cuLib) streamDestroy(c cuContext, s cuStream) error {
	return cuErr("cuStreamDestroy_v2", C.tr_stream_destroy(c, s))
}

func (l *cuLib) streamSynchronize(c cuContext, s cuStream) error {
	return cuErr("cuStreamSynchronize", C.tr_stream_synchronize(c, s))
}

func (l *cuLib) streamQuery(c cuContext, s cuStream) (bool, error) {
	r := C.tr_stream_query(c, s)
	if r == cuErrorNotReady {
		return false, nil
	}
	return r == cuSuccess, cuErr("cuStreamQuery", r)
}

func (l *cuLib) streamWaitEvent(c cuContext, s cuStream, e cuEvent) error {
	return cuErr("cuStreamWaitEvent", C.tr_stream_wait_event(c, s, e))
}

// cuEventCreate flags.
const (
	cuEventBlockingSync  = 0x1 // cuEventSynchronize blocks the thread instead of spinning
	cuEventDisableTiming = 0x2
)

func (l *cuLib) eventCreate(c cuContext, flags uint32) (cuEvent, error) {
	var e C.CUevent
	return e, cuErr("cuEventCreate", C.tr_event_create(c, &e, C.uint(flags)))
}

func (l *cuLib) eventRecord(c cuContext, e cuEvent, s cuStream) error {
	return cuErr("cuEventRecord", C.tr_event_record(c, e, s))
}

func (l *cuLib) eventSynchronize(c cuContext, e cuEvent) error {
	return cuErr("cuEventSynchronize", C.tr_event_synchronize(c, e))
}

func (l *cuLib) eventQuery(c cuContext, e cuEvent) (bool, error) {
	r := C.tr_event_query(c, e)
	if r == cuErrorNotReady {
		return false, nil
	}
	return r == cuSuccess, cuErr("cuEventQuery", r)
}

func (l *cuLib) eventDestroy(c cuContext, e cuEvent) error {
	return cuErr("cuEventDestroy_v2", C.tr_event_destroy(c, e))
}

func (l *cuLib) streamWriteValue64(c cuContext, s cuStream, addr, v uint64) error {
	if !l.hasMemOps() {
		return fmt.Errorf("gpu: cuda: cuStreamWriteValue64: %w by this driver", ErrNotSupported)
	}
	return cuErr("cuStreamWriteValue64", C.tr_write_value64(c, s, C.CUdeviceptr(addr), C.ulonglong(v)))
}

func (l *cuLib) streamWaitValue64(c cuContext, s cuStream, addr, v uint64, flags uint32) error {
	if !l.hasMemOps() {
		return fmt.Errorf("gpu: cuda: cuStreamWaitValue64: %w by this driver", ErrNotSupported)
	}
	return cuErr("cuStreamWaitValue64", C.tr_wait_value64(c, s, C.CUdeviceptr(addr), C.ulonglong(v), C.uint(flags)))
}

// CUpointer_attribute values.
const (
	cuPointerAttrMemoryType    = 2
	cuPointerAttrIsManaged     = 8
	cuPointerAttrDeviceOrdinal = 9
)

// CUmemorytype values.
const (
	cuMemoryTypeHost    = 1
	cuMemoryTypeDevice  = 2
	cuMemoryTypeUnified = 4
)

func (l *cuLib) pointerMemoryType(c cuContext, p uint64) (memType uint32, ordinal int, managed bool, err error) {
	var mt C.uint
	if err = cuErr("cuPointerGetAttribute", C.tr_pointer_attr(c, unsafe.Pointer(&mt), cuPointerAttrMemoryType, C.CUdeviceptr(p))); err != nil {
		return 0, -1, false, err
	}
	var m C.uint
	if C.tr_pointer_attr(c, unsafe.Pointer(&m), cuPointerAttrIsManaged, C.CUdeviceptr(p)) == cuSuccess {
		managed = m != 0
	}
	var ord C.int
	ordinal = -1
	if C.tr_pointer_attr(c, unsafe.Pointer(&ord), cuPointerAttrDeviceOrdinal, C.CUdeviceptr(p)) == cuSuccess {
		ordinal = int(ord)
	}
	return uint32(mt), ordinal, managed, nil
}

func (l *cuLib) addressRange(c cuContext, p uint64) (uint64, uint64, error) {
	var base C.CUdeviceptr
	var n C.size_t
	err := cuErr("cuMemGetAddressRange_v2", C.tr_address_range(c, &base, &n, C.CUdeviceptr(p)))
	return uint64(base), uint64(n), err
}

func (l *cuLib) ipcGetMemHandle(c cuContext, p uint64) ([64]byte, error) {
	var h [64]byte
	if !l.hasIPC() {
		return h, fmt.Errorf("gpu: cuda: cuIpcGetMemHandle: %w by this driver", ErrNotSupported)
	}
	err := cuErr("cuIpcGetMemHandle", C.tr_ipc_get(c, unsafe.Pointer(&h[0]), C.CUdeviceptr(p)))
	return h, err
}

func (l *cuLib) ipcOpenMemHandle(c cuContext, h [64]byte) (uint64, error) {
	if !l.hasIPC() {
		return 0, fmt.Errorf("gpu: cuda: cuIpcOpenMemHandle: %w by this driver", ErrNotSupported)
	}
	var p C.CUdeviceptr
	err := cuErr("cuIpcOpenMemHandle", C.tr_ipc_open(c, &p, unsafe.Pointer(&h[0])))
	return uint64(p), err
}

func (l *cuLib) ipcCloseMemHandle(c cuContext, p uint64) error {
	return cuErr("cuIpcCloseMemHandle", C.tr_ipc_close(c, C.CUdeviceptr(p)))
}

// jitLogSize bounds the JIT error log kept from a failed module load.
const jitLogSize = 4096

func (l *cuLib) moduleLoad(c cuContext, image []byte) (cuModule, error) {
	var m C.CUmodule
	if !l.hasModules() {
		return m, fmt.Errorf("gpu: cuda: cuModuleLoadDataEx: %w by this driver", ErrNotSupported)
	}
	// A PTX image is a NUL-terminated string; the copy adds the NUL.
	img := C.CBytes(append(image[:len(image):len(image)], 0))
	defer C.free(img)
	log := (*C.char)(C.calloc(jitLogSize, 1))
	defer C.free(unsafe.Pointer(log))
	err := cuErr("cuModuleLoadDataEx", C.tr_module_load(c, &m, img, log, jitLogSize))
	if err != nil {
		if msg := C.GoString(log); msg != "" {
			err = fmt.Errorf("%w; JIT log: %s", err, msg)
		}
	}
	return m, err
}

func (l *cuLib) moduleFunction(c cuContext, m cuModule, name string) (cuFunction, error) {
	var f C.CUfunction
	cs := C.CString(name)
	defer C.free(unsafe.Pointer(cs))
	return f, cuErr("cuModuleGetFunction", C.tr_module_function(c, &f, m, cs))
}

func (l *cuLib) moduleUnload(c cuContext, m cuModule) error {
	return cuErr("cuModuleUnload", C.tr_module_unload(c, m))
}

// launch calls cuLaunchKernel with grid and block dimensions dims (grid x,
// y, z, then block x, y, z) and the parameters at params[offs[i]:].
func (l *cuLib) launch(c cuContext, f cuFunction, dims [6]uint32, s cuStream, params []byte, offs []int) error {
	var cdims [6]C.uint
	for i, d := range dims {
		cdims[i] = C.uint(d)
	}
	coffs := make([]C.size_t, len(offs)+1) // never empty, so &coffs[0] is valid
	for i, o := range offs {
		coffs[i] = C.size_t(o)
	}
	var p *C.char
	if len(params) > 0 {
		p = (*C.char)(unsafe.Pointer(&params[0]))
	}
	return cuErr("cuLaunchKernel", C.tr_launch(c, f, &cdims[0], s, p, &coffs[0], C.int(len(offs))))
}
