package datatype_test

import (
	"bytes"
	"encoding/binary"
	"math"
	"testing"

	dt "github.com/troupe-hpc/troupe/datatype"
)

// prog interprets fuzz input as a little program of constructor calls on a
// stack of types. Integers are mostly small, sometimes full 64-bit (to hit
// overflow checks).
type prog struct {
	data  []byte
	stack []*dt.Type
}

func (p *prog) byte() byte {
	if len(p.data) == 0 {
		return 0
	}
	b := p.data[0]
	p.data = p.data[1:]
	return b
}

func (p *prog) int() int64 {
	b := p.byte()
	if b&0x80 == 0 {
		return int64(int8(b<<1) >> 1) // -64..63
	}
	if len(p.data) < 8 {
		return int64(b & 0x7f)
	}
	v := int64(binary.LittleEndian.Uint64(p.data))
	p.data = p.data[8:]
	return v
}

func (p *prog) pick() *dt.Type {
	if len(p.stack) == 0 {
		return dt.Int32
	}
	return p.stack[int(p.byte())%len(p.stack)]
}

func (p *prog) ints(n int) []int64 {
	s := make([]int64, n)
	for i := range s {
		s[i] = p.int()
	}
	return s
}

var fuzzNamed = []*dt.Type{dt.Byte, dt.Int8, dt.Int16, dt.Int32, dt.Int64, dt.Uint8, dt.Uint16,
	dt.Uint32, dt.Uint64, dt.Float32, dt.Float64, dt.Complex64, dt.Complex128, nil}

// run executes up to 24 operations and returns the types built.
func (p *prog) run() {
	for op := 0; op < 24 && len(p.data) > 0; op++ {
		var t *dt.Type
		var err error
		switch p.byte() % 14 {
		case 0:
			t = fuzzNamed[int(p.byte())%len(fuzzNamed)]
		case 1:
			t, err = dt.Contiguous(p.int(), p.pick())
		case 2:
			t, err = dt.Vector(p.int(), p.int(), p.int(), p.pick())
		case 3:
			t, err = dt.HVector(p.int(), p.int(), p.int(), p.pick())
		case 4:
			n := int(p.byte() % 8)
			t, err = dt.Indexed(p.ints(n), p.ints(int(p.byte()%8)), p.pick())
		case 5:
			n := int(p.byte() % 8)
			t, err = dt.HIndexed(p.ints(n), p.ints(n), p.pick())
		case 6:
			t, err = dt.IndexedBlock(p.int(), p.ints(int(p.byte()%8)), p.pick())
		case 7:
			t, err = dt.HIndexedBlock(p.int(), p.ints(int(p.byte()%8)), p.pick())
		case 8:
			n := int(p.byte() % 4)
			types := make([]*dt.Type, n)
			for i := range types {
				types[i] = p.pick()
			}
			t, err = dt.Struct(p.ints(n), p.ints(n), types)
		case 9:
			n := int(p.byte() % 4)
			t, err = dt.Subarray(p.ints(n), p.ints(n), p.ints(n), dt.Order(p.byte()%3), p.pick())
		case 10:
			t, err = dt.Resized(p.pick(), p.int(), p.int())
		case 11:
			t, err = dt.Dup(p.pick())
		case 12:
			if x := p.pick(); x != nil && !x.IsNamed() {
				_ = x.Free()
			}
		case 13:
			var x *dt.Type
			x, err = dt.Contiguous(p.int(), nil)
			_ = x
		}
		if err == nil && t != nil && len(p.stack) < 16 {
			p.stack = append(p.stack, t)
		}
	}
}

// exercise calls every query and, for small types, packs, unpacks and
// iterates; it must never panic.
func exercise(t *testing.T, x *dt.Type, count, off, chunk int64) {
	_ = x.String()
	_, _, _, _, _ = x.Size(), x.LB(), x.UB(), x.TrueLB(), x.TrueExtent()
	_, _ = x.SignatureHash(count)
	_, _ = x.TypeSignature(64)
	n, err := x.PackedSize(count)
	if err != nil || x.Freed() || n > 1<<14 || count > 64 {
		_, _ = x.Segments(count, off, chunk)
		if it, err := x.NewIterator(count); err == nil {
			_ = it.SetPos(off)
			it.Next(make([]dt.Segment, 4), chunk)
		}
		return
	}
	lo, hi := x.TrueLB(), x.TrueUB()
	if count > 1 {
		if e := x.Extent(); e > 0 && (count-1) > (math.MaxInt64-max(hi, 0))/e {
			// The data of count elements do not fit in 64 bits: Pack
			// must refuse, not panic.
			if _, err := x.Pack(make([]byte, n), nil, 0, count); err == nil && n > 0 {
				t.Fatal("Pack accepted a span beyond 64 bits")
			}
			return
		}
		hi += (count - 1) * x.Extent()
	}
	lo, hi = min(lo, 0), max(hi, 0)
	if hi-lo > 1<<16 || hi-lo < 0 { // negative: the span wrapped around
		return
	}
	src := make([]byte, hi-lo)
	for i := range src {
		src[i] = byte(i*131 + 7)
	}
	packed := make([]byte, n)
	if _, err := x.Pack(packed, src, -lo, count); err != nil {
		t.Fatalf("Pack of a valid small type failed: %v", err)
	}
	tm, err := x.Typemap(count)
	if err != nil {
		t.Fatal(err)
	}
	var want []byte
	for _, s := range tm {
		want = append(want, src[-lo+s.Off:-lo+s.Off+s.Len]...)
	}
	if !bytes.Equal(want, packed) {
		t.Fatalf("Pack differs from Typemap")
	}
	if chunk > 0 && off >= 0 && off <= n {
		part := make([]byte, min(chunk, 1<<14))
		m, err := x.PackRange(part, src, -lo, count, off)
		if err != nil || !bytes.Equal(part[:m], packed[off:off+m]) {
			t.Fatalf("PackRange(%d) differs: %v", off, err)
		}
		// The iterator, in chunks of `chunk` bytes and 3 segments.
		it, err := x.NewIterator(count)
		if err != nil {
			t.Fatal(err)
		}
		var got []byte
		buf := make([]dt.Segment, 3)
		for !it.Done() {
			segs, k := it.Next(buf, chunk)
			if k == 0 {
				t.Fatal("iterator made no progress")
			}
			for _, s := range segs {
				got = append(got, src[-lo+s.Off:-lo+s.Off+s.Len]...)
			}
		}
		if !bytes.Equal(got, packed) {
			t.Fatal("iterator differs from Pack")
		}
	}
	dst := make([]byte, len(src))
	if _, err := x.Unpack(dst, packed, -lo, count); err != nil {
		t.Fatal(err)
	}
	c := dt.NewLayoutCache(64)
	if l, err := c.Get(x, 4096, count); err != nil || l.Stats.Bytes != n {
		t.Fatalf("layout cache: %v", err)
	}
}

func FuzzConstruct(f *testing.F) {
	f.Add([]byte{2, 3, 2, 4, 0})                             // vector(3, 2, 4, pick)
	f.Add([]byte{0, 10, 2, 3, 1, 5, 0, 1, 2, 0})             // f64 then vector
	f.Add([]byte{8, 2, 1, 1, 0, 8, 0, 0, 10, 0, 5, 8, 1})    // struct
	f.Add([]byte{9, 2, 4, 5, 2, 3, 1, 2, 0, 0})              // subarray
	f.Add([]byte{1, 0x80, 0, 0, 0, 0, 0, 0, 0, 0x40, 0})     // huge contiguous
	f.Add([]byte{10, 0, 0x7c, 8, 1, 3, 0, 11, 0, 12, 0, 12}) // resized, dup, free
	f.Fuzz(func(t *testing.T, data []byte) {
		p := &prog{data: data}
		p.run()
		count := p.int() & 7
		off, chunk := p.int()&1023, p.int()&1023
		for _, x := range p.stack {
			exercise(t, x, count, off, chunk)
		}
	})
}

func FuzzIterator(f *testing.F) {
	f.Add([]byte{2, 3, 2, 4, 0, 2, 5, 7}, int64(1), int64(3), int64(5), uint8(2))
	f.Add([]byte{4, 3, 1, 2, 3, 3, 0, 5, 9, 0}, int64(2), int64(0), int64(1), uint8(1))
	f.Add([]byte{0, 10, 2, 40, 1, 2, 1}, int64(3), int64(17), int64(64), uint8(5))
	f.Fuzz(func(t *testing.T, data []byte, count, off, maxBytes int64, maxSegs uint8) {
		p := &prog{data: data}
		p.run()
		if len(p.stack) == 0 {
			return
		}
		x := p.stack[len(p.stack)-1]
		it, err := x.NewIterator(count)
		if err != nil {
			return
		}
		if it.SetPos(off) != nil {
			return
		}
		buf := make([]dt.Segment, int(maxSegs)%8)
		var seen int64
		for steps := 0; !it.Done() && steps < 64; steps++ {
			segs, n := it.Next(buf, maxBytes)
			var sum int64
			for _, s := range segs {
				if s.Len <= 0 {
					t.Fatalf("empty segment %v", s)
				}
				sum += s.Len
			}
			if sum != n || n > max(maxBytes, 0) {
				t.Fatalf("Next returned %d bytes in segments of %d (max %d)", n, sum, maxBytes)
			}
			if n == 0 {
				break
			}
			seen += n
		}
		if it.Pos() != off+seen {
			t.Fatalf("position %d, want %d", it.Pos(), off+seen)
		}
	})
}
