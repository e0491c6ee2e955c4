// troupe_kernel.h: the small CUDA dialect troupe's kernels are written in,
// so that one source compiles two ways:
//
//   - for the GPU, by clang (-x cuda --cuda-device-only -nocudainc
//     -nocudalib -S), into the PTX that Device.LoadModule loads;
//   - for the host (g++ -x c++), into the test driver gpu/testdata/fakecuda,
//     which runs a launch's threads one after another on its stream thread,
//     so the cuda backend's launch path and the kernels' index arithmetic
//     are exercised on machines without a GPU.
//
// A kernel takes exactly one parameter, a struct passed by value whose
// fields are all 8 bytes wide (pointers, long long, unsigned long long,
// double), so that Go lays it out with encoding/binary:
//
//	typedef struct { double *x; long long n; } Args;
//	TROUPE_KERNEL(scale, Args, a) { ... a.x[i] ... }
//
// Inside a kernel: threadIdx, blockIdx, blockDim, gridDim (x, y, z), as in
// CUDA; troupe_atomic_max_u64(p, v) (atomic max on a 64-bit word);
// TROUPE_SHARED (block-shared variables), troupe_sync_block(),
// troupe_fence_system() and troupe_clock_ns(); and helper functions marked
// TROUPE_DEVICE. The test driver runs a block's threads one after another,
// so troupe_sync_block cannot wait there for the other threads: a kernel
// that relies on it tests TROUPE_SEQUENTIAL (1 in the test driver, 0 on a
// GPU) and lets one thread do the whole block's work.

#ifndef TROUPE_KERNEL_H
#define TROUPE_KERNEL_H

#if defined(__CUDA__) && defined(__CUDA_ARCH__)
// Device compilation by clang.
#include <__clang_cuda_builtin_vars.h>
#define TROUPE_KERNEL(name, T, a) extern "C" __attribute__((global)) void name(T a)
#define TROUPE_DEVICE static __attribute__((device)) __attribute__((always_inline)) inline
// The plain read first: a reduction where every thread folds its value
// into one word would otherwise serialise on that word's atomics; most
// threads find a larger maximum there already and skip the atomic.
TROUPE_DEVICE unsigned long long troupe_atomic_max_u64(unsigned long long *p, unsigned long long v) {
	unsigned long long cur = *(volatile unsigned long long *)p;
	return cur < v ? __nvvm_atom_max_gen_ull(p, v) : cur;
}
#define TROUPE_SEQUENTIAL 0
#define TROUPE_SHARED static __attribute__((shared))
// troupe_sync_block: a barrier of the threads of one block (__syncthreads).
TROUPE_DEVICE void troupe_sync_block(void) { __nvvm_bar_sync(0); }
// troupe_fence_system: orders this thread's memory operations for every
// observer, the host included (membar.sys).
TROUPE_DEVICE void troupe_fence_system(void) { __nvvm_membar_sys(); }
// troupe_clock_ns: the GPU's global nanosecond timer.
TROUPE_DEVICE unsigned long long troupe_clock_ns(void) {
	unsigned long long t;
	asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
	return t;
}

#elif !defined(__CUDA__)
// Host compilation for the test driver, which owns these thread-locals and
// sets them before calling each thread of a launch.
#include <stddef.h>
#include <string.h>
struct troupe_dim3 {
	unsigned int x, y, z;
};
extern "C" __thread struct troupe_dim3 fakecuda_threadIdx, fakecuda_blockIdx, fakecuda_blockDim, fakecuda_gridDim;
#define threadIdx fakecuda_threadIdx
#define blockIdx fakecuda_blockIdx
#define blockDim fakecuda_blockDim
#define gridDim fakecuda_gridDim
// fakecuda_kernel_<name>(args) runs one thread with a copy of the
// parameter; fakecuda_kernel_<name>(NULL) returns the parameter's size.
#define TROUPE_KERNEL(name, T, a)                                      \
	static void name##_thread(T a);                                    \
	extern "C" size_t fakecuda_kernel_##name(const void *p) {          \
		if (p != NULL) {                                               \
			T copy_;                                                   \
			memcpy(&copy_, p, sizeof copy_);                           \
			name##_thread(copy_);                                      \
		}                                                              \
		return sizeof(T);                                              \
	}                                                                  \
	static void name##_thread(T a)
#define TROUPE_DEVICE static inline
static inline unsigned long long troupe_atomic_max_u64(unsigned long long *p, unsigned long long v) {
	unsigned long long cur = __atomic_load_n(p, __ATOMIC_RELAXED);
	while (cur < v && !__atomic_compare_exchange_n(p, &cur, v, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
	}
	return cur;
}
#include <time.h>
#define TROUPE_SEQUENTIAL 1
#define TROUPE_SHARED static
static inline void troupe_sync_block(void) {}
static inline void troupe_fence_system(void) { __sync_synchronize(); }
static inline unsigned long long troupe_clock_ns(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (unsigned long long)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}
#endif

#endif
