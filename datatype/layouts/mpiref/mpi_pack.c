/*
 * mpi_pack: the MPI reference for `troupe bench ddt --mpi`.
 *
 * Builds one layout of shared/ddt-layouts.md with the MPI datatype
 * constructors, exactly as datatype/layouts builds it with troupe's, and
 * measures MPI_Pack, MPI_Unpack and memcpy of the same number of bytes the
 * same way (repeat until a round lasts ROUND seconds, best of ROUNDS rounds,
 * warm caches). It prints one JSON object:
 *   {"layout":..,"impl":..,"bytes":..,"pack_GBps":..,"unpack_GBps":..,
 *    "copy_GBps":..,"packed_fnv":..}
 * packed_fnv is the FNV-1a 64 hash of the packed bytes, so the caller can
 * check that MPI and troupe pack the same bytes.
 *
 * Build with either MPI's wrapper (the Makefile's bench-mpi target does):
 *   mpicc.openmpi -O2 -o bin/mpi_pack-openmpi mpi_pack.c
 *   mpicc.mpich   -O2 -o bin/mpi_pack-mpich   mpi_pack.c
 * Usage: mpi_pack LAYOUT [ROUND_SECONDS [ROUNDS]]   (a singleton, no mpirun)
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void check(int rc, const char *what) {
    if (rc != MPI_SUCCESS) {
        fprintf(stderr, "mpi_pack: %s failed (%d)\n", what, rc);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
}

#define CK(call) check((call), #call)

static MPI_Datatype vec(int count, int bl, int stride, MPI_Datatype old) {
    MPI_Datatype t;
    CK(MPI_Type_vector(count, bl, stride, old, &t));
    return t;
}

static MPI_Datatype hvec(int count, int bl, MPI_Aint stride, MPI_Datatype old) {
    MPI_Datatype t;
    CK(MPI_Type_create_hvector(count, bl, stride, old, &t));
    return t;
}

static MPI_Datatype contig(int count, MPI_Datatype old) {
    MPI_Datatype t;
    CK(MPI_Type_contiguous(count, old, &t));
    return t;
}

static MPI_Datatype resized(MPI_Datatype old, MPI_Aint lb, MPI_Aint extent) {
    MPI_Datatype t;
    CK(MPI_Type_create_resized(old, lb, extent, &t));
    return t;
}

static MPI_Datatype subarray(int n, const int *sizes, const int *sub, const int *starts) {
    MPI_Datatype t;
    CK(MPI_Type_create_subarray(n, sizes, sub, starts, MPI_ORDER_FORTRAN, MPI_FLOAT, &t));
    return t;
}

static MPI_Datatype structure(int n, const MPI_Aint *disps, const MPI_Datatype *types) {
    int bl[16];
    MPI_Datatype t;
    for (int i = 0; i < n; i++) bl[i] = 1;
    CK(MPI_Type_create_struct(n, bl, disps, types, &t));
    return t;
}

struct layout {
    MPI_Datatype type;
    long alloc, base, packed;
};

static const long wrf2d[] = {0, 27456, 54912, 82368};
static const long wrf3d[] = {109824, 1894464, 3679104};
static const long wrf4d[] = {5463744, 9033024};

/* wrf builds wrf_y_vec (sa == 0) or wrf_y_sa (sa == 1). */
static MPI_Datatype wrf(int sa) {
    MPI_Datatype t2, t3, t4, types[9];
    MPI_Aint disps[9];
    long add2 = 3716, add3 = 240260, add4 = 2024900;
    if (sa) {
        int s2[] = {132, 52}, u2[] = {120, 3}, o2[] = {5, 7};
        int s3[] = {132, 65, 52}, u3[] = {120, 65, 3}, o3[] = {5, 0, 7};
        int s4[] = {132, 65, 52, 2}, u4[] = {120, 65, 3, 1}, o4[] = {5, 0, 7, 1};
        t2 = subarray(2, s2, u2, o2);
        t3 = subarray(3, s3, u3, o3);
        t4 = subarray(4, s4, u4, o4);
        add2 = add3 = add4 = 0;
    } else {
        t2 = vec(3, 120, 132, MPI_FLOAT);
        t3 = hvec(3, 1, 34320, vec(65, 120, 132, MPI_FLOAT));
        t4 = hvec(1, 1, 1784640, t3);
    }
    int k = 0;
    for (int i = 0; i < 4; i++, k++) types[k] = t2, disps[k] = wrf2d[i] + add2;
    for (int i = 0; i < 3; i++, k++) types[k] = t3, disps[k] = wrf3d[i] + add3;
    for (int i = 0; i < 2; i++, k++) types[k] = t4, disps[k] = wrf4d[i] + add4;
    return structure(9, disps, types);
}

static MPI_Datatype lammps(void) {
    enum { N = 6000 };
    static int list[N], x3[N], three[N], one[N];
    for (long j = 0; j < N; j++) {
        list[j] = (int)(5 * j + (7 * j * j + 3 * j) % 5);
        x3[j] = 3 * list[j];
        three[j] = 3;
        one[j] = 1;
    }
    MPI_Datatype tx, t1, types[6];
    CK(MPI_Type_indexed(N, three, x3, MPI_DOUBLE, &tx));
    CK(MPI_Type_indexed(N, one, list, MPI_DOUBLE, &t1));
    MPI_Aint disps[6] = {0, 720000, 960000, 1200000, 1440000, 1680000};
    types[0] = tx;
    for (int i = 1; i < 6; i++) types[i] = t1;
    return structure(6, disps, types);
}

static int build(const char *name, struct layout *l) {
    const long nas = 514L * 258 * 258 * 8;
    memset(l, 0, sizeof *l);
    if (!strcmp(name, "milc_zd")) {
        l->type = hvec(2, 1, 3145728, vec(64, 128, 2048, contig(6, MPI_FLOAT)));
        l->alloc = 6291456, l->packed = 393216;
    } else if (!strcmp(name, "nas_mg_x")) {
        l->type = hvec(256, 1, 1060896, vec(256, 1, 514, MPI_DOUBLE));
        l->alloc = nas, l->base = 8 * (512 + 514 * (1 + 258 * 1)), l->packed = 524288;
    } else if (!strcmp(name, "nas_mg_y")) {
        l->type = vec(256, 512, 132612, MPI_DOUBLE);
        l->alloc = nas, l->base = 8 * (1 + 514 * (256 + 258 * 1)), l->packed = 1048576;
    } else if (!strcmp(name, "nas_mg_z")) {
        l->type = vec(256, 512, 514, MPI_DOUBLE);
        l->alloc = nas, l->base = 8 * (1 + 514 * (1 + 258 * 1)), l->packed = 1048576;
    } else if (!strcmp(name, "wrf_y_vec") || !strcmp(name, "wrf_y_sa")) {
        l->type = wrf(!strcmp(name, "wrf_y_sa"));
        l->alloc = 12602304, l->packed = 473760;
    } else if (!strcmp(name, "specfem3d_mt")) {
        l->type = vec(40000, 1, 2, contig(3, MPI_FLOAT));
        l->alloc = 960000, l->packed = 480000;
    } else if (!strcmp(name, "fft")) {
        l->type = resized(vec(256, 256, 1024, contig(2, MPI_DOUBLE)), 0, 4096);
        l->alloc = 4194304, l->packed = 1048576;
    } else if (!strcmp(name, "fft_tr")) {
        l->type = contig(256, resized(vec(256, 1, 1024, contig(2, MPI_DOUBLE)), 0, 16));
        l->alloc = 4194304, l->packed = 1048576;
    } else if (!strcmp(name, "lammps_full")) {
        l->type = lammps();
        l->alloc = 1920000, l->packed = 384000;
    } else if (!strcmp(name, "vec_64B")) {
        l->type = vec(64, 8, 16, MPI_DOUBLE);
        l->alloc = 8128, l->packed = 4096;
    } else if (!strcmp(name, "vec_4KiB")) {
        l->type = vec(64, 512, 1024, MPI_DOUBLE);
        l->alloc = 520192, l->packed = 262144;
    } else if (!strcmp(name, "vec_64B_big")) {
        l->type = vec(8192, 8, 16, MPI_DOUBLE);
        l->alloc = 1048512, l->packed = 524288;
    } else {
        return -1;
    }
    CK(MPI_Type_commit(&l->type));
    return 0;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

enum op { PACK, UNPACK, COPY };

static struct layout L;
static unsigned char *src, *packed, *cpy;

static void run(enum op op) {
    int pos = 0;
    switch (op) {
    case PACK:
        CK(MPI_Pack(src + L.base, 1, L.type, packed, (int)L.packed, &pos, MPI_COMM_WORLD));
        break;
    case UNPACK:
        CK(MPI_Unpack(packed, (int)L.packed, &pos, src + L.base, 1, L.type, MPI_COMM_WORLD));
        break;
    case COPY:
        memcpy(cpy, packed, L.packed);
        break;
    }
}

/* rate mirrors datatype/layouts.rate: calibrate to a round, best of rounds. */
static double rate(enum op op, double round, int rounds) {
    long n = 1;
    for (;;) {
        double t0 = now();
        for (long i = 0; i < n; i++) run(op);
        double el = now() - t0;
        if (el >= round / 4 || n >= (1L << 30)) {
            if (el < 1e-6) el = 1e-6;
            n = (long)((double)n * round / el);
            if (n < 1) n = 1;
            break;
        }
        n *= 4;
    }
    double best = 0;
    for (int r = 0; r < rounds; r++) {
        double t0 = now();
        for (long i = 0; i < n; i++) run(op);
        double g = (double)L.packed * n / (now() - t0) / 1e9;
        if (g > best) best = g;
    }
    return best;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    if (argc < 2) {
        fprintf(stderr, "usage: mpi_pack LAYOUT [ROUND_SECONDS [ROUNDS]]\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    double round = argc > 2 ? atof(argv[2]) : 0.06;
    int rounds = argc > 3 ? atoi(argv[3]) : 3;
    if (build(argv[1], &L) != 0) {
        fprintf(stderr, "mpi_pack: unknown layout %s\n", argv[1]);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    int size;
    CK(MPI_Pack_size(1, L.type, MPI_COMM_WORLD, &size));
    if (size < L.packed) {
        fprintf(stderr, "mpi_pack: %s: MPI_Pack_size %d < %ld\n", argv[1], size, L.packed);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    src = malloc(L.alloc);
    packed = malloc(L.packed);
    cpy = malloc(L.packed);
    for (long i = 0; i < L.alloc; i++) {
        long d = i - L.base;
        src[i] = (unsigned char)((((d * 131 + 7) % 256) + 256) % 256);
    }
    int pos = 0;
    CK(MPI_Pack(src + L.base, 1, L.type, packed, (int)L.packed, &pos, MPI_COMM_WORLD));
    if (pos != L.packed) {
        fprintf(stderr, "mpi_pack: %s: packed %d bytes, want %ld\n", argv[1], pos, L.packed);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    uint64_t h = 14695981039346656037ULL;
    for (long i = 0; i < L.packed; i++) h = (h ^ packed[i]) * 1099511628211ULL;

    char impl[MPI_MAX_LIBRARY_VERSION_STRING];
    int len;
    MPI_Get_library_version(impl, &len);
    const char *name = strstr(impl, "Open MPI") ? "openmpi" : strstr(impl, "MPICH") ? "mpich" : "mpi";

    double p = rate(PACK, round, rounds);
    double u = rate(UNPACK, round, rounds);
    double c = rate(COPY, round, rounds);
    printf("{\"layout\":\"%s\",\"impl\":\"%s\",\"bytes\":%ld,\"pack_GBps\":%.3f,"
           "\"unpack_GBps\":%.3f,\"copy_GBps\":%.3f,\"packed_fnv\":\"%016llx\"}\n",
           argv[1], name, L.packed, p, u, c, (unsigned long long)h);
    MPI_Finalize();
    return 0;
}
