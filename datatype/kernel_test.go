package datatype_test

import (
	"bytes"
	"testing"

	"pgregory.net/rapid"

	dt "github.com/troupe-hpc/troupe/datatype"
)

// genKernelType draws the shapes the fast paths specialise: blocks of 1-80
// bytes, long vectors, transposes (small outer stride, large inner stride)
// and long uniform or irregular lists.
func genKernelType(t *rapid.T) *dt.Type {
	must := func(x *dt.Type, err error) *dt.Type {
		if err != nil {
			t.Fatalf("constructor: %v", err)
		}
		return x
	}
	elem := rapid.SampledFrom([]*dt.Type{dt.Byte, dt.Int16, dt.Float32, dt.Float64}).Draw(t, "elem")
	blk := must(dt.Contiguous(rapid.Int64Range(1, 10).Draw(t, "blk"), elem))
	switch rapid.IntRange(0, 3).Draw(t, "shape") {
	case 0: // vector
		n := rapid.Int64Range(1, 60).Draw(t, "n")
		st := rapid.Int64Range(-700, 700).Draw(t, "stride")
		return must(dt.HVector(n, 1, st, blk))
	case 1: // transpose: contiguous(m, resized(vector(n, 1, big), 0, small))
		n := rapid.Int64Range(1, 20).Draw(t, "n")
		big := rapid.Int64Range(256, 1200).Draw(t, "big")
		col := must(dt.Resized(must(dt.HVector(n, 1, big, blk)), 0, rapid.Int64Range(blk.Size(), max(blk.Size(), 64)).Draw(t, "small")))
		return must(dt.Contiguous(rapid.Int64Range(1, 12).Draw(t, "m"), col))
	case 2: // list
		k := rapid.IntRange(1, 60).Draw(t, "k")
		// Ascending lists of equal blocks are delta-coded; make some long
		// enough for several marks.
		ascending := rapid.Bool().Draw(t, "ascending")
		if ascending {
			k = rapid.IntRange(1, 300).Draw(t, "k")
		}
		d := make([]int64, k)
		for i := range d {
			d[i] = rapid.Int64Range(0, 30).Draw(t, "d")
			if ascending && i > 0 {
				d[i] += d[i-1]
			}
		}
		uniform := rapid.Bool().Draw(t, "uniform")
		bl := make([]int64, k)
		for i := range bl {
			bl[i] = 1
			if !uniform {
				bl[i] = rapid.Int64Range(1, 3).Draw(t, "bl")
			}
		}
		return must(dt.Indexed(bl, d, blk))
	default: // vector of vectors
		in := must(dt.HVector(rapid.Int64Range(1, 8).Draw(t, "n1"), 1, rapid.Int64Range(-300, 300).Draw(t, "s1"), blk))
		return must(dt.HVector(rapid.Int64Range(1, 8).Draw(t, "n2"), 1, rapid.Int64Range(-3000, 3000).Draw(t, "s2"), in))
	}
}

func TestPropertyKernels(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		x := genKernelType(t)
		count := rapid.Int64Range(1, 3).Draw(t, "count")
		segs, err := x.Typemap(count)
		if err != nil {
			t.Fatal(err)
		}
		lo := min(0, x.TrueLB())
		hi := max(x.TrueUB()+(count-1)*x.Extent(), 0)
		base := -lo
		src := make([]byte, hi-lo)
		for i := range src {
			src[i] = byte(i*131 + 7)
		}
		var want []byte
		for _, s := range segs {
			want = append(want, src[base+s.Off:base+s.Off+s.Len]...)
		}
		packed := make([]byte, len(want))
		if _, err := x.Pack(packed, src, base, count); err != nil || !bytes.Equal(packed, want) {
			t.Fatalf("pack mismatch (%v)", err)
		}
		off := rapid.Int64Range(0, int64(len(want))).Draw(t, "off")
		part := make([]byte, rapid.Int64Range(0, int64(len(want))).Draw(t, "len"))
		m, err := x.PackRange(part, src, base, count, off)
		if err != nil || !bytes.Equal(part[:m], want[off:off+m]) {
			t.Fatalf("partial pack mismatch (%v)", err)
		}
		if overlaps(segs) {
			return
		}
		dst := make([]byte, len(src))
		exp := make([]byte, len(src))
		for _, s := range segs {
			copy(exp[base+s.Off:base+s.Off+s.Len], src[base+s.Off:base+s.Off+s.Len])
		}
		if _, err := x.Unpack(dst, packed, base, count); err != nil || !bytes.Equal(dst, exp) {
			t.Fatalf("unpack mismatch (%v)", err)
		}
		// Unpacking in pieces (the transport's pipelined receive) starts
		// and stops inside blocks and list entries.
		step := rapid.Int64Range(1, max(1, int64(len(want)))).Draw(t, "step")
		clear(dst)
		for o := int64(0); o < int64(len(packed)); o += step {
			end := min(o+step, int64(len(packed)))
			if m, err := x.UnpackRange(dst, packed[o:end], base, count, o); err != nil || m != end-o {
				t.Fatalf("UnpackRange(%d, %d) = %d, %v", o, end-o, m, err)
			}
		}
		if !bytes.Equal(dst, exp) {
			t.Fatalf("unpack in pieces of %d bytes mismatch", step)
		}
	})
}
