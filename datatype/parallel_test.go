package datatype_test

import (
	"bytes"
	"testing"

	"pgregory.net/rapid"

	dt "github.com/troupe-hpc/troupe/datatype"
)

// TestPropertyParallel checks that PackParallel and UnpackParallel move
// exactly the bytes PackRaw and UnpackRaw move, for random nested types with
// enough elements to be cut into several parts, at random packed ranges and
// worker counts.
func TestPropertyParallel(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		x, _ := genType(t, 3)
		if x.Size() == 0 {
			return
		}
		count := max(1, rapid.Int64Range(0, 300<<10).Draw(t, "bytes")/x.Size())
		total, _ := x.PackedSize(count)
		lo, hi, err := x.DataBounds(count)
		if err != nil {
			t.Fatal(err)
		}
		base := -lo + 3
		src := make([]byte, base+hi+3)
		for i := range src {
			src[i] = byte(i*131 + 7)
		}
		off := rapid.Int64Range(0, total).Draw(t, "offset")
		length := rapid.Int64Range(0, total-off+10).Draw(t, "length")
		workers := rapid.IntRange(-1, 9).Draw(t, "workers")

		want := make([]byte, length)
		wn, werr := x.PackRaw(dt.SliceRegion(want), dt.SliceRegion(src), base, count, off)
		got := make([]byte, length)
		gn, gerr := x.PackParallel(dt.SliceRegion(got), dt.SliceRegion(src), base, count, off, workers)
		if gn != wn || (gerr == nil) != (werr == nil) || !bytes.Equal(got, want) {
			t.Fatalf("PackParallel(off %d, len %d, %d workers) = %d, %v; PackRaw = %d, %v; bytes equal %v",
				off, length, workers, gn, gerr, wn, werr, bytes.Equal(got, want))
		}
		tm, err := x.Typemap(count)
		if err != nil {
			t.Fatal(err)
		}
		if overlaps(tm) {
			return // unpack of overlapping typemaps is erroneous in MPI
		}
		ref := bytes.Repeat([]byte{0xA5}, len(src))
		wn, werr = x.UnpackRaw(dt.SliceRegion(ref), dt.SliceRegion(want), base, count, off)
		dst := bytes.Repeat([]byte{0xA5}, len(src))
		gn, gerr = x.UnpackParallel(dt.SliceRegion(dst), dt.SliceRegion(want), base, count, off, workers)
		if gn != wn || (gerr == nil) != (werr == nil) || !bytes.Equal(dst, ref) {
			t.Fatalf("UnpackParallel(off %d, len %d, %d workers) = %d, %v; UnpackRaw = %d, %v; bytes equal %v",
				off, length, workers, gn, gerr, wn, werr, bytes.Equal(dst, ref))
		}
	})
}

// TestParallelErrors checks that PackParallel and UnpackParallel reject bad
// arguments like PackRaw and UnpackRaw, before moving anything.
func TestParallelErrors(t *testing.T) {
	v, err := dt.Vector(1<<16, 1, 512, dt.Float64)
	if err != nil {
		t.Fatal(err)
	}
	total, _ := v.PackedSize(1)
	src := make([]byte, v.TrueExtent())
	dst := bytes.Repeat([]byte{1}, int(total))
	cases := []struct {
		name   string
		src    []byte
		base   int64
		count  int64
		offset int64
	}{
		{"short source", src[:len(src)-1], 0, 1, 0},
		{"negative count", src, 0, -1, 0},
		{"base outside", src, int64(len(src)) + 1, 1, 0},
		{"offset past end", src, 0, 1, total + 1},
	}
	for _, c := range cases {
		if _, err := v.PackParallel(dt.SliceRegion(dst), dt.SliceRegion(c.src), c.base, c.count, c.offset, 4); err == nil {
			t.Errorf("PackParallel, %s: no error", c.name)
		}
		if _, err := v.UnpackParallel(dt.SliceRegion(c.src), dt.SliceRegion(dst), c.base, c.count, c.offset, 4); err == nil {
			t.Errorf("UnpackParallel, %s: no error", c.name)
		}
	}
	if !bytes.Equal(dst, bytes.Repeat([]byte{1}, int(total))) {
		t.Error("a rejected PackParallel wrote to its destination")
	}
	for i, b := range src {
		if b != 0 {
			t.Fatalf("a rejected UnpackParallel wrote byte %d", i)
		}
	}
}

// TestWorkers checks the page-bound rule: small blocks a page apart over a
// large span get several workers (at most the limit, at most one per 32 KiB
// part); dense, cache-sized or large-block layouts get one.
func TestWorkers(t *testing.T) {
	mk := func(n, block, stride int64) *dt.Type {
		v, err := dt.Vector(n, block, stride, dt.Float64)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	cases := []struct {
		name  string
		t     *dt.Type
		count int64
		limit int
		want  int
	}{
		{"8 B blocks 4 KiB apart over 256 MiB", mk(1<<16, 1, 512), 1, 4, 4},
		{"same, limit 2", mk(1<<16, 1, 512), 1, 2, 2},
		{"same, limit 1", mk(1<<16, 1, 512), 1, 1, 1},
		{"same, limit 0", mk(1<<16, 1, 512), 1, 0, 1},
		{"8 B blocks 8 KiB apart, 64 KiB packed: two parts", mk(1<<13, 1, 1024), 1, 8, 2},
		{"8 B blocks 4 KiB apart over 16 MiB: within TLB reach", mk(1<<12, 1, 512), 1, 8, 1},
		{"8 B blocks 128 B apart: cache bound", mk(1<<20, 1, 16), 1, 8, 1},
		{"4 KiB blocks 1 MiB apart: bandwidth bound", mk(256, 512, 1<<17), 1, 8, 1},
		{"count repeats the element", mk(1<<12, 1, 512), 8, 8, 8},
		{"named type", dt.Float64, 1 << 20, 8, 1},
		{"zero count", mk(1<<16, 1, 512), 0, 8, 1},
		{"negative count", mk(1<<16, 1, 512), -1, 8, 1},
	}
	for _, c := range cases {
		if got := c.t.Workers(c.count, c.limit); got != c.want {
			t.Errorf("%s: Workers(%d, %d) = %d, want %d", c.name, c.count, c.limit, got, c.want)
		}
	}
}
