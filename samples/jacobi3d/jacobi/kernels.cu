// The -gpu mode's kernels for backends that run device code (cuda): the
// sweep, face packing and ghost unpacking of kernel.go, one thread per
// point. kernels.ptx is generated from this file by `make ptx` (clang) and
// embedded (cuda.go); the tests also compile it into the test CUDA driver
// (internal/cudatest), so the same source runs on machines without a GPU.
//
// Every operation of the sweep is a separately rounded float64 operation in
// the reference's order, with no contraction into FMAs (clang and the host
// build use -ffp-contract=off; the PTX has mul.rn/add.rn), so the results
// match the host and serial runs bit for bit.
#include "troupe_kernel.h"

typedef struct {
	const double *u;           // padded field read
	double *v;                 // padded field written (interior only)
	unsigned long long *res;   // residual: max over points of bits(|v - u|)
	long long nx, ny, nz;      // interior size
	long long sx, sxy;         // strides of j and k in the padded array
	double c7;                 // the stencil weight
} SweepArgs;

// jacobi_sweep: point (i, j, k) of the interior is thread (x, y, z) of the
// grid. The residual is folded with an atomic max on the bits of |v - u|,
// which order like the non-negative doubles they encode; the caller zeroes
// it before the launch.
TROUPE_KERNEL(jacobi_sweep, SweepArgs, a) {
	long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
	long long j = (long long)blockIdx.y * blockDim.y + threadIdx.y;
	long long k = (long long)blockIdx.z * blockDim.z + threadIdx.z;
	if (i >= a.nx || j >= a.ny || k >= a.nz) return;
	long long c = (i + 1) + a.sx * (j + 1) + a.sxy * (k + 1);
	double old = a.u[c];
	double s = old;
	s += a.u[c - 1];
	s += a.u[c + 1];
	s += a.u[c - a.sx];
	s += a.u[c + a.sx];
	s += a.u[c - a.sxy];
	s += a.u[c + a.sxy];
	double nv = s * a.c7;
	a.v[c] = nv;
	union {
		double f;
		unsigned long long u;
	} d;
	d.f = nv - old;
	troupe_atomic_max_u64(a.res, d.u & ~(1ULL << 63)); // |nv - old|
}

typedef struct {
	double *u;        // padded field
	double *face;     // packed plane: p1 fastest
	long long base;   // index in u of the plane's point (0, 0)
	long long s1, s2; // strides in u along the plane's two axes
	long long n1, n2; // the plane's size
	long long pack;   // 1: u -> face (pack); 0: face -> u (unpack a ghost plane)
} FaceArgs;

// jacobi_face: point (p1, p2) of a plane is thread (x, y) of the grid.
TROUPE_KERNEL(jacobi_face, FaceArgs, a) {
	long long p1 = (long long)blockIdx.x * blockDim.x + threadIdx.x;
	long long p2 = (long long)blockIdx.y * blockDim.y + threadIdx.y;
	if (p1 >= a.n1 || p2 >= a.n2) return;
	long long ui = a.base + p1 * a.s1 + p2 * a.s2;
	long long fi = p1 + a.n1 * p2;
	if (a.pack)
		a.face[fi] = a.u[ui];
	else
		a.u[ui] = a.face[fi];
}
