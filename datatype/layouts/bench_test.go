package layouts

import "testing"

// BenchmarkLayouts measures pack, unpack and copy of the same byte count for
// every layout; b.SetBytes makes the harness report MB/s of packed data.
func BenchmarkLayouts(b *testing.B) {
	for _, name := range Names {
		l, err := Build(name)
		if err != nil {
			b.Fatal(err)
		}
		src, packed := l.Buffers()
		cpy := make([]byte, l.Packed)
		b.Run(name+"/pack", func(b *testing.B) {
			b.SetBytes(l.Packed)
			for b.Loop() {
				if _, err := l.Type.Pack(packed, src, l.Base, 1); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(name+"/unpack", func(b *testing.B) {
			b.SetBytes(l.Packed)
			for b.Loop() {
				if _, err := l.Type.Unpack(src, packed, l.Base, 1); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(name+"/copy", func(b *testing.B) {
			b.SetBytes(l.Packed)
			for b.Loop() {
				copy(cpy, packed)
			}
		})
	}
}
