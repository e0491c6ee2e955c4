package gpu

import (
	"fmt"
	"testing"
)

// BenchmarkStreamCopy times one stream-ordered copy followed by a stream
// synchronize, per direction and size, on every backend (the cuda one when
// there is a GPU): the fixed cost a staged or IPC transfer pays per
// message. "sync" is an empty stream's Synchronize alone.
func BenchmarkStreamCopy(b *testing.B) {
	for _, bc := range backendCases {
		b.Run(bc.name, func(b *testing.B) {
			if bc.name == BackendCUDA && CUDAAvailable() != nil {
				b.Skip("no CUDA driver/device")
			}
			s, err := OpenBackend(bc.name)
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			dev := s.Devices()[0]
			st, err := dev.NewStream()
			if err != nil {
				b.Fatal(err)
			}
			defer st.Destroy()
			const max = 1 << 20
			d1, err1 := dev.Alloc(max)
			d2, err2 := dev.Alloc(max)
			h, err3 := s.AllocHost(max)
			if err1 != nil || err2 != nil || err3 != nil {
				b.Fatal(err1, err2, err3)
			}
			defer Free(d1)
			defer Free(d2)
			defer Free(h)
			b.Run("sync", func(b *testing.B) {
				for b.Loop() {
					if err := st.Synchronize(); err != nil {
						b.Fatal(err)
					}
				}
			})
			for _, n := range []int{8, 8 << 10, 32 << 10, max} {
				for _, c := range []struct {
					name     string
					dst, src Buffer
				}{{"DtoH", h, d1}, {"HtoD", d1, h}, {"DtoD", d2, d1}} {
					dst, _ := c.dst.Slice(0, n)
					src, _ := c.src.Slice(0, n)
					b.Run(fmt.Sprintf("%s/%d", c.name, n), func(b *testing.B) {
						b.SetBytes(int64(n))
						for b.Loop() {
							if err := CopyAsync(st, dst, src); err != nil {
								b.Fatal(err)
							}
							if err := st.Synchronize(); err != nil {
								b.Fatal(err)
							}
						}
					})
					if n == 8 {
						// The synchronous call, for comparison with
						// CopyAsync + Synchronize above.
						b.Run(fmt.Sprintf("%s/%d/Copy", c.name, n), func(b *testing.B) {
							b.SetBytes(int64(n))
							for b.Loop() {
								if err := Copy(dst, src); err != nil {
									b.Fatal(err)
								}
							}
						})
					}
				}
			}
			b.Run("WriteValue64", func(b *testing.B) {
				w, _ := d1.Slice(0, 8)
				for b.Loop() {
					if err := WriteValue64(st, w, 1); err != nil {
						b.Fatal(err)
					}
					if err := st.Synchronize(); err != nil {
						b.Fatal(err)
					}
				}
			})
		})
	}
}
