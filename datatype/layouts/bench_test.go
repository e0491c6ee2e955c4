package layouts

import "testing"

// BenchmarkLayouts measures pack, unpack and copy of the same byte count for
// every layout. b.SetBytes makes the harness report MB/s of packed data; the
// GB/s metric is the same figure in the unit of troupe bench ddt.
func BenchmarkLayouts(b *testing.B) {
	for _, name := range Names {
		var (
			l           Layout
			src, packed []byte
			cpy         []byte
			built       bool
		)
		setup := func(b *testing.B) {
			if built {
				return
			}
			var err error
			if l, err = Build(name); err != nil {
				b.Fatal(err)
			}
			src, packed = l.Buffers()
			cpy = make([]byte, l.Packed)
			built = true
		}
		gbps := func(b *testing.B) {
			if s := b.Elapsed().Seconds(); s > 0 {
				b.ReportMetric(float64(l.Packed)*float64(b.N)/s/1e9, "GB/s")
			}
		}
		b.Run(name+"/pack", func(b *testing.B) {
			setup(b)
			b.SetBytes(l.Packed)
			for b.Loop() {
				if _, err := l.Type.Pack(packed, src, l.Base, 1); err != nil {
					b.Fatal(err)
				}
			}
			gbps(b)
		})
		b.Run(name+"/unpack", func(b *testing.B) {
			setup(b)
			b.SetBytes(l.Packed)
			for b.Loop() {
				if _, err := l.Type.Unpack(src, packed, l.Base, 1); err != nil {
					b.Fatal(err)
				}
			}
			gbps(b)
		})
		b.Run(name+"/copy", func(b *testing.B) {
			setup(b)
			b.SetBytes(l.Packed)
			for b.Loop() {
				copy(cpy, packed)
			}
			gbps(b)
		})
	}
}
