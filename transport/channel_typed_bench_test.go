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
// Recv. Both go over UCX between two in-process ranks.
func BenchmarkChannelTypedPingPong(b *testing.B) {
	noLocalPath = true
	defer func() { noLocalPath = false }()
	sys, err := gpu.OpenBackend(gpu.BackendHost)
	if err != nil {
		b.Fatal(err)
	}
	defer sys.Close()
	dev := sys.Devices()[0]
	for _, blocks := range []int64{64, 1024, 16384} {
		vec, err := datatype.Vector(blocks, 8, 16, datatype.Float64) // 64-byte blocks, 128 apart
		if err != nil {
			b.Fatal(err)
		}
		for _, typed := range []bool{false, true} {
			name := fmt.Sprintf("%dx64B/plain", blocks)
			n := int(64 * blocks)
			if typed {
				name = fmt.Sprintf("%dx64B/typed", blocks)
				n = int(vec.Extent())
			}
			b.Run(name, func(b *testing.B) {
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
// a vector of 64-byte blocks through the MPI-style API: Go memory with
// SendTyped and RecvTyped, against device memory (host backend) with
// SendTypedBuffer and RecvTypedBuffer, packed by gpupack into pinned
// memory and sent as the packed twin.
func BenchmarkTypedBufferPingPong(b *testing.B) {
	sys, err := gpu.OpenBackend(gpu.BackendHost)
	if err != nil {
		b.Fatal(err)
	}
	defer sys.Close()
	dev := sys.Devices()[0]
	for _, blocks := range []int64{64, 1024, 16384} {
		vec, err := datatype.Vector(blocks, 8, 16, datatype.Float64)
		if err != nil {
			b.Fatal(err)
		}
		for _, device := range []bool{false, true} {
			name := fmt.Sprintf("%dx64B/go-memory", blocks)
			if device {
				name = fmt.Sprintf("%dx64B/device", blocks)
			}
			b.Run(name, func(b *testing.B) {
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
					if device {
						return t.SendTypedBuffer(ctx, 1-r, 1, bufs[r], vec, 1)
					}
					return t.SendTyped(ctx, 1-r, 1, host[r], vec, 1)
				}
				recv := func(ctx context.Context, t *Transport) error {
					r := t.Rank()
					var err error
					if device {
						_, err = t.RecvTypedBuffer(ctx, 1-r, 1, bufs[r], vec, 1)
					} else {
						_, err = t.RecvTyped(ctx, 1-r, 1, host[r], vec, 1)
					}
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
				b.SetBytes(64 * blocks)
			})
		}
	}
}
