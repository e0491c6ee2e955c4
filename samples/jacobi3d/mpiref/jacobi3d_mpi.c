/*
 * jacobi3d_mpi: the Jacobi3D reference problem (docs/jacobi3d.md and the
 * project's shared problem statement) written the way an MPI user would, so
 * that troupe's samples/jacobi3d can be compared with Open MPI and MPICH on
 * the same machine. One block per rank on a 3-D Cartesian grid of ranks
 * (MPI_Dims_create, its largest count along z, whose faces are contiguous,
 * as samples/jacobi3d does where the grid allows; along x with -xsplit),
 * ghost layers exchanged with MPI_Isend/MPI_Irecv of subarray datatypes,
 * the residual reduced with MPI_Allreduce every -every sweeps and after the
 * last. With -overlap the interior is swept while the halos travel and
 * the outer shell after they arrive.
 *
 * It prints, on rank 0, the same keys as samples/jacobi3d: sweeps, residual,
 * field_hash, iter_ms (median time per timed sweep at rank 0), mean_iter_ms
 * and comm_ms (time per timed sweep spent in MPI_Waitall and MPI_Allreduce,
 * mean over ranks).
 *
 * Build without floating-point contraction, as the problem requires:
 *   mpicc -O2 -ffp-contract=off -o jacobi3d_mpi jacobi3d_mpi.c
 */
#include <mpi.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const double C7 = 0.14285714285714285; /* 0x3FC2492492492492 */

static uint64_t mix64(uint64_t z) {
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
	z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
	return z ^ (z >> 31);
}

static int cmp_double(const void *a, const void *b) {
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

/* split gives rank c of n its share of N points: its first index and count. */
static void split(int N, int n, int c, int *first, int *count) {
	int base = N / n, extra = N % n;
	*count = base + (c < extra);
	*first = c * base + (c < extra ? c : extra);
}

struct box {
	int lx, ly, lz;    /* interior points of this rank */
	int sx, sy;        /* strides of the ghosted array (x fastest) */
};

#define AT(b, i, j, k) ((size_t)((i) + 1) + (size_t)(b).sx * ((size_t)((j) + 1) + (size_t)(b).sy * (size_t)((k) + 1)))

/* sweep sets unew over [i0,i1) x [j0,j1) x [k0,k1) and returns the largest
 * change, in the problem's order of operations. */
static double sweep(const struct box *b, const double *u, double *unew, int i0, int i1, int j0, int j1, int k0, int k1) {
	double r = 0;
	size_t sx = (size_t)b->sx, sxy = (size_t)b->sx * (size_t)b->sy;
	for (int k = k0; k < k1; k++)
		for (int j = j0; j < j1; j++) {
			size_t p = AT(*b, i0, j, k);
			for (int i = i0; i < i1; i++, p++) {
				double s = u[p];
				s += u[p - 1];
				s += u[p + 1];
				s += u[p - sx];
				s += u[p + sx];
				s += u[p - sxy];
				s += u[p + sxy];
				double nv = s * C7;
				unew[p] = nv;
				double d = fabs(nv - u[p]);
				if (d > r)
					r = d;
			}
		}
	return r;
}

static void usage(void) {
	fprintf(stderr, "usage: jacobi3d_mpi [-grid N] [-nx N -ny N -nz N] [-iters N] [-warmup N] [-every K] [-overlap] [-xsplit]\n");
	MPI_Abort(MPI_COMM_WORLD, 2);
}

int main(int argc, char **argv) {
	MPI_Init(&argc, &argv);
	int size, rank;
	MPI_Comm_size(MPI_COMM_WORLD, &size);
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	int N[3] = {96, 96, 96}, iters = 100, warmup = 10, every = 1, overlap = 0, xsplit = 0;
	for (int a = 1; a < argc; a++) {
		const char *f = argv[a];
		if (f[0] == '-' && f[1] == '-')
			f++;
		if (!strcmp(f, "-overlap")) {
			overlap = 1;
			continue;
		}
		if (!strcmp(f, "-xsplit")) {
			xsplit = 1;
			continue;
		}
		if (a + 1 >= argc)
			usage();
		int v = atoi(argv[++a]);
		if (!strcmp(f, "-grid"))
			N[0] = N[1] = N[2] = v;
		else if (!strcmp(f, "-nx"))
			N[0] = v;
		else if (!strcmp(f, "-ny"))
			N[1] = v;
		else if (!strcmp(f, "-nz"))
			N[2] = v;
		else if (!strcmp(f, "-iters"))
			iters = v;
		else if (!strcmp(f, "-warmup"))
			warmup = v;
		else if (!strcmp(f, "-every"))
			every = v;
		else
			usage();
	}
	if (N[0] < 1 || N[1] < 1 || N[2] < 1 || iters < 1 || warmup < 0 || every < 1)
		usage();

	int dims[3] = {0, 0, 0}, periods[3] = {0, 0, 0}, coords[3];
	MPI_Dims_create(size, 3, dims);
	if (!xsplit && dims[2] <= N[0] && dims[0] <= N[2]) {
		/* Largest count along z, as jacobi.DefaultBlocks does. */
		int t = dims[0];
		dims[0] = dims[2];
		dims[2] = t;
	}
	MPI_Comm cart;
	MPI_Cart_create(MPI_COMM_WORLD, 3, dims, periods, 0, &cart);
	MPI_Cart_coords(cart, rank, 3, coords);
	int first[3], count[3];
	for (int d = 0; d < 3; d++) {
		split(N[d], dims[d], coords[d], &first[d], &count[d]);
		if (count[d] < 1) {
			if (rank == 0)
				fprintf(stderr, "jacobi3d_mpi: %d ranks leave a rank without points in dimension %d\n", size, d);
			MPI_Abort(MPI_COMM_WORLD, 2);
		}
	}
	struct box b = {count[0], count[1], count[2], count[0] + 2, count[1] + 2};
	size_t cells = (size_t)b.sx * (size_t)b.sy * (size_t)(b.lz + 2);
	double *u = calloc(cells, sizeof(double)), *unew = calloc(cells, sizeof(double));
	if (!u || !unew) {
		fprintf(stderr, "jacobi3d_mpi: out of memory\n");
		MPI_Abort(MPI_COMM_WORLD, 1);
	}
	if (first[0] == 0) /* the hot face x = -1 */
		for (int k = 0; k < b.lz; k++)
			for (int j = 0; j < b.ly; j++)
				u[AT(b, -1, j, k)] = unew[AT(b, -1, j, k)] = 1.0;

	/* Faces as subarrays of the ghosted array (C order: z, y, x). For each
	 * dimension d and side s (0: low, 1: high), send the first or last
	 * interior plane and receive into the ghost plane beyond it. */
	int full[3] = {b.lz + 2, b.ly + 2, b.lx + 2};
	MPI_Datatype sendt[3][2], recvt[3][2];
	int nb[3][2];
	for (int d = 0; d < 3; d++) {
		MPI_Cart_shift(cart, d, 1, &nb[d][0], &nb[d][1]);
		int cd = 2 - d; /* the C-order position of dimension d */
		for (int s = 0; s < 2; s++) {
			int sub[3] = {b.lz, b.ly, b.lx}, st[3] = {1, 1, 1}, rt[3] = {1, 1, 1};
			sub[cd] = 1;
			st[cd] = s == 0 ? 1 : count[d];
			rt[cd] = s == 0 ? 0 : count[d] + 1;
			MPI_Type_create_subarray(3, full, sub, st, MPI_ORDER_C, MPI_DOUBLE, &sendt[d][s]);
			MPI_Type_create_subarray(3, full, sub, rt, MPI_ORDER_C, MPI_DOUBLE, &recvt[d][s]);
			MPI_Type_commit(&sendt[d][s]);
			MPI_Type_commit(&recvt[d][s]);
		}
	}

	int total = warmup + iters;
	double *times = malloc(sizeof(double) * (size_t)iters);
	double comm = 0, residual = 0, t0 = 0;
	for (int it = 0; it < total; it++) {
		if (it == warmup) {
			MPI_Barrier(cart);
			comm = 0;
			t0 = MPI_Wtime();
		}
		double ts = MPI_Wtime();
		MPI_Request req[12];
		int nr = 0;
		for (int d = 0; d < 3; d++)
			for (int s = 0; s < 2; s++) {
				/* The face from the low neighbour arrives in the low ghost plane. */
				MPI_Irecv(u, 1, recvt[d][s], nb[d][s], 10 * d + (1 - s), cart, &req[nr++]);
				MPI_Isend(u, 1, sendt[d][s], nb[d][s], 10 * d + s, cart, &req[nr++]);
			}
		double r = 0, tw;
		if (overlap && b.lx > 2 && b.ly > 2 && b.lz > 2) {
			r = sweep(&b, u, unew, 1, b.lx - 1, 1, b.ly - 1, 1, b.lz - 1);
			tw = MPI_Wtime();
			MPI_Waitall(nr, req, MPI_STATUSES_IGNORE);
			comm += MPI_Wtime() - tw;
			/* The shell: z faces whole, y faces without z's rows, x faces
			 * without both. */
			double q[6];
			q[0] = sweep(&b, u, unew, 0, b.lx, 0, b.ly, 0, 1);
			q[1] = sweep(&b, u, unew, 0, b.lx, 0, b.ly, b.lz - 1, b.lz);
			q[2] = sweep(&b, u, unew, 0, b.lx, 0, 1, 1, b.lz - 1);
			q[3] = sweep(&b, u, unew, 0, b.lx, b.ly - 1, b.ly, 1, b.lz - 1);
			q[4] = sweep(&b, u, unew, 0, 1, 1, b.ly - 1, 1, b.lz - 1);
			q[5] = sweep(&b, u, unew, b.lx - 1, b.lx, 1, b.ly - 1, 1, b.lz - 1);
			for (int i = 0; i < 6; i++)
				if (q[i] > r)
					r = q[i];
		} else {
			tw = MPI_Wtime();
			MPI_Waitall(nr, req, MPI_STATUSES_IGNORE);
			comm += MPI_Wtime() - tw;
			r = sweep(&b, u, unew, 0, b.lx, 0, b.ly, 0, b.lz);
		}
		if ((it + 1) % every == 0 || it + 1 == total) {
			tw = MPI_Wtime();
			MPI_Allreduce(&r, &residual, 1, MPI_DOUBLE, MPI_MAX, cart);
			comm += MPI_Wtime() - tw;
		}
		double *t = u;
		u = unew;
		unew = t;
		if (it >= warmup)
			times[it - warmup] = MPI_Wtime() - ts;
	}
	double elapsed = MPI_Wtime() - t0;

	uint64_t h = 0, H = 0;
	for (int k = 0; k < b.lz; k++)
		for (int j = 0; j < b.ly; j++)
			for (int i = 0; i < b.lx; i++) {
				uint64_t bits, p = (uint64_t)(first[0] + i) + (uint64_t)N[0] * ((uint64_t)(first[1] + j) + (uint64_t)N[1] * (uint64_t)(first[2] + k));
				memcpy(&bits, &u[AT(b, i, j, k)], sizeof bits);
				h += mix64(bits + p * 0x9E3779B97F4A7C15ULL);
			}
	MPI_Reduce(&h, &H, 1, MPI_UINT64_T, MPI_SUM, 0, cart);
	double commSum = 0;
	MPI_Reduce(&comm, &commSum, 1, MPI_DOUBLE, MPI_SUM, 0, cart);
	if (rank == 0) {
		qsort(times, (size_t)iters, sizeof(double), cmp_double);
		printf("# jacobi3d_mpi: grid %dx%dx%d, %d ranks as %dx%dx%d, %d+%d sweeps, reduce every %d, overlap %s\n",
		       N[0], N[1], N[2], size, dims[0], dims[1], dims[2], warmup, iters, every, overlap ? "on" : "off");
		printf("sweeps %d\n", total);
		printf("residual %.17g\n", residual);
		printf("field_hash %llu\n", (unsigned long long)(H >> 11));
		printf("iter_ms %.4f\n", times[(iters - 1) / 2] * 1e3);
		printf("mean_iter_ms %.4f\n", elapsed / iters * 1e3);
		printf("comm_ms %.4f\n", commSum / size / iters * 1e3);
	}
	for (int d = 0; d < 3; d++)
		for (int s = 0; s < 2; s++) {
			MPI_Type_free(&sendt[d][s]);
			MPI_Type_free(&recvt[d][s]);
		}
	free(times);
	free(u);
	free(unew);
	MPI_Comm_free(&cart);
	MPI_Finalize();
	return 0;
}
