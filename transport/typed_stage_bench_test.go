package transport

import (
	"testing"

	"github.com/troupe-hpc/troupe/datatype"
)

// BenchmarkTypedStage times staging a layout of 64 blocks of 2 KiB (128 KiB
// packed) in device memory (host backend): StageTyped, Pack and Release,
// and the same with Unpack, beside datatype.Pack of the layout in Go
// memory: what a device Typed field pays per message on each side.
func BenchmarkTypedStage(b *testing.B) {
	ts := localJob(b, 1, ProgressDirect)
	sys := hostSystem(b)
	ty, err := datatype.Vector(64, 2048, 4096, datatype.Byte)
	if err != nil {
		b.Fatal(err)
	}
	src := pattern(64*4096, 7)
	b.Run("go-memory-pack", func(b *testing.B) {
		out := make([]byte, 64*2048)
		b.SetBytes(int64(len(out)))
		for b.Loop() {
			if _, err := ty.Pack(out, src, 0, 1); err != nil {
				b.Fatal(err)
			}
		}
	})
	dev := typedBuf(b, sys, true, src)
	for _, unpack := range []bool{false, true} {
		name := "device-pack"
		if unpack {
			name = "device-unpack"
		}
		b.Run(name, func(b *testing.B) {
			b.SetBytes(64 * 2048)
			for b.Loop() {
				s, err := ts[0].StageTyped(dev, ty, 0, 1)
				if err != nil {
					b.Fatal(err)
				}
				if unpack {
					err = s.Unpack(int64(len(s.Bytes)))
				} else {
					err = s.Pack()
				}
				if err != nil {
					b.Fatal(err)
				}
				s.Release()
			}
		})
	}
}
