package jacobi

import (
	"encoding/binary"
	"math"
	"testing"
	"unsafe"
)

// TestFaceBytes: a face travels as little-endian float64s and reads back
// bit for bit, in place from aligned memory (as the sender's face buffers
// and the runtime's pooled landing memory are) and as a copy from
// misaligned memory.
func TestFaceBytes(t *testing.T) {
	f := []float64{0, math.Copysign(0, -1), 1.5, math.Inf(-1), math.NaN(), math.SmallestNonzeroFloat64, 1e300}
	p := faceBytes(f)
	if len(p) != 8*len(f) {
		t.Fatalf("%d floats became %d bytes", len(f), len(p))
	}
	for i, v := range f {
		if got := binary.LittleEndian.Uint64(p[8*i:]); got != math.Float64bits(v) {
			t.Fatalf("value %d: bytes %#x, want %#x", i, got, math.Float64bits(v))
		}
	}
	back := faceFloats(p)
	if len(back) != len(f) {
		t.Fatalf("read back %d floats, want %d", len(back), len(f))
	}
	for i := range f {
		if math.Float64bits(back[i]) != math.Float64bits(f[i]) {
			t.Fatalf("value %d read back as %v, want %v", i, back[i], f[i])
		}
	}
	if littleEndian && unsafe.SliceData(back) != unsafe.SliceData(f) {
		t.Error("an aligned face was copied instead of read in place")
	}
	// The same bytes one byte off their alignment: a copy, same values.
	raw := make([]byte, len(p)+1)
	copy(raw[1:], p)
	mis := faceFloats(raw[1:])
	for i := range f {
		if math.Float64bits(mis[i]) != math.Float64bits(f[i]) {
			t.Fatalf("misaligned value %d read as %v, want %v", i, mis[i], f[i])
		}
	}
	mis[0] = 42
	if raw[1] != p[0] {
		t.Error("reading a misaligned face wrote into it")
	}
	if faceFloats(nil) != nil {
		t.Error("an empty face read as non-nil")
	}
}

// TestHaloRing: faces of the current iteration and the next are kept
// apart by parity; older or further ones are errors; a used set empties.
func TestHaloRing(t *testing.T) {
	var r haloRing
	if r.current(4) != nil {
		t.Fatal("an empty ring has faces")
	}
	for _, iter := range []int{3, 6} {
		if _, err := r.add(iter, 4); err == nil {
			t.Errorf("a face of iteration %d was taken at sweep 4", iter)
		}
	}
	next, err := r.add(5, 4)
	if err != nil {
		t.Fatal(err)
	}
	next.n++
	if r.current(4) != nil {
		t.Fatal("the next iteration's face counts for the current one")
	}
	cur, err := r.add(4, 4)
	if err != nil {
		t.Fatal(err)
	}
	cur.n++
	if cur == next || r.current(4) != cur || cur.iter != 4 || next.iter != 5 {
		t.Fatalf("sets: current %p (iter %d), next %p (iter %d)", cur, cur.iter, next, next.iter)
	}
	r.done(4)
	if r.current(4) != nil || r.current(5) != next || next.n != 1 {
		t.Fatal("done emptied the wrong set")
	}
	// Sweep 5: iteration 6 takes the set iteration 4 left.
	if hs, err := r.add(6, 5); err != nil || hs != cur {
		t.Fatalf("iteration 6 at sweep 5: set %p (want %p), %v", hs, cur, err)
	}
}
