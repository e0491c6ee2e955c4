package layouts

import (
	"fmt"
	"runtime"
	"testing"

	dt "github.com/troupe-hpc/troupe/datatype"
)

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
		// Page-bound layouts also pack on several goroutines (at most
		// GOMAXPROCS; see datatype.Type.Workers).
		b.Run(name+"/pack_parallel", func(b *testing.B) {
			setup(b)
			w := l.Type.Workers(1, runtime.GOMAXPROCS(0))
			if w == 1 {
				b.Skip("not page-bound, or one processor: PackParallel would use one goroutine")
			}
			b.SetBytes(l.Packed)
			for b.Loop() {
				if _, err := l.Type.PackParallel(dt.SliceRegion(packed), dt.SliceRegion(src), l.Base, 1, 0, w); err != nil {
					b.Fatal(err)
				}
			}
			gbps(b)
			b.ReportMetric(float64(w), "workers")
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

// BenchmarkChunkedPack packs every layout in 128 KiB pieces (PackRaw with
// offsets, as the transport's pipelined host pack does) and whole.
func BenchmarkChunkedPack(b *testing.B) {
	for _, name := range Names {
		l, err := Build(name)
		if err != nil {
			b.Fatal(err)
		}
		src, packed := l.Buffers()
		const chunk = 128 << 10
		b.Run(name+"/chunked", func(b *testing.B) {
			b.SetBytes(l.Packed)
			for b.Loop() {
				for off := int64(0); off < l.Packed; off += chunk {
					end := min(off+chunk, l.Packed)
					if _, err := l.Type.PackRaw(dt.SliceRegion(packed[off:end]), dt.SliceRegion(src), l.Base, 1, off); err != nil {
						b.Fatal(err)
					}
				}
			}
		})
		b.Run(name+"/whole", func(b *testing.B) {
			b.SetBytes(l.Packed)
			for b.Loop() {
				if _, err := l.Type.Pack(packed, src, l.Base, 1); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkGap packs 64 blocks of 4 KiB (256 KiB, as vec_4KiB) whose gaps
// grow from 64 B to 4 KiB (vec_4KiB's), beside a copy of the same bytes: it
// shows what the gaps between blocks, not the blocks, cost (docs/datatype.md,
// "Of copy").
func BenchmarkGap(b *testing.B) {
	const blocks, elems = 64, 512 // 4 KiB of float64 per block
	packed := make([]byte, blocks*elems*8)
	b.Run("copy", func(b *testing.B) {
		src := make([]byte, len(packed))
		b.SetBytes(int64(len(packed)))
		for b.Loop() {
			copy(packed, src)
		}
	})
	for _, gap := range []int64{64, 1 << 10, 2 << 10, 4 << 10} {
		t, err := dt.Vector(blocks, elems, elems+gap/8, dt.Float64)
		if err != nil {
			b.Fatal(err)
		}
		src := make([]byte, t.Extent())
		b.Run(fmt.Sprintf("gap_%d/pack", gap), func(b *testing.B) {
			b.SetBytes(int64(len(packed)))
			for b.Loop() {
				if _, err := t.Pack(packed, src, 0, 1); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
