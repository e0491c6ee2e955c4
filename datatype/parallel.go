package datatype

import (
	"sync"
	"unsafe"
)

// Page-bound layouts.
//
// A layout whose small blocks lie a page or more apart over a span far
// beyond the TLB's reach (the x face of a large 3-D grid: 8-byte elements
// 4 KiB apart over hundreds of megabytes) costs a page walk per block, and
// one core has only a couple of page walkers. Such a pack runs at 1-2 GB/s
// whatever the code does; the remedy is more cores, each walking its own
// part of the packed stream. Every other layout is bound by the caches or
// by memory bandwidth, which a second core shares, so splitting it only
// adds the cost of starting goroutines (measured: 0.45-0.9x on the
// benchmark layouts other than nas_mg_x, 1.7x on nas_mg_x with two cores).
const (
	// parallelMinSpan is the smallest data span worth splitting: well beyond
	// the reach of a second-level TLB (1.5-3 K entries of 4 KiB, 6-12 MiB).
	parallelMinSpan = 32 << 20
	// parallelMaxBlock is the largest average block of a page-bound layout.
	parallelMaxBlock = 256
	// parallelMinGap is the smallest average distance between blocks of a
	// page-bound layout: half a page, so that nearly every block is on a
	// page of its own.
	parallelMinGap = 2048
	// parallelAlign aligns the parts' boundaries in the packed stream to a
	// cache line, so that no two goroutines write the same line.
	parallelAlign = 64
)

// ParallelMinPart is the smallest part of the packed stream that
// PackParallel and UnpackParallel give a goroutine of its own: about 20 us
// of page-bound packing, against a microsecond or two to start and join a
// goroutine.
const ParallelMinPart = 32 << 10

// ParallelParts returns how many parts, each on a goroutine of its own,
// PackParallel and UnpackParallel cut n packed bytes into with workers
// workers: at most workers, each of at least ParallelMinPart bytes (the
// last up to a cache line less: inner cuts fall on cache lines), and never
// fewer than one.
func ParallelParts(n int64, workers int) int {
	return int(max(1, min(int64(workers), n/ParallelMinPart)))
}

// Workers returns how many goroutines, at most limit, PackParallel and
// UnpackParallel should use for count elements of t: more than one only for
// page-bound layouts (small blocks about a page apart over a span of 32 MiB
// or more) of at least two parts of 32 KiB. It returns 1 for every other
// layout and on any error (the move itself reports errors).
func (t *Type) Workers(count int64, limit int) int {
	nd, err := t.program(count)
	if err != nil || nd == nil || limit <= 1 || nd.segs <= 0 {
		return 1
	}
	span := nd.hi - nd.lo
	if span < parallelMinSpan || nd.size/nd.segs > parallelMaxBlock || span/nd.segs < parallelMinGap {
		return 1
	}
	return ParallelParts(nd.size, limit)
}

// PackParallel is PackRaw with the packed range cut into at most workers
// parts of at least 32 KiB (and never fewer than one), each packed by a
// goroutine of its own; it returns when all are done. The packed bytes are
// identical to PackRaw's. Use Workers to choose workers.
func (t *Type) PackParallel(dst, src Region, base, count, offset int64, workers int) (int64, error) {
	return t.moveParallel(src, dst, base, count, offset, false, "PackParallel", workers)
}

// UnpackParallel is UnpackRaw with the packed range cut into at most
// workers parts of at least 32 KiB, each unpacked by a goroutine of its
// own; it returns when all are done. The typemap must not overlap itself
// (MPI forbids overlapping receive types), so the parts write disjoint
// bytes of dst.
func (t *Type) UnpackParallel(dst, src Region, base, count, offset int64, workers int) (int64, error) {
	return t.moveParallel(dst, src, base, count, offset, true, "UnpackParallel", workers)
}

// moveParallel checks its arguments as move does, then moves the packed
// bytes [offset, offset+n) in parts, each on a goroutine of its own while
// the caller waits. Running part 0 on the calling goroutine instead measured
// slower (1.6 against 2.1 GB/s on nas_mg_x with two workers): the part
// started last sits in the processor's run-next slot, which other
// processors steal from only after a delay, whereas a caller that parks at
// once runs it itself.
func (t *Type) moveParallel(user, packed Region, base, count, offset int64, unpack bool, what string, workers int) (int64, error) {
	nd, n, err := t.prepare(user, packed, base, count, offset, what)
	if err != nil || n == 0 {
		return 0, err
	}
	parts := int64(ParallelParts(n, workers))
	if parts == 1 {
		e := engine{user: user.Ptr, packed: packed.Ptr, unpack: unpack}
		e.run(nd, base, offset, n)
		return n, nil
	}
	// Inner part boundaries fall on cache lines of the packed buffer.
	skew := int64(uintptr(packed.Ptr)%parallelAlign) - offset
	cut := func(k int64) int64 {
		switch k {
		case 0:
			return offset
		case parts:
			return offset + n
		}
		at := offset + n/parts*k + skew // at's address modulo the line size
		at = (at+parallelAlign-1)/parallelAlign*parallelAlign - skew
		return min(offset+n, at)
	}
	var wg sync.WaitGroup
	for k := parts - 1; k >= 0; k-- {
		lo, hi := cut(k), cut(k+1)
		if hi <= lo {
			continue
		}
		e := engine{user: user.Ptr, packed: unsafe.Add(packed.Ptr, lo-offset), unpack: unpack}
		wg.Add(1)
		go func() {
			defer wg.Done()
			e.run(nd, base, lo, hi-lo)
		}()
	}
	wg.Wait()
	return n, nil
}
