package transport

import (
	"context"
	"testing"

	"github.com/troupe-hpc/troupe/datatype"
)

// BenchmarkPingPong8 measures an 8-byte round trip between two in-process
// ranks; in any-source, rank 1 receives with AnySource (posted before the
// message comes, so matched in UCX with the source masked).
func BenchmarkPingPong8(b *testing.B) {
	for _, c := range []struct {
		name string
		src  int
	}{{"exact", 0}, {"any-source", AnySource}} {
		b.Run(c.name, func(b *testing.B) {
			buf0, buf1 := make([]byte, 8), make([]byte, 8)
			pingPong(b, func(ctx context.Context, t *Transport) error {
				if err := t.Send(ctx, 1, 1, buf0); err != nil {
					return err
				}
				_, err := t.Recv(ctx, 1, 1, buf0)
				return err
			}, func(ctx context.Context, t *Transport) error {
				if _, err := t.Recv(ctx, c.src, 1, buf1); err != nil {
					return err
				}
				return t.Send(ctx, 0, 1, buf1)
			})
		})
	}
}

// BenchmarkTypedPingPong measures a typed round trip (a vector of 64
// blocks of 64 B) between two in-process ranks, rank 1 receiving from rank
// 0 or with AnySource, with a typed receive or with a matched typed probe
// and the probed message's receive; in nonblocking, both ranks use
// IsendTyped and IrecvTyped, each followed by Wait (deferred.go).
func BenchmarkTypedPingPong(b *testing.B) {
	vec, err := datatype.Vector(64, 8, 16, datatype.Float64)
	if err != nil {
		b.Fatal(err)
	}
	for _, c := range []struct {
		name        string
		src         int
		probe       bool
		nonblocking bool
	}{{"exact", 0, false, false}, {"nonblocking", 0, false, true}, {"any-source", AnySource, false, false}, {"mprobe", 0, true, false}, {"mprobe-any-source", AnySource, true, false}} {
		b.Run(c.name, func(b *testing.B) {
			buf0, buf1 := make([]byte, vec.Extent()), make([]byte, vec.Extent())
			if c.nonblocking {
				pingPong(b, func(ctx context.Context, t *Transport) error {
					return typedNonblocking(ctx, t, 1, buf0, vec)
				}, func(ctx context.Context, t *Transport) error {
					return typedNonblocking(ctx, t, 0, buf1, vec)
				})
				return
			}
			recv := func(ctx context.Context, t *Transport) error {
				if !c.probe {
					_, err := t.RecvTyped(ctx, c.src, 1, buf1, vec, 1)
					return err
				}
				m, err := t.MprobeTyped(ctx, c.src, 1)
				if err != nil {
					return err
				}
				_, err = m.Recv(ctx, buf1, vec, 1)
				return err
			}
			pingPong(b, func(ctx context.Context, t *Transport) error {
				if err := t.SendTyped(ctx, 1, 1, buf0, vec, 1); err != nil {
					return err
				}
				_, err := t.RecvTyped(ctx, 1, 1, buf0, vec, 1)
				return err
			}, func(ctx context.Context, t *Transport) error {
				if err := recv(ctx, t); err != nil {
					return err
				}
				return t.SendTyped(ctx, 0, 1, buf1, vec, 1)
			})
		})
	}
}

// typedNonblocking is one side's turn of a nonblocking typed ping-pong:
// rank 0 sends then receives, rank 1 the reverse, each request waited for
// at once.
func typedNonblocking(ctx context.Context, t *Transport, peer int, buf []byte, vec *datatype.Type) error {
	for i := 0; i < 2; i++ {
		var r *Request
		var err error
		if (i == 0) == (t.Rank() == 0) {
			r, err = t.IsendTyped(peer, 1, buf, vec, 1)
		} else {
			r, err = t.IrecvTyped(peer, 1, buf, vec, 1)
		}
		if err != nil {
			return err
		}
		if _, err := r.Wait(ctx); err != nil {
			return err
		}
	}
	return nil
}

// pingPong runs b.N round trips between two in-process ranks: rank 0 calls
// there (send, then receive the reply), rank 1 calls back on a goroutine.
func pingPong(b *testing.B, there, back func(ctx context.Context, t *Transport) error) {
	ctx := context.Background()
	ts, stop, err := StartLocal(ctx, 2, Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer stop()
	done := make(chan error, 1)
	go func() {
		for i := 0; i < b.N; i++ {
			if err := back(ctx, ts[1]); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := there(ctx, ts[0]); err != nil {
			b.Fatal(err)
		}
	}
	if err := <-done; err != nil {
		b.Fatal(err)
	}
}
