// Kernels of the gpu package's module tests (module_test.go). test.ptx is
// generated from this file by `make ptx` (clang); the test driver
// (testdata/fakecuda) compiles it for the host.
#include "troupe_kernel.h"

typedef struct {
	double *x, *y;
	double a;
	long long n;
} AxpyArgs;

// troupe_axpy: y[i] = a*x[i] + y[i] for i < n, one thread per element over
// a 1-D grid.
TROUPE_KERNEL(troupe_axpy, AxpyArgs, p) {
	long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
	if (i < p.n) {
		double t = p.a * p.x[i];
		p.y[i] = t + p.y[i];
	}
}

typedef struct {
	unsigned long long *out;
	unsigned long long *max;
} IdsArgs;

// troupe_ids: every thread of a 3-D launch writes its global linear id
// (x fastest, then y, then z) at that index of out, and folds it into *max.
TROUPE_KERNEL(troupe_ids, IdsArgs, p) {
	unsigned long long nx = (unsigned long long)gridDim.x * blockDim.x;
	unsigned long long ny = (unsigned long long)gridDim.y * blockDim.y;
	unsigned long long x = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
	unsigned long long y = (unsigned long long)blockIdx.y * blockDim.y + threadIdx.y;
	unsigned long long z = (unsigned long long)blockIdx.z * blockDim.z + threadIdx.z;
	unsigned long long id = x + nx * (y + ny * z);
	p.out[id] = id + 1;
	troupe_atomic_max_u64(p.max, id + 1);
}

typedef struct {
	unsigned char *dst;
	unsigned char *src;
	long long n;
} CopyArgs;

// troupe_copy: copies n bytes from src to dst (device memory, or pinned
// host memory mapped for the device) by a grid-stride loop, in 8-byte words
// when both pointers and n are multiples of 8, byte by byte otherwise.
// BenchmarkKernelCopy compares it with the copy engine for small copies.
TROUPE_KERNEL(troupe_copy, CopyArgs, p) {
	long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
	long long stride = (long long)gridDim.x * blockDim.x;
	if ((((unsigned long long)p.dst | (unsigned long long)p.src | (unsigned long long)p.n) & 7) == 0) {
		unsigned long long *d = (unsigned long long *)p.dst;
		unsigned long long *s = (unsigned long long *)p.src;
		for (long long i = t; i < p.n / 8; i += stride)
			d[i] = s[i];
	} else {
		for (long long i = t; i < p.n; i += stride)
			p.dst[i] = p.src[i];
	}
}
