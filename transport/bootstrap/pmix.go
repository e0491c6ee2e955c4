//go:build cgo && linux

package bootstrap

// The PMIx backend: ranks started by a PMIx launcher (Open MPI's mpirun,
// PRRTE's prterun, srun --mpi=pmix) join their job through the launcher's
// PMIx server. libpmix is loaded at run time with dlopen, so building needs
// neither PMIx's headers nor its library, and a program that never runs
// under a PMIx launcher never loads it. The few types used are declared
// here by hand after the PMIx Standard's structures (pmix_proc_t,
// pmix_value_t, pmix_info_t); TestPMIxABI compares them with the installed
// pmix.h where there is one (checked against PMIx 4.2.2).

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int tp_status;
enum {
	TP_SUCCESS = 0,
	TP_BOOL = 1,           // PMIX_BOOL
	TP_UINT32 = 14,        // PMIX_UINT32
	TP_BYTE_OBJECT = 27,   // PMIX_BYTE_OBJECT
	TP_GLOBAL = 3,         // PMIX_GLOBAL scope
	TP_MAX_NSLEN = 255,    // PMIX_MAX_NSLEN
	TP_MAX_KEYLEN = 511,   // PMIX_MAX_KEYLEN
	TP_WRONG_TYPE = -1000, // not a PMIx status: a value of another type than asked
};
#define TP_RANK_WILDCARD (UINT32_MAX - 1)  // PMIX_RANK_WILDCARD
#define TP_KEY_JOB_SIZE "pmix.job.size"     // PMIX_JOB_SIZE
#define TP_KEY_COLLECT "pmix.collect"       // PMIX_COLLECT_DATA

typedef struct { char nspace[TP_MAX_NSLEN + 1]; uint32_t rank; } tp_proc;
typedef struct { char *bytes; size_t size; } tp_bo;
typedef struct {
	uint16_t type;
	union { uint8_t flag; uint32_t uint32; tp_bo bo; char pad[24]; } data;
} tp_value;
typedef struct { char key[TP_MAX_KEYLEN + 1]; uint32_t flags; tp_value value; } tp_info;

static struct {
	void *lib;
	tp_status (*init)(tp_proc *, tp_info *, size_t);
	tp_status (*finalize)(const tp_info *, size_t);
	tp_status (*put)(uint8_t, const char *, tp_value *);
	tp_status (*commit)(void);
	tp_status (*fence)(const tp_proc *, size_t, const tp_info *, size_t);
	tp_status (*get)(const tp_proc *, const char *, const tp_info *, size_t, tp_value **);
	const char *(*error_string)(tp_status);
	const char *(*get_version)(void);
	char name[256]; // the library loaded
} tp;

static char tp_err[512];

// tp_open loads libpmix (name, else the usual sonames); it returns NULL or
// an error message.
static const char *tp_open(const char *name) {
	if (tp.lib) return NULL;
	const char *names[] = {name, "libpmix.so.2", "libpmix.so", NULL};
	void *lib = NULL;
	for (int i = 0; names[i] && !lib; i++) {
		if (names[i][0] == 0) continue;
		lib = dlopen(names[i], RTLD_NOW | RTLD_GLOBAL);
		if (!lib) snprintf(tp_err, sizeof tp_err, "dlopen %s: %s", names[i], dlerror());
		if (name[0] != 0) break; // a name given is the only one tried
	}
	if (!lib) return tp_err;
	struct { void **slot; const char *sym; } syms[] = {
		{(void **)&tp.init, "PMIx_Init"}, {(void **)&tp.finalize, "PMIx_Finalize"},
		{(void **)&tp.put, "PMIx_Put"}, {(void **)&tp.commit, "PMIx_Commit"},
		{(void **)&tp.fence, "PMIx_Fence"}, {(void **)&tp.get, "PMIx_Get"},
		{(void **)&tp.error_string, "PMIx_Error_string"},
	};
	for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
		*syms[i].slot = dlsym(lib, syms[i].sym);
		if (!*syms[i].slot) {
			snprintf(tp_err, sizeof tp_err, "libpmix has no %s", syms[i].sym);
			dlclose(lib);
			memset(&tp, 0, sizeof tp);
			return tp_err;
		}
	}
	tp.get_version = dlsym(lib, "PMIx_Get_version"); // optional: troupe info only
	for (int i = 0; names[i]; i++) {
		if (names[i][0] != 0 && dlopen(names[i], RTLD_NOW | RTLD_NOLOAD) == lib) {
			snprintf(tp.name, sizeof tp.name, "%s", names[i]);
			dlclose(lib); // the RTLD_NOLOAD reference
			break;
		}
	}
	tp.lib = lib;
	return NULL;
}

static const char *tp_version(void) { return tp.get_version ? tp.get_version() : ""; }
static const char *tp_libname(void) { return tp.name; }

static const char *tp_error(tp_status rc) {
	const char *s = tp.error_string ? tp.error_string(rc) : NULL;
	return s ? s : "unknown PMIx status";
}

static tp_status tp_init(tp_proc *me) { return tp.init(me, NULL, 0); }
static tp_status tp_finalize(void) { return tp.finalize(NULL, 0); }
static tp_status tp_commit(void) { return tp.commit(); }

// tp_get_typed gets rank's value under key, which must be of type want:
// *out, which the caller frees (and, for a byte object, its bytes).
static tp_status tp_get_typed(const tp_proc *me, uint32_t rank, const char *key, uint16_t want, tp_value **out) {
	tp_proc p;
	memcpy(p.nspace, me->nspace, sizeof p.nspace);
	p.rank = rank;
	tp_value *v = NULL;
	tp_status rc = tp.get(&p, key, NULL, 0, &v);
	if (rc != TP_SUCCESS) return rc;
	if (v == NULL || v->type != want) {
		if (v != NULL && v->type == TP_BYTE_OBJECT) free(v->data.bo.bytes);
		free(v);
		return TP_WRONG_TYPE;
	}
	*out = v;
	return TP_SUCCESS;
}

// tp_job_size reads the job's size (PMIX_JOB_SIZE of the namespace).
static tp_status tp_job_size(const tp_proc *me, uint32_t *size) {
	tp_value *v;
	tp_status rc = tp_get_typed(me, TP_RANK_WILDCARD, TP_KEY_JOB_SIZE, TP_UINT32, &v);
	if (rc != TP_SUCCESS) return rc;
	*size = v->data.uint32;
	free(v);
	return TP_SUCCESS;
}

// tp_put publishes n bytes under key for every rank (PMIx copies them).
static tp_status tp_put(const char *key, void *bytes, size_t n) {
	tp_value v;
	memset(&v, 0, sizeof v);
	v.type = TP_BYTE_OBJECT;
	v.data.bo.bytes = bytes;
	v.data.bo.size = n;
	return tp.put(TP_GLOBAL, key, &v);
}

// tp_fence waits for every rank of the namespace, collecting the data put
// since the last fence when collect is set.
static tp_status tp_fence(int collect) {
	if (!collect) return tp.fence(NULL, 0, NULL, 0);
	tp_info info;
	memset(&info, 0, sizeof info);
	strcpy(info.key, TP_KEY_COLLECT);
	info.value.type = TP_BOOL;
	info.value.data.flag = 1;
	return tp.fence(NULL, 0, &info, 1);
}

// tp_get fetches rank's byte object under key: *bytes (malloc'd, the
// caller frees it) and *n.
static tp_status tp_get(const tp_proc *me, uint32_t rank, const char *key, char **bytes, size_t *n) {
	tp_value *v;
	tp_status rc = tp_get_typed(me, rank, key, TP_BYTE_OBJECT, &v);
	if (rc != TP_SUCCESS) return rc;
	*bytes = v->data.bo.bytes;
	*n = v->data.bo.size;
	free(v);
	return TP_SUCCESS;
}

// tp_abi reports the layout and constants of the declarations above, in
// the order of pmixABINames, for TestPMIxABI.
static void tp_abi(size_t out[15]) {
	size_t v[15] = {
		sizeof(tp_proc), offsetof(tp_proc, rank),
		sizeof(tp_value), offsetof(tp_value, data), offsetof(tp_value, data.bo.size),
		sizeof(tp_info), offsetof(tp_info, flags), offsetof(tp_info, value),
		TP_RANK_WILDCARD, TP_SUCCESS, TP_BOOL, TP_UINT32, TP_BYTE_OBJECT, TP_GLOBAL, TP_MAX_KEYLEN,
	};
	memcpy(out, v, sizeof v);
}
static const char *tp_key_job_size(void) { return TP_KEY_JOB_SIZE; }
static const char *tp_key_collect(void) { return TP_KEY_COLLECT; }
*/
import "C"

import (
	"context"
	"fmt"
	"os"
	"sync"
	"time"
	"unsafe"
)

// EnvPMIxLib names the PMIx client library to load (a soname or a path);
// the default tries libpmix.so.2, then libpmix.so.
const EnvPMIxLib = "TROUPE_PMIX_LIB"

func init() { PMIx = joinPMIx }

// pmixMu serialises PMIx_Init and PMIx_Finalize (libpmix counts them).
var pmixMu sync.Mutex

// PMIxVersion loads the PMIx client library, as a PMIx launch would, and
// returns its name and PMIx's version string (empty if the library does
// not say), or why it cannot be loaded. troupe info reports it.
func PMIxVersion() (lib, version string, err error) {
	name := C.CString(os.Getenv(EnvPMIxLib))
	defer C.free(unsafe.Pointer(name))
	pmixMu.Lock()
	defer pmixMu.Unlock()
	if msg := C.tp_open(name); msg != nil {
		return "", "", fmt.Errorf("bootstrap: pmix: %s", C.GoString(msg))
	}
	return C.GoString(C.tp_libname()), C.GoString(C.tp_version()), nil
}

// pmixClient is the PMIx implementation of Bootstrapper.
type pmixClient struct {
	me         C.tp_proc
	rank, size int

	// turn is held by the collective running (and by Close): collectives
	// run one at a time, in call order, since PMIx fences are matched by
	// their order, not by name. It guards rounds and closed.
	turn   chan struct{}
	rounds map[string]int // how often each AllGather key was used
	closed bool
}

// pmixCloseWait is how long Close waits for a collective still running
// (one whose caller's context ended while a rank was missing) before it
// gives up finalizing PMIx.
const pmixCloseWait = time.Second

// pmixError is a failed PMIx call.
func pmixError(call string, rc C.tp_status) error {
	if rc == C.TP_WRONG_TYPE {
		return fmt.Errorf("bootstrap: pmix: %s: the value has an unexpected type", call)
	}
	return fmt.Errorf("bootstrap: pmix: %s: %s (status %d)", call, C.GoString(C.tp_error(rc)), int(rc))
}

// joinPMIx loads libpmix, connects to the launcher's PMIx server and
// returns the job's Bootstrapper.
func joinPMIx(ctx context.Context) (Bootstrapper, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("bootstrap: pmix: %w", err)
	}
	name := C.CString(os.Getenv(EnvPMIxLib))
	defer C.free(unsafe.Pointer(name))
	pmixMu.Lock()
	defer pmixMu.Unlock()
	if msg := C.tp_open(name); msg != nil {
		return nil, fmt.Errorf("bootstrap: started under a PMIx launcher, but its client library could not be loaded (%s); "+
			"install libpmix2 (or set %s), or start the job with `troupe run -n N -- PROGRAM`", C.GoString(msg), EnvPMIxLib)
	}
	c := &pmixClient{rounds: map[string]int{}, turn: make(chan struct{}, 1)}
	if rc := C.tp_init(&c.me); rc != C.TP_SUCCESS {
		return nil, pmixError("PMIx_Init", rc)
	}
	var size C.uint32_t
	if rc := C.tp_job_size(&c.me, &size); rc != C.TP_SUCCESS {
		C.tp_finalize()
		return nil, pmixError("PMIx_Get(pmix.job.size)", rc)
	}
	c.rank, c.size = int(c.me.rank), int(size)
	if c.size < 1 || c.rank >= c.size {
		C.tp_finalize()
		return nil, fmt.Errorf("bootstrap: pmix: rank %d out of range for a job of %d", c.rank, c.size)
	}
	return c, nil
}

func (c *pmixClient) Rank() int { return c.rank }
func (c *pmixClient) Size() int { return c.size }

// collective runs f under the collective lock on a goroutine of its own and
// waits for it or for ctx. PMIx cannot abandon a fence: when ctx ends
// first, f still runs to completion, and later collectives wait for it.
func (c *pmixClient) collective(ctx context.Context, name string, f func() error) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("bootstrap: pmix: collective %q: %w", name, err)
	}
	done := make(chan error, 1)
	go func() {
		c.turn <- struct{}{}
		defer func() { <-c.turn }()
		if c.closed {
			done <- ErrClosed
			return
		}
		done <- f()
	}()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return fmt.Errorf("bootstrap: pmix: collective %q: %w (the fence goes on; PMIx cannot abandon it)", name, ctx.Err())
	}
}

// AllGather puts value under a key of its own for this use of key
// (troupe.<key>.<n>), fences with data collection and gets every rank's.
// Each value travels with a one-byte prefix, so that empty values are
// byte objects too.
func (c *pmixClient) AllGather(ctx context.Context, key string, value []byte) ([][]byte, error) {
	var out [][]byte
	err := c.collective(ctx, key, func() error {
		n := c.rounds[key]
		pkey := fmt.Sprintf("troupe.%s.%d", key, n)
		if len(pkey) > C.TP_MAX_KEYLEN {
			return fmt.Errorf("bootstrap: pmix: AllGather key %q is too long: PMIx keys have at most %d characters", pkey, C.TP_MAX_KEYLEN)
		}
		c.rounds[key] = n + 1
		ck := C.CString(pkey)
		defer C.free(unsafe.Pointer(ck))
		buf := C.malloc(C.size_t(len(value) + 1))
		defer C.free(buf)
		b := unsafe.Slice((*byte)(buf), len(value)+1)
		b[0] = 1
		copy(b[1:], value)
		if rc := C.tp_put(ck, buf, C.size_t(len(b))); rc != C.TP_SUCCESS {
			return pmixError("PMIx_Put("+pkey+")", rc)
		}
		if rc := C.tp_commit(); rc != C.TP_SUCCESS {
			return pmixError("PMIx_Commit", rc)
		}
		if rc := C.tp_fence(1); rc != C.TP_SUCCESS {
			return pmixError("PMIx_Fence("+key+")", rc)
		}
		out = make([][]byte, c.size)
		for r := range c.size {
			var p *C.char
			var n C.size_t
			if rc := C.tp_get(&c.me, C.uint32_t(r), ck, &p, &n); rc != C.TP_SUCCESS {
				return pmixError(fmt.Sprintf("PMIx_Get(rank %d, %s)", r, pkey), rc)
			}
			got := C.GoBytes(unsafe.Pointer(p), C.int(n))
			C.free(unsafe.Pointer(p))
			if len(got) == 0 || got[0] != 1 {
				return fmt.Errorf("bootstrap: pmix: rank %d's value for %s is not troupe's (%d bytes)", r, pkey, len(got))
			}
			if len(got) > 1 {
				out[r] = got[1:]
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// Barrier is a fence of the whole namespace. Every rank must call the
// collectives in the same order: a fence has no name.
func (c *pmixClient) Barrier(ctx context.Context, name string) error {
	return c.collective(ctx, name, func() error {
		if rc := C.tp_fence(0); rc != C.TP_SUCCESS {
			return pmixError("PMIx_Fence("+name+")", rc)
		}
		return nil
	})
}

// Close finalizes PMIx; later collectives fail with ErrClosed. A
// collective still running after its caller gave up (a rank never came)
// is waited for up to pmixCloseWait; then Close returns an error and
// leaves PMIx as it is, to be cleaned up when the process exits.
func (c *pmixClient) Close() error {
	select {
	case c.turn <- struct{}{}:
	case <-time.After(pmixCloseWait):
		return fmt.Errorf("bootstrap: pmix: Close: a collective is still waiting for other ranks after %v; PMIx not finalized", pmixCloseWait)
	}
	defer func() { <-c.turn }()
	if c.closed {
		return nil
	}
	c.closed = true
	pmixMu.Lock()
	defer pmixMu.Unlock()
	if rc := C.tp_finalize(); rc != C.TP_SUCCESS {
		return pmixError("PMIx_Finalize", rc)
	}
	return nil
}

// pmixABINames are the C expressions, over pmix.h, that pmixABI's values
// stand for.
var pmixABINames = [15]string{
	"sizeof(pmix_proc_t)", "offsetof(pmix_proc_t, rank)",
	"sizeof(pmix_value_t)", "offsetof(pmix_value_t, data)", "offsetof(pmix_value_t, data.bo.size)",
	"sizeof(pmix_info_t)", "offsetof(pmix_info_t, flags)", "offsetof(pmix_info_t, value)",
	"PMIX_RANK_WILDCARD", "PMIX_SUCCESS", "PMIX_BOOL", "PMIX_UINT32", "PMIX_BYTE_OBJECT", "PMIX_GLOBAL", "PMIX_MAX_KEYLEN",
}

// pmixABI returns the sizes, offsets and constants of the hand-made PMIx
// declarations (pmixABINames), and the two PMIx keys they use
// (PMIX_JOB_SIZE, PMIX_COLLECT_DATA).
func pmixABI() (vals [15]uint64, jobSize, collect string) {
	var out [15]C.size_t
	C.tp_abi(&out[0])
	for i, v := range out {
		vals[i] = uint64(v)
	}
	return vals, C.GoString(C.tp_key_job_size()), C.GoString(C.tp_key_collect())
}
