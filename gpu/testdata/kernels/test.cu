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
