package datatype_test

import (
	"bytes"
	"fmt"
	"slices"
	"sort"
	"testing"

	"pgregory.net/rapid"

	dt "github.com/troupe-hpc/troupe/datatype"
)

// The reference model: a type as its fully expanded typemap (one entry per
// basic element, in order) with its lb and ub markers, and its MPI bounds
// computed from them as MPI-4 section 5.1.7 defines: lb is the lowest lb
// marker if the typemap holds one, else the lowest data displacement; ub
// the highest ub marker if it holds one, else the highest data end; an
// empty typemap has lb = ub = 0. Resized and Subarray put the markers in;
// every other constructor copies them with the data. A copy of an empty
// typemap without markers still bounds the new type at its displacement, as
// its lb = ub = 0 says (the package's rule, and MPICH's and Open MPI's):
// pts holds those points.
type refElem struct {
	disp int64
	t    *dt.Type // named type
}

type ref struct {
	tm       []refElem
	lbm, ubm []int64 // lb and ub markers
	pts      []int64 // copies of empty typemaps
}

func (r *ref) lb() int64 {
	if len(r.lbm) > 0 {
		return slices.Min(r.lbm)
	}
	starts := r.starts()
	if len(starts) == 0 {
		return 0
	}
	return slices.Min(starts)
}

func (r *ref) ub() int64 {
	if len(r.ubm) > 0 {
		return slices.Max(r.ubm)
	}
	ends := append([]int64{}, r.pts...)
	for _, e := range r.tm {
		ends = append(ends, e.disp+e.t.Size())
	}
	if len(ends) == 0 {
		return 0
	}
	return slices.Max(ends)
}

// starts lists the points and the data displacements.
func (r *ref) starts() []int64 {
	out := append([]int64{}, r.pts...)
	for _, e := range r.tm {
		out = append(out, e.disp)
	}
	return out
}

func (r *ref) ext() int64 { return r.ub() - r.lb() }

func named(t *dt.Type) *ref {
	return &ref{tm: []refElem{{0, t}}}
}

// copies builds a typemap from copies of old (data, markers and points) at
// the given displacements.
func copies(old *ref, disps []int64) *ref {
	r := &ref{}
	empty := len(old.tm) == 0 && len(old.lbm) == 0 && len(old.pts) == 0
	for _, d := range disps {
		for _, e := range old.tm {
			r.tm = append(r.tm, refElem{d + e.disp, e.t})
		}
		for _, m := range old.lbm {
			r.lbm = append(r.lbm, d+m)
		}
		for _, m := range old.ubm {
			r.ubm = append(r.ubm, d+m)
		}
		for _, p := range old.pts {
			r.pts = append(r.pts, d+p)
		}
		if empty {
			r.pts = append(r.pts, d)
		}
	}
	return r
}

var namedTypes = []*dt.Type{dt.Byte, dt.Int8, dt.Int16, dt.Int32, dt.Int64, dt.Uint8, dt.Uint16,
	dt.Uint32, dt.Uint64, dt.Float32, dt.Float64, dt.Complex64, dt.Complex128}

// genType draws a random nested type and its reference model.
func genType(t *rapid.T, depth int) (*dt.Type, *ref) {
	kind := rapid.IntRange(0, 11).Draw(t, "kind")
	if depth <= 0 {
		kind = 0
	}
	must := func(x *dt.Type, err error) *dt.Type {
		if err != nil {
			t.Fatalf("constructor failed: %v", err)
		}
		return x
	}
	small := func(label string) int64 {
		// Zero counts are corner cases worth hitting, but rarely.
		if rapid.IntRange(0, 7).Draw(t, label+"_zero") == 7 {
			return 0
		}
		return rapid.Int64Range(1, 3).Draw(t, label)
	}
	disp := func(label string) int64 { return rapid.Int64Range(-6, 6).Draw(t, label) }
	switch kind {
	case 0:
		nt := rapid.SampledFrom(namedTypes).Draw(t, "named")
		return nt, named(nt)
	case 1: // contiguous
		old, ro := genType(t, depth-1)
		n := small("count")
		var ds []int64
		for i := int64(0); i < n; i++ {
			ds = append(ds, i*ro.ext())
		}
		return must(dt.Contiguous(n, old)), copies(ro, ds)
	case 2, 3: // vector / hvector
		old, ro := genType(t, depth-1)
		n, bl := small("count"), small("blocklen")
		st := disp("stride")
		bs := st * ro.ext()
		var x *dt.Type
		if kind == 3 {
			bs = rapid.Int64Range(-40, 40).Draw(t, "hstride")
			x = must(dt.HVector(n, bl, bs, old))
		} else {
			x = must(dt.Vector(n, bl, st, old))
		}
		var ds []int64
		for i := int64(0); i < n; i++ {
			for j := int64(0); j < bl; j++ {
				ds = append(ds, i*bs+j*ro.ext())
			}
		}
		return x, copies(ro, ds)
	case 4, 5, 6, 7: // indexed family
		old, ro := genType(t, depth-1)
		k := rapid.IntRange(1, 4).Draw(t, "blocks")
		bls := make([]int64, k)
		dps := make([]int64, k)
		ubl := small("blocklen")
		for i := range bls {
			bls[i] = small("bl")
			dps[i] = disp("disp")
			if kind >= 6 {
				bls[i] = ubl
			}
			if kind == 5 || kind == 7 {
				dps[i] = rapid.Int64Range(-40, 40).Draw(t, "hdisp")
			}
		}
		var x *dt.Type
		switch kind {
		case 4:
			x = must(dt.Indexed(bls, dps, old))
		case 5:
			x = must(dt.HIndexed(bls, dps, old))
		case 6:
			x = must(dt.IndexedBlock(ubl, dps, old))
		case 7:
			x = must(dt.HIndexedBlock(ubl, dps, old))
		}
		r := &ref{}
		for i := range bls {
			bd := dps[i]
			if kind == 4 || kind == 6 {
				bd *= ro.ext()
			}
			var ds []int64
			for j := int64(0); j < bls[i]; j++ {
				ds = append(ds, bd+j*ro.ext())
			}
			r = merge(r, copies(ro, ds))
		}
		return x, r
	case 8: // struct
		k := rapid.IntRange(1, 3).Draw(t, "fields")
		var bls, dps []int64
		var types []*dt.Type
		r := &ref{}
		for i := 0; i < k; i++ {
			old, ro := genType(t, depth-1)
			bl, d := small("bl"), rapid.Int64Range(-40, 40).Draw(t, "sdisp")
			bls, dps, types = append(bls, bl), append(dps, d), append(types, old)
			var ds []int64
			for j := int64(0); j < bl; j++ {
				ds = append(ds, d+j*ro.ext())
			}
			r = merge(r, copies(ro, ds))
		}
		return must(dt.Struct(bls, dps, types)), r
	case 9: // subarray
		old, ro := genType(t, depth-1)
		nd := rapid.IntRange(1, 3).Draw(t, "ndims")
		sizes, subs, starts := make([]int64, nd), make([]int64, nd), make([]int64, nd)
		for i := 0; i < nd; i++ {
			sizes[i] = rapid.Int64Range(1, 4).Draw(t, "size")
			subs[i] = sizes[i] - rapid.Int64Range(0, sizes[i]).Draw(t, "sub")
			starts[i] = rapid.Int64Range(0, sizes[i]-subs[i]).Draw(t, "start")
		}
		order := dt.Order(rapid.IntRange(0, 1).Draw(t, "order"))
		x := must(dt.Subarray(sizes, subs, starts, order, old))
		// Enumerate subarray indices in storage order (fastest index last in
		// the odometer for C, first for Fortran).
		stride := make([]int64, nd)
		s := int64(1)
		for i := 0; i < nd; i++ {
			d := nd - 1 - i
			if order == dt.OrderFortran {
				d = i
			}
			stride[d] = s
			s *= sizes[d]
		}
		var ds []int64
		idx := make([]int64, nd)
		var rec func(level int)
		rec = func(level int) {
			if level == nd {
				var off int64
				for d := 0; d < nd; d++ {
					off += (starts[d] + idx[d]) * stride[d]
				}
				ds = append(ds, off*ro.ext())
				return
			}
			d := level // C: slowest first
			if order == dt.OrderFortran {
				d = nd - 1 - level
			}
			for i := int64(0); i < subs[d]; i++ {
				idx[d] = i
				rec(level + 1)
			}
		}
		rec(0)
		r := copies(ro, ds) // MPI defines it through Resized: new markers
		r.lbm, r.ubm = []int64{0}, []int64{s * ro.ext()}
		return x, r
	case 10: // resized
		old, ro := genType(t, depth-1)
		lb, ext := disp("lb"), rapid.Int64Range(0, 24).Draw(t, "extent")
		r := &ref{tm: ro.tm, lbm: []int64{lb}, ubm: []int64{lb + ext}}
		return must(dt.Resized(old, lb, ext)), r
	default: // dup
		old, ro := genType(t, depth-1)
		return must(dt.Dup(old)), ro
	}
}

// merge concatenates two typemaps, markers included.
func merge(a, b *ref) *ref {
	return &ref{
		tm:  append(append([]refElem{}, a.tm...), b.tm...),
		lbm: append(append([]int64{}, a.lbm...), b.lbm...),
		ubm: append(append([]int64{}, a.ubm...), b.ubm...),
		pts: append(append([]int64{}, a.pts...), b.pts...),
	}
}

// expand returns the reference byte segments of count elements, unmerged.
func (r *ref) expand(count int64) []dt.Segment {
	var out []dt.Segment
	for i := int64(0); i < count; i++ {
		for _, e := range r.tm {
			out = append(out, dt.Segment{Off: i*r.ext() + e.disp, Len: e.t.Size()})
		}
	}
	return out
}

func mergeSegs(s []dt.Segment) []dt.Segment {
	var out []dt.Segment
	for _, g := range s {
		if k := len(out) - 1; k >= 0 && out[k].Off+out[k].Len == g.Off {
			out[k].Len += g.Len
			continue
		}
		out = append(out, g)
	}
	return out
}

func overlaps(s []dt.Segment) bool {
	c := append([]dt.Segment{}, s...)
	sort.Slice(c, func(i, j int) bool { return c[i].Off < c[j].Off })
	for i := 1; i < len(c); i++ {
		if c[i-1].Off+c[i-1].Len > c[i].Off {
			return true
		}
	}
	return false
}

func TestPropertyQueriesAndTypemap(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		x, r := genType(t, 3)
		count := rapid.Int64Range(0, 3).Draw(t, "count")
		var size, trueLo, trueHi int64
		for i, e := range r.tm {
			size += e.t.Size()
			if i == 0 || e.disp < trueLo {
				trueLo = e.disp
			}
			if i == 0 || e.disp+e.t.Size() > trueHi {
				trueHi = e.disp + e.t.Size()
			}
		}
		if x.Size() != size || x.LB() != r.lb() || x.UB() != r.ub() || x.Extent() != r.ext() {
			t.Fatalf("size/lb/ub = %d/%d/%d, want %d/%d/%d", x.Size(), x.LB(), x.UB(), size, r.lb(), r.ub())
		}
		if x.TrueLB() != trueLo || x.TrueUB() != trueHi {
			t.Fatalf("true lb/ub = %d/%d, want %d/%d", x.TrueLB(), x.TrueUB(), trueLo, trueHi)
		}
		if n, err := x.PackedSize(count); err != nil || n != count*size {
			t.Fatalf("PackedSize = %d, %v; want %d", n, err, count*size)
		}
		tm, err := x.Typemap(count)
		if err != nil {
			t.Fatal(err)
		}
		want := mergeSegs(r.expand(count))
		if fmt.Sprint(tm) != fmt.Sprint(want) {
			t.Fatalf("typemap %v, want %v", tm, want)
		}
		// Signatures: the type equals a struct of its basic elements.
		var bls, dps []int64
		var types []*dt.Type
		for _, e := range r.tm {
			bls, dps, types = append(bls, 1), append(dps, e.disp), append(types, e.t)
		}
		flat, err := dt.Struct(bls, dps, types)
		if err != nil {
			t.Fatal(err)
		}
		h1, err1 := x.SignatureHash(count)
		h2, err2 := flat.SignatureHash(count)
		if err1 != nil || err2 != nil || h1 != h2 || h1.Elements != count*int64(len(r.tm)) {
			t.Fatalf("signature %v vs %v (%v, %v)", h1, h2, err1, err2)
		}
		s1, err1 := x.TypeSignature(1 << 12)
		s2, err2 := flat.TypeSignature(1 << 12)
		if err1 != nil || err2 != nil || fmt.Sprint(s1) != fmt.Sprint(s2) {
			t.Fatalf("TypeSignature %v vs %v", s1, s2)
		}
	})
}

func TestPropertyPackUnpack(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		x, r := genType(t, 3)
		count := rapid.Int64Range(0, 3).Draw(t, "count")
		segs := r.expand(count)
		lo, hi := int64(0), int64(0)
		for _, s := range segs {
			lo, hi = min(lo, s.Off), max(hi, s.Off+s.Len)
		}
		pad := rapid.Int64Range(0, 8).Draw(t, "pad")
		base := -lo + pad
		n := base + hi + pad
		src := make([]byte, n)
		for i := range src {
			src[i] = byte(i*131 + 7)
		}
		var want []byte
		for _, s := range segs {
			want = append(want, src[base+s.Off:base+s.Off+s.Len]...)
		}
		packed := make([]byte, len(want))
		if m, err := x.Pack(packed, src, base, count); err != nil || m != int64(len(want)) || !bytes.Equal(packed, want) {
			t.Fatalf("Pack = %d, %v: %x, want %x", m, err, packed, want)
		}
		// Partial packs in random chunks concatenate to the full pack.
		var cat []byte
		for off := int64(0); off < int64(len(want)); {
			c := rapid.Int64Range(1, int64(len(want))).Draw(t, "chunk")
			buf := make([]byte, c)
			m, err := x.PackRange(buf, src, base, count, off)
			if err != nil || m != min(c, int64(len(want))-off) {
				t.Fatalf("PackRange(%d, %d) = %d, %v", off, c, m, err)
			}
			cat = append(cat, buf[:m]...)
			off += m
		}
		if !bytes.Equal(cat, want) {
			t.Fatalf("partial packs %x, want %x", cat, want)
		}
		if overlaps(segs) {
			return // unpack of overlapping typemaps is erroneous in MPI
		}
		dst := make([]byte, n)
		for i := range dst {
			dst[i] = 0xA5
		}
		exp := append([]byte{}, dst...)
		for _, s := range segs {
			copy(exp[base+s.Off:base+s.Off+s.Len], src[base+s.Off:base+s.Off+s.Len])
		}
		if m, err := x.Unpack(dst, packed, base, count); err != nil || m != int64(len(want)) || !bytes.Equal(dst, exp) {
			t.Fatalf("Unpack = %d, %v: %x, want %x", m, err, dst, exp)
		}
		// Partial unpacks in random chunks give the same result.
		for i := range dst {
			dst[i] = 0xA5
		}
		for off := int64(0); off < int64(len(want)); {
			c := rapid.Int64Range(1, int64(len(want))).Draw(t, "uchunk")
			end := min(off+c, int64(len(want)))
			m, err := x.UnpackRange(dst, packed[off:end], base, count, off)
			if err != nil || m != end-off {
				t.Fatalf("UnpackRange = %d, %v", m, err)
			}
			off = end
		}
		if !bytes.Equal(dst, exp) {
			t.Fatalf("partial unpacks %x, want %x", dst, exp)
		}
	})
}

func TestPropertyIterator(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		x, r := genType(t, 3)
		count := rapid.Int64Range(0, 3).Draw(t, "count")
		want := mergeSegs(r.expand(count))
		it, err := x.NewIterator(count)
		if err != nil {
			t.Fatal(err)
		}
		var got []dt.Segment
		buf := make([]dt.Segment, rapid.IntRange(1, 4).Draw(t, "maxsegs"))
		for !it.Done() {
			segs, n := it.Next(buf, rapid.Int64Range(1, 64).Draw(t, "maxbytes"))
			if n == 0 || len(segs) == 0 {
				t.Fatalf("no progress at %d of %d", it.Pos(), it.Total())
			}
			var sum int64
			for _, s := range segs {
				sum += s.Len
			}
			if sum != n {
				t.Fatalf("segments sum %d, returned %d", sum, n)
			}
			got = append(got, segs...)
		}
		if g := mergeSegs(got); fmt.Sprint(g) != fmt.Sprint(want) {
			t.Fatalf("iterated %v, want %v", g, want)
		}
		// Segments from an arbitrary packed offset cover the rest of the stream.
		total := it.Total()
		off := rapid.Int64Range(0, total).Draw(t, "offset")
		seq, err := x.Segments(count, off, -1)
		if err != nil {
			t.Fatal(err)
		}
		var rest int64
		for s := range seq {
			rest += s.Len
		}
		if rest != total-off {
			t.Fatalf("segments from %d cover %d bytes, want %d", off, rest, total-off)
		}
	})
}
