package gpu

import (
	"bytes"
	"fmt"
	"os"
	"testing"
)

// benchSetup opens a backend and returns its first device, a stream, two
// device buffers and a pinned host buffer of n bytes, all released when the
// benchmark ends.
func benchSetup(b *testing.B, backend string, n int) (dev *Device, st *Stream, d1, d2, h Buffer) {
	s, err := OpenBackend(backend)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { s.Close() })
	dev = s.Devices()[0]
	if st, err = dev.NewStream(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { st.Destroy() })
	d1, err1 := dev.Alloc(n)
	d2, err2 := dev.Alloc(n)
	h, err3 := s.AllocHost(n)
	if err1 != nil || err2 != nil || err3 != nil {
		b.Fatal(err1, err2, err3)
	}
	b.Cleanup(func() { Free(d1); Free(d2); Free(h) })
	return dev, st, d1, d2, h
}

// copyCase is one direction of a benchmarked copy.
type copyCase struct {
	name     string
	dst, src Buffer
}

// copyCases returns the first n bytes of the benchmark buffers as the three
// directions: device to pinned host, pinned host to device, device to device.
func copyCases(d1, d2, h Buffer, n int) []copyCase {
	sl := func(x Buffer) Buffer { y, _ := x.Slice(0, n); return y }
	return []copyCase{{"DtoH", sl(h), sl(d1)}, {"HtoD", sl(d1), sl(h)}, {"DtoD", sl(d2), sl(d1)}}
}

// timeSynced times op followed by a stream synchronize (op nil: the
// synchronize alone), once per benchmark iteration.
func timeSynced(b *testing.B, st *Stream, op func() error) {
	for b.Loop() {
		if op != nil {
			if err := op(); err != nil {
				b.Fatal(err)
			}
		}
		if err := st.Synchronize(); err != nil {
			b.Fatal(err)
		}
	}
}

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
			const max = 1 << 20
			_, st, d1, d2, h := benchSetup(b, bc.name, max)
			b.Run("sync", func(b *testing.B) { timeSynced(b, st, nil) })
			for _, n := range []int{8, 8 << 10, 32 << 10, max} {
				for _, c := range copyCases(d1, d2, h, n) {
					dst, src := c.dst, c.src
					b.Run(fmt.Sprintf("%s/%d", c.name, n), func(b *testing.B) {
						b.SetBytes(int64(n))
						timeSynced(b, st, func() error { return CopyAsync(st, dst, src) })
					})
					if n == 8 {
						// Waited for through an event recorded after it
						// instead, as the staged channel path does.
						b.Run(fmt.Sprintf("%s/%d/event", c.name, n), func(b *testing.B) {
							ev, err := st.Device().NewEvent()
							if err != nil {
								b.Fatal(err)
							}
							b.SetBytes(int64(n))
							for b.Loop() {
								err := CopyAsync(st, dst, src)
								if err == nil {
									err = ev.Record(st)
								}
								if err == nil {
									err = ev.Synchronize()
								}
								if err != nil {
									b.Fatal(err)
								}
							}
						})
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
				timeSynced(b, st, func() error { return WriteValue64(st, w, 1) })
			})
		})
	}
}

// BenchmarkKernelCopy times a small copy done by a kernel (troupe_copy of
// the test module: the SMs move the bytes, through the device mapping of
// pinned host memory for DtoH and HtoD) followed by a stream synchronize,
// beside the same copy by the copy engine (CopyAsync): whether a kernel is
// the cheaper way to move a few bytes into or out of device memory. "empty"
// launches the kernel with nothing to copy. cuda backend only.
func BenchmarkKernelCopy(b *testing.B) {
	if CUDAAvailable() != nil {
		b.Skip("no CUDA driver/device")
	}
	const size = 32 << 10
	dev, st, d1, d2, h := benchSetup(b, BackendCUDA, size)
	ptx, err := os.ReadFile(testKernelPTX)
	if err != nil {
		b.Fatal(err)
	}
	m, err := dev.LoadModule(ptx)
	if err != nil {
		b.Fatal(err)
	}
	defer m.Unload()
	kcopy, err := m.Function("troupe_copy")
	if err != nil {
		b.Fatal(err)
	}
	pattern := make([]byte, size)
	for i := range pattern {
		pattern[i] = byte(i*7 + 1)
	}
	if err := CopyFromHost(d1, pattern); err != nil {
		b.Fatal(err)
	}
	launch := func(dst, src Buffer, n int) error {
		threads := min(max(n/8, 32), 256)
		blocks := min((n/8+threads-1)/threads, 32)
		return Launch(st, kcopy, Dim3{X: max(blocks, 1)}, Dim3{X: threads},
			args8(uint64(dst.Ptr()), uint64(src.Ptr()), uint64(n)))
	}
	b.Run("empty", func(b *testing.B) {
		timeSynced(b, st, func() error { return launch(d1, d2, 0) })
	})
	for _, n := range []int{8, 2 << 10, 8 << 10, size} {
		for _, c := range copyCases(d1, d2, h, n) {
			dst, src := c.dst, c.src
			for _, how := range []string{"kernel", "engine"} {
				b.Run(fmt.Sprintf("%s/%d/%s", c.name, n, how), func(b *testing.B) {
					b.SetBytes(int64(n))
					timeSynced(b, st, func() error {
						if how == "kernel" {
							return launch(dst, src, n)
						}
						return CopyAsync(st, dst, src)
					})
					got := make([]byte, n)
					if err := CopyToHost(got, dst); err != nil {
						b.Fatal(err)
					}
					if !bytes.Equal(got, pattern[:n]) {
						b.Fatalf("%s copied wrong bytes", how)
					}
				})
			}
		}
	}
}

// BenchmarkAgentCopy compares Copy by the copy agent (agent.go) with Copy
// by the copy engine (agent off: cuMemcpy) and with CopyAsync + Synchronize
// (what hand staging costs per copy), per direction and size. Sizes above a
// direction's agent limit show the engine in all three.
func BenchmarkAgentCopy(b *testing.B) {
	if CUDAAvailable() != nil {
		b.Skip("no CUDA driver/device")
	}
	const size = 32 << 10
	_, st, d1, d2, h := benchSetup(b, BackendCUDA, size)
	s := d1.System()
	pattern := make([]byte, size)
	for i := range pattern {
		pattern[i] = byte(i*5 + 3)
	}
	if err := CopyFromHost(d1, pattern); err != nil {
		b.Fatal(err)
	}
	hb, err := h.Bytes()
	if err != nil {
		b.Fatal(err)
	}
	copy(hb, pattern)
	for _, n := range []int{8, 512, 2 << 10, 4 << 10, 8 << 10, 16 << 10, size} {
		for _, c := range copyCases(d1, d2, h, n) {
			dst, src := c.dst, c.src
			for _, how := range []string{"agent", "engine", "async"} {
				b.Run(fmt.Sprintf("%s/%d/%s", c.name, n, how), func(b *testing.B) {
					b.SetBytes(int64(n))
					switch how {
					case "agent":
						h8, _ := h.Slice(0, 8)
						d8, _ := d1.Slice(0, 8)
						warmAgent(b, s, h8, d8)
						before := s.AgentStats().Copies
						for b.Loop() {
							if err := Copy(dst, src); err != nil {
								b.Fatal(err)
							}
						}
						b.ReportMetric(float64(s.AgentStats().Copies-before)/float64(b.N), "agent/op")
					case "engine":
						s.agentOn = false
						for b.Loop() {
							if err := Copy(dst, src); err != nil {
								b.Fatal(err)
							}
						}
					case "async":
						timeSynced(b, st, func() error { return CopyAsync(st, dst, src) })
					}
					got := make([]byte, n)
					if err := CopyToHost(got, dst); err != nil {
						b.Fatal(err)
					}
					if !bytes.Equal(got, pattern[:n]) {
						b.Fatalf("%s copied wrong bytes", how)
					}
				})
			}
		}
	}
}
