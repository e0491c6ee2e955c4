// Pack and unpack kernels of derived datatypes in device memory (package
// gpupack), in the dialect of gpu/troupe_kernel.h. kernels.ptx is generated
// from this file by `make ptx` (clang) and embedded; the tests also compile
// it into the test CUDA driver (internal/cudatest), so the same source runs
// on machines without a GPU.
//
// Both kernels move bytes between the user buffer (where the datatype's
// blocks lie) and a range of the packed stream, which `packed` points at
// the start of; `unpack` says which way. A unit is 8 bytes when every
// address and length involved is a multiple of 8, else 1.
#include "troupe_kernel.h"

typedef struct {
	unsigned char *user;   // the first block (the layout's lowest data byte)
	unsigned char *packed; // the range's first packed byte
	long long first;       // the range's first unit of the packed stream
	long long total;       // units in the range
	long long len;         // bytes per block
	long long stride;      // bytes from one block's start to the next's
	long long words;       // 1: move 8-byte words (everything 8-aligned)
	long long unpack;      // 1: packed -> user; 0: user -> packed
} VectorArgs;

// troupe_ddt_vector: a layout of equal blocks at a fixed stride. Unit i of
// the range, unit u = first + i of the packed stream (block u / per, unit
// u % per of it), is thread i of a 1-D grid, over a grid-stride loop, so
// consecutive threads touch consecutive packed units.
TROUPE_KERNEL(troupe_ddt_vector, VectorArgs, a) {
	long long unit = a.words ? 8 : 1;
	long long per = a.len / unit;
	long long step = (long long)gridDim.x * blockDim.x;
	for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < a.total; i += step) {
		long long u = a.first + i;
		long long b = u / per, k = u % per;
		long long uo = b * a.stride + k * unit, po = i * unit;
		if (a.words) {
			unsigned long long *us = (unsigned long long *)(a.user + uo);
			unsigned long long *ps = (unsigned long long *)(a.packed + po);
			if (a.unpack) {
				*us = *ps;
			} else {
				*ps = *us;
			}
		} else if (a.unpack) {
			a.user[uo] = a.packed[po];
		} else {
			a.packed[po] = a.user[uo];
		}
	}
}

typedef struct {
	unsigned char *user;    // the buffer the table's user offsets are from
	unsigned char *packed;  // the range's first packed byte
	const long long *table; // nseg entries of {user offset, length, packed offset}
	long long nseg;
	long long group;        // threads per segment: 1, 32 or 256 (divides the block)
	long long unpack;       // 1: packed -> user; 0: user -> packed
	long long lo, hi;       // the range: bytes [lo, hi) of the packed stream
} TableArgs;

// troupe_ddt_table: any layout, as a table of segments (those that meet
// the range), each clipped to the range. Each segment is moved by `group`
// consecutive threads (one thread for small blocks, a warp or a block for
// long ones), over a grid-stride loop of segments; within a segment, lane
// i moves units i, i + group, ...
TROUPE_KERNEL(troupe_ddt_table, TableArgs, a) {
	long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
	long long lane = g % a.group;
	long long step = (long long)gridDim.x * blockDim.x / a.group;
	for (long long s = g / a.group; s < a.nseg; s += step) {
		long long uo = a.table[3 * s], len = a.table[3 * s + 1], po = a.table[3 * s + 2];
		long long from = po > a.lo ? po : a.lo;
		long long to = po + len < a.hi ? po + len : a.hi;
		if (to <= from) {
			continue;
		}
		len = to - from;
		unsigned char *u = a.user + uo + (from - po), *p = a.packed + (from - a.lo);
		if ((((unsigned long long)u | (unsigned long long)p | (unsigned long long)len) & 7) == 0) {
			unsigned long long *uw = (unsigned long long *)u, *pw = (unsigned long long *)p;
			for (long long i = lane; i < len / 8; i += a.group) {
				if (a.unpack) {
					uw[i] = pw[i];
				} else {
					pw[i] = uw[i];
				}
			}
		} else {
			for (long long i = lane; i < len; i += a.group) {
				if (a.unpack) {
					u[i] = p[i];
				} else {
					p[i] = u[i];
				}
			}
		}
	}
}
