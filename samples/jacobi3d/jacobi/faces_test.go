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
	f := []float64{0, -0.0, 1.5, math.Inf(-1), math.NaN(), math.SmallestNonzeroFloat64, 1e300}
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
