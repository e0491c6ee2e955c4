//go:build linux

package datatype_test

import (
	"bytes"
	"fmt"
	"syscall"
	"testing"

	"pgregory.net/rapid"

	dt "github.com/troupe-hpc/troupe/datatype"
)

// guardedPair maps two regions of n bytes: the first ends exactly where an
// inaccessible page begins, the second starts exactly after one, so that a
// load or store one byte before the second or after the first faults.
func guardedPair(t interface{ Fatalf(string, ...any) }, n int) (atEnd, atStart []byte, unmap func()) {
	page := syscall.Getpagesize()
	size := (max(n, 1) + page - 1) / page * page
	m, err := syscall.Mmap(-1, 0, 3*page+2*size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		t.Fatalf("mmap: %v", err)
	}
	for _, g := range []int{0, page + size, 2*page + 2*size} {
		if err := syscall.Mprotect(m[g:g+page], syscall.PROT_NONE); err != nil {
			t.Fatalf("mprotect: %v", err)
		}
	}
	a := m[page : page+size]
	b := m[2*page+size : 2*page+2*size]
	return a[size-n:], b[:n], func() { syscall.Munmap(m) }
}

// genSpanType draws nested types over byte blocks of lengths around every
// kernel boundary (the small-block word moves, the AVX2 kernel from 65
// bytes, REP MOVSB from 2560, memmove above 16 KiB), with negative strides
// and displacements and resized extents, and returns the reference: the
// byte segments of one element, unmerged, in typemap order.
func genSpanType(t *rapid.T, depth int) (*dt.Type, []dt.Segment) {
	must := func(x *dt.Type, err error) *dt.Type {
		if err != nil {
			t.Fatalf("constructor: %v", err)
		}
		return x
	}
	kind := rapid.IntRange(0, 6).Draw(t, "kind")
	if depth <= 0 {
		kind = 0
	}
	shiftAll := func(s []dt.Segment, d int64) []dt.Segment {
		out := make([]dt.Segment, len(s))
		for i, g := range s {
			out[i] = dt.Segment{Off: g.Off + d, Len: g.Len}
		}
		return out
	}
	switch kind {
	case 0:
		b := rapid.SampledFrom([]int64{1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 24, 31, 32, 33, 40, 48, 56,
			63, 64, 65, 66, 96, 127, 128, 129, 200, 255, 256, 257, 300, 480, 1000, 2559, 2560, 2561,
			4099, 16384, 16385, 20000}).Draw(t, "blk")
		if b > 300 && depth < 2 {
			b = b%300 + 1 // big blocks only near the top, to bound memory
		}
		return must(dt.Contiguous(b, dt.Byte)), []dt.Segment{{Off: 0, Len: b}}
	case 1, 2: // hvector
		old, s := genSpanType(t, depth-1)
		n := rapid.Int64Range(1, 6).Draw(t, "n")
		bl := rapid.Int64Range(1, 3).Draw(t, "bl")
		e := old.Extent()
		st := rapid.Int64Range(-3*bl*max(e, 1)-40, 3*bl*max(e, 1)+40).Draw(t, "stride")
		if kind == 2 {
			st = bl*e + rapid.Int64Range(0, 9).Draw(t, "gap") // touching or small gaps
		}
		var out []dt.Segment
		for i := int64(0); i < n; i++ {
			for j := int64(0); j < bl; j++ {
				out = append(out, shiftAll(s, i*st+j*e)...)
			}
		}
		return must(dt.HVector(n, bl, st, old)), out
	case 3: // hindexed
		old, s := genSpanType(t, depth-1)
		e := old.Extent()
		k := rapid.IntRange(1, 5).Draw(t, "k")
		bls, ds := make([]int64, k), make([]int64, k)
		var out []dt.Segment
		for i := range bls {
			bls[i] = rapid.Int64Range(1, 2).Draw(t, "bl")
			ds[i] = rapid.Int64Range(-2*max(e, 1)-20, 4*max(e, 1)+20).Draw(t, "d")
			for j := int64(0); j < bls[i]; j++ {
				out = append(out, shiftAll(s, ds[i]+j*e)...)
			}
		}
		return must(dt.HIndexed(bls, ds, old)), out
	case 4: // hindexed_block, often ascending and uniform
		old, s := genSpanType(t, depth-1)
		e := old.Extent()
		k := rapid.IntRange(1, 200).Draw(t, "k")
		allAsc := rapid.Bool().Draw(t, "allAsc") // delta-coded, over several marks
		ds := make([]int64, k)
		var out []dt.Segment
		for i := range ds {
			ds[i] = rapid.Int64Range(-5, 3*max(e, 1)).Draw(t, "d")
			if i > 0 && (allAsc || rapid.Bool().Draw(t, "asc")) {
				ds[i] = ds[i-1] + max(e, 0) + rapid.Int64Range(0, 10).Draw(t, "step")
			}
			out = append(out, shiftAll(s, ds[i])...)
		}
		return must(dt.HIndexedBlock(1, ds, old)), out
	case 5: // struct
		k := rapid.IntRange(1, 3).Draw(t, "fields")
		var bls, ds []int64
		var types []*dt.Type
		var out []dt.Segment
		for i := 0; i < k; i++ {
			old, s := genSpanType(t, depth-1)
			d := rapid.Int64Range(-300, 300).Draw(t, "sd")
			bls, ds, types = append(bls, 1), append(ds, d), append(types, old)
			out = append(out, shiftAll(s, d)...)
		}
		return must(dt.Struct(bls, ds, types)), out
	default: // resized, then often contiguous copies at the new extent
		old, s := genSpanType(t, depth-1)
		lb := rapid.Int64Range(-20, 20).Draw(t, "lb")
		ext := rapid.Int64Range(0, 2*max(old.TrueExtent(), 1)+8).Draw(t, "ext")
		x := must(dt.Resized(old, lb, ext))
		n := rapid.Int64Range(1, 4).Draw(t, "n")
		var out []dt.Segment
		for i := int64(0); i < n; i++ {
			out = append(out, shiftAll(s, i*ext)...)
		}
		return must(dt.Contiguous(n, x)), out
	}
}

// TestPropertyGuardedMoves packs and unpacks (also with PackParallel and
// UnpackParallel) random byte ranges of random
// nested types with the user data and the packed buffer each exactly
// bounded by inaccessible pages (one run with the user data ending at a
// guard, one with it starting after one): any byte read or written outside
// the typemap's span or outside [offset, offset+n) of the packed stream
// faults. Packed bytes are compared with the reference typemap, and every
// user byte outside the unpacked range must keep its canary.
func TestPropertyGuardedMoves(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		x, one := genSpanType(t, 3)
		count := rapid.Int64Range(1, 3).Draw(t, "count")
		workers := rapid.IntRange(1, 4).Draw(t, "workers")
		if workers > 1 && x.Size() > 0 {
			// Enough data for several parts of PackParallel.
			count = max(1, rapid.Int64Range(0, 300<<10).Draw(t, "bytes")/x.Size())
		}
		var segs []dt.Segment
		for k := int64(0); k < count; k++ {
			for _, g := range one {
				segs = append(segs, dt.Segment{Off: g.Off + k*x.Extent(), Len: g.Len})
			}
		}
		lo, hi := segs[0].Off, segs[0].Off+segs[0].Len
		var total int64
		for _, g := range segs {
			lo, hi = min(lo, g.Off), max(hi, g.Off+g.Len)
			total += g.Len
		}
		lo, hi = min(lo, 0), max(hi, 0) // the origin must lie in the user region
		if hi-lo > 4<<20 || total > 4<<20 {
			t.Skip("too large")
		}
		if tm, err := x.Typemap(count); err != nil || fmt.Sprint(tm) != fmt.Sprint(mergeSegs(segs)) {
			t.Fatalf("typemap %v (%v), want %v", tm, err, mergeSegs(segs))
		}
		base := -lo
		off := rapid.Int64Range(0, total).Draw(t, "off")
		if rapid.Bool().Draw(t, "offNearEnd") {
			off = max(0, total-rapid.Int64Range(0, 70).Draw(t, "fromEnd"))
		}
		n := rapid.Int64Range(0, total-off).Draw(t, "n")
		if rapid.Bool().Draw(t, "toEnd") {
			n = total - off
		}
		// Reference stream and, per user byte, its stream position.
		ref := make([]byte, 0, total)
		pos := make([]int64, hi-lo)
		for i := range pos {
			pos[i] = -1
		}
		fill := func(i int64) byte { return byte(i*131 + 7) }
		var p int64
		for _, g := range segs {
			for j := int64(0); j < g.Len; j++ {
				ref = append(ref, fill(base+g.Off+j))
				pos[base+g.Off+j] = p
				p++
			}
		}
		overlap := overlaps(segs)
		was := dt.RepKernel()
		defer dt.SetRepKernel(was)
		for variant := 0; variant < 4; variant++ {
			dt.SetRepKernel(variant >= 2)
			uEnd, uStart, unmap1 := guardedPair(t, int(hi-lo))
			defer unmap1()
			pEnd, pStart, unmap2 := guardedPair(t, int(n))
			defer unmap2()
			user, packed := uEnd, pStart
			if variant%2 == 1 {
				user, packed = uStart, pEnd
			}
			for i := range user {
				user[i] = fill(int64(i))
			}
			for i := range packed {
				packed[i] = 0xCC
			}
			pack, unpack := x.PackRaw, x.UnpackRaw
			if workers > 1 {
				pack = func(dst, src dt.Region, base, count, off int64) (int64, error) {
					return x.PackParallel(dst, src, base, count, off, workers)
				}
				unpack = func(dst, src dt.Region, base, count, off int64) (int64, error) {
					return x.UnpackParallel(dst, src, base, count, off, workers)
				}
			}
			m, err := pack(dt.SliceRegion(packed), dt.SliceRegion(user), base, count, off)
			if err != nil || m != n || !bytes.Equal(packed, ref[off:off+n]) {
				t.Fatalf("variant %d: PackRaw(off %d, n %d) = %d, %v; bytes equal %v", variant, off, n, m, err, bytes.Equal(packed, ref[off:off+n]))
			}
			if overlap {
				continue
			}
			for i := range user {
				user[i] = 0xEE
			}
			m, err = unpack(dt.SliceRegion(user), dt.SliceRegion(packed), base, count, off)
			if err != nil || m != n {
				t.Fatalf("variant %d: UnpackRaw = %d, %v", variant, m, err)
			}
			for i := range user {
				want := byte(0xEE)
				if q := pos[i]; q >= off && q < off+n {
					want = ref[q]
				}
				if user[i] != want {
					t.Fatalf("variant %d: UnpackRaw(off %d, n %d): user byte %d (stream pos %d) = %#x, want %#x", variant, off, n, int64(i)-base, pos[i], user[i], want)
				}
			}
		}
	})
}

// clip returns the reference segments of packed bytes [off, off+n), merged.
func clip(segs []dt.Segment, off, n int64) []dt.Segment {
	var out []dt.Segment
	var p int64
	for _, g := range segs {
		a, b := max(p, off), min(p+g.Len, off+n)
		if a < b {
			out = append(out, dt.Segment{Off: g.Off + a - p, Len: b - a})
		}
		p += g.Len
	}
	return mergeSegs(out)
}

// TestPropertySpanSegments checks Segments and the Iterator, started and
// stopped at random bytes, against the reference typemap of genSpanType.
func TestPropertySpanSegments(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		x, one := genSpanType(t, 3)
		count := rapid.Int64Range(0, 3).Draw(t, "count")
		var segs []dt.Segment
		var total int64
		for k := int64(0); k < count; k++ {
			for _, g := range one {
				segs = append(segs, dt.Segment{Off: g.Off + k*x.Extent(), Len: g.Len})
				total += g.Len
			}
		}
		off := rapid.Int64Range(0, total).Draw(t, "off")
		n := rapid.Int64Range(0, total-off).Draw(t, "n")
		seq, err := x.Segments(count, off, n)
		if err != nil {
			t.Fatal(err)
		}
		var got []dt.Segment
		for s := range seq {
			got = append(got, s)
		}
		if want := clip(segs, off, n); fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("Segments(%d, %d, %d) = %v, want %v", count, off, n, got, want)
		}
		it, err := x.NewIterator(count)
		if err != nil {
			t.Fatal(err)
		}
		if err := it.SetPos(off); err != nil {
			t.Fatal(err)
		}
		buf := make([]dt.Segment, rapid.IntRange(1, 5).Draw(t, "maxsegs"))
		for calls := 0; !it.Done() && calls < 40; calls++ { // the reference is slow
			at := it.Pos()
			max := rapid.Int64Range(1, 5000).Draw(t, "maxbytes")
			s, m := it.Next(buf, max)
			if m <= 0 || m > max || it.Pos() != at+m {
				t.Fatalf("Next at %d (max %d) = %d bytes, pos %d", at, max, m, it.Pos())
			}
			// Each chunk is exactly the reference of the bytes it returned,
			// and it stops short of max only on the segment limit.
			want := clip(segs, at, m)
			if fmt.Sprint(s) != fmt.Sprint(want) {
				t.Fatalf("Next at %d = %v, want %v", at, s, want)
			}
			if m < max && at+m < total && len(s) < len(buf) {
				t.Fatalf("Next at %d stopped at %d bytes with %d of %d segments", at, m, len(s), len(buf))
			}
		}
	})
}
