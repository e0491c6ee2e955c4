package transport

import (
	"context"
	"fmt"
	"testing"

	"github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/gpu"
)

// BenchmarkChannelTypedPingPong compares, in one run, a channel round trip
// of a vector layout in device memory (host backend), sent with SendTyped
// and received with RecvTyped (packed and unpacked on the device), against
// the same number of bytes as one contiguous device buffer with Send and
// Recv, and (over more than one channel chunk) against the typed transfer
// packed and unpacked whole (typed-whole) instead of chunk by chunk as the
// chunks go. All go over UCX between two in-process ranks.
func BenchmarkChannelTypedPingPong(b *testing.B) {
	noLocalPath = true
	defer func() { noLocalPath = false }()
	sys, err := gpu.OpenBackend(gpu.BackendHost)
	if err != nil {
		b.Fatal(err)
	}
	defer sys.Close()
	dev := sys.Devices()[0]
	for _, blocks := range []int64{64, 1024, 16384, 65536} {
		vec, err := datatype.Vector(blocks, 8, 16, datatype.Float64) // 64-byte blocks, 128 apart
		if err != nil {
			b.Fatal(err)
		}
		for _, variant := range []string{"plain", "typed", "typed-whole"} {
			if variant == "typed-whole" && 64*blocks <= ChannelChunkSize {
				continue // one chunk: nothing to pipeline
			}
			typed := variant != "plain"
			n := int(64 * blocks)
			if typed {
				n = int(vec.Extent())
			}
			b.Run(fmt.Sprintf("%dx64B/%s", blocks, variant), func(b *testing.B) {
				typedChannelWhole = variant == "typed-whole"
				defer func() { typedChannelWhole = false }()
				bufs := [2]gpu.Buffer{}
				for i := range bufs {
					if bufs[i], err = dev.Alloc(n); err != nil {
						b.Fatal(err)
					}
					defer gpu.Free(bufs[i])
				}
				var chans [2]*Channel
				trip := func(t *Transport, sendFirst bool) error {
					r := t.Rank()
					if chans[r] == nil {
						c, err := t.Channel(30, 1-r)
						if err != nil {
							return err
						}
						chans[r] = c
					}
					c, buf := chans[r], bufs[r]
					send := func() (*ChannelRequest, error) {
						if typed {
							return c.SendTyped(buf, vec, 1)
						}
						return c.Send(buf)
					}
					recv := func() (*ChannelRequest, error) {
						if typed {
							return c.RecvTyped(buf, vec, 1)
						}
						return c.Recv(buf)
					}
					for _, op := range [][2]func() (*ChannelRequest, error){{send, recv}, {recv, send}}[boolInt(!sendFirst)] {
						req, err := op()
						if err != nil {
							return err
						}
						if err := req.Wait(context.Background()); err != nil {
							return err
						}
					}
					return nil
				}
				pingPong(b, func(_ context.Context, t *Transport) error { return trip(t, true) },
					func(_ context.Context, t *Transport) error { return trip(t, false) })
				b.SetBytes(int64(64 * blocks))
				for _, c := range chans {
					if c != nil {
						_ = c.Close()
					}
				}
			})
		}
	}
}

// BenchmarkTypedBufferPingPong compares, in one run, a typed round trip of
// a vector (64-byte or 1 KiB blocks) through the MPI-style API: Go memory with
// SendTyped and RecvTyped, against device memory (host backend) with
// SendTypedBuffer and RecvTypedBuffer, packed by gpupack into pinned
// memory chunk by chunk as the transfer goes (device), and against the
// same stages packed whole before the send and unpacked whole after the
// receive (device-whole, what the Buffer calls did before 2026-12-04).
func BenchmarkTypedBufferPingPong(b *testing.B) {
	sys, err := gpu.OpenBackend(gpu.BackendHost)
	if err != nil {
		b.Fatal(err)
	}
	defer sys.Close()
	dev := sys.Devices()[0]
	for _, shape := range []struct{ blocks, block int64 }{{64, 64}, {1024, 64}, {16384, 64}, {1024, 1024}} {
		vec, err := datatype.Vector(shape.blocks, shape.block/8, shape.block/4, datatype.Float64) // stride twice the block
		if err != nil {
			b.Fatal(err)
		}
		for _, way := range []string{"go-memory", "device", "device-whole"} {
			b.Run(fmt.Sprintf("%dx%dB/%s", shape.blocks, shape.block, way), func(b *testing.B) {
				var bufs [2]gpu.Buffer
				for i := range bufs {
					if bufs[i], err = dev.Alloc(int(vec.Extent())); err != nil {
						b.Fatal(err)
					}
					defer gpu.Free(bufs[i])
				}
				host := [2][]byte{make([]byte, vec.Extent()), make([]byte, vec.Extent())}
				send := func(ctx context.Context, t *Transport) error {
					r := t.Rank()
					switch way {
					case "device":
						return t.SendTypedBuffer(ctx, 1-r, 1, bufs[r], vec, 1)
					case "device-whole":
						s, err := t.StageTyped(bufs[r], vec, 0, 1)
						if err != nil {
							return err
						}
						defer s.Release()
						if err := s.Pack(); err != nil {
							return err
						}
						q, err := t.IsendTyped(1-r, 1, s.Bytes, s.Twin, 1) // as the Buffer calls
						if err != nil {
							return err
						}
						_, err = q.Wait(ctx)
						return err
					}
					return t.SendTyped(ctx, 1-r, 1, host[r], vec, 1)
				}
				recv := func(ctx context.Context, t *Transport) error {
					r := t.Rank()
					switch way {
					case "device":
						_, err := t.RecvTypedBuffer(ctx, 1-r, 1, bufs[r], vec, 1)
						return err
					case "device-whole":
						s, err := t.StageTyped(bufs[r], vec, 0, 1)
						if err != nil {
							return err
						}
						defer s.Release()
						q, err := t.IrecvTyped(1-r, 1, s.Bytes, s.Twin, 1)
						if err != nil {
							return err
						}
						st, err := q.Wait(ctx)
						if err != nil {
							return err
						}
						return s.Unpack(int64(st.Size))
					}
					_, err := t.RecvTyped(ctx, 1-r, 1, host[r], vec, 1)
					return err
				}
				pingPong(b, func(ctx context.Context, t *Transport) error {
					if err := send(ctx, t); err != nil {
						return err
					}
					return recv(ctx, t)
				}, func(ctx context.Context, t *Transport) error {
					if err := recv(ctx, t); err != nil {
						return err
					}
					return send(ctx, t)
				})
				b.SetBytes(shape.blocks * shape.block)
			})
		}
	}
}
