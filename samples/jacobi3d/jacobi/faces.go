package jacobi

import (
	"encoding/binary"
	"math"
	"unsafe"

	"github.com/troupe-hpc/troupe/actor"
)

// littleEndian reports whether this host stores a float64 as
// binary.LittleEndian does, so that faces travel as their own memory.
var littleEndian = binary.NativeEndian.Uint16([]byte{1, 0}) == 1

// faceBytes returns face f as a Halo's Face: f's own memory on a
// little-endian host (the send reads it in place), else a little-endian
// copy.
func faceBytes(f []float64) actor.Payload {
	if littleEndian {
		return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(f))), 8*len(f))
	}
	p := make(actor.Payload, 8*len(f))
	for i, v := range f {
		binary.LittleEndian.PutUint64(p[8*i:], math.Float64bits(v))
	}
	return p
}

// faceFloats reads a Halo's Face (a multiple of 8 bytes): in place where
// the host is little-endian and the bytes are 8-byte aligned (pooled
// landing memory and the sender's own face buffers are), else as a copy.
func faceFloats(p actor.Payload) []float64 {
	if len(p) == 0 {
		return nil
	}
	if littleEndian && uintptr(unsafe.Pointer(unsafe.SliceData(p)))%8 == 0 {
		return unsafe.Slice((*float64)(unsafe.Pointer(unsafe.SliceData(p))), len(p)/8)
	}
	f := make([]float64, len(p)/8)
	for i := range f {
		f[i] = math.Float64frombits(binary.LittleEndian.Uint64(p[8*i:]))
	}
	return f
}
