package gpupack

import (
	"testing"

	"github.com/troupe-hpc/troupe/datatype/layouts"
	"github.com/troupe-hpc/troupe/gpu"
)

// BenchmarkLayouts packs and unpacks the DDTBench-style layouts of
// datatype/layouts in device memory of the default system (TROUPE_GPU=cuda
// on a GPU machine; the host backend elsewhere, where the Go kernel is
// datatype's Pack), beside a device-to-device copy of the packed size in
// the same run. Each operation is enqueued and synchronized per iteration,
// so the figures include the launch and its completion.
func BenchmarkLayouts(b *testing.B) {
	sys, err := gpu.Default()
	if err != nil {
		b.Fatal(err)
	}
	defer sys.Close()
	dev := sys.Devices()[0]
	p, err := New(dev, Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer p.Close()
	st, err := dev.NewStream()
	if err != nil {
		b.Fatal(err)
	}
	defer st.Destroy()
	b.Logf("device %v", dev)
	for _, name := range layouts.Names {
		l, err := layouts.Build(name)
		if err != nil {
			b.Fatal(err)
		}
		var user, packed, cpy gpu.Buffer
		setup := func(b *testing.B) {
			if !user.IsZero() {
				return
			}
			src, _ := l.Buffers()
			if user, err = dev.Alloc(len(src)); err == nil {
				if packed, err = dev.Alloc(int(l.Packed)); err == nil {
					cpy, err = dev.Alloc(int(l.Packed))
				}
			}
			if err == nil {
				err = gpu.CopyFromHost(user, src)
			}
			if err != nil {
				b.Fatal(err)
			}
		}
		gbps := func(b *testing.B) {
			if s := b.Elapsed().Seconds(); s > 0 {
				b.ReportMetric(float64(l.Packed)*float64(b.N)/s/1e9, "GB/s")
			}
		}
		run := func(op string, f func() error) {
			b.Run(name+"/"+op, func(b *testing.B) {
				setup(b)
				b.SetBytes(l.Packed)
				for b.Loop() {
					if err := f(); err != nil {
						b.Fatal(err)
					}
					if err := st.Synchronize(); err != nil {
						b.Fatal(err)
					}
				}
				gbps(b)
			})
		}
		run("pack", func() error { _, err := p.Pack(st, packed, user, l.Type, l.Base, 1); return err })
		run("unpack", func() error { _, err := p.Unpack(st, user, packed, l.Type, l.Base, 1); return err })
		run("copy", func() error { return gpu.CopyAsync(st, cpy, packed) })
		for _, buf := range []gpu.Buffer{user, packed, cpy} {
			if !buf.IsZero() {
				gpu.Free(buf)
			}
		}
	}
}
