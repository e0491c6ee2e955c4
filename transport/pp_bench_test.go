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
		b.Run(c.name, func(b *testing.B) { pingPong8(b, c.src) })
	}
}

func pingPong8(b *testing.B, src1 int) {
	ctx := context.Background()
	ts, stop, err := StartLocal(ctx, 2, Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer stop()
	done := make(chan error, 1)
	buf1 := make([]byte, 8)
	go func() {
		for i := 0; i < b.N; i++ {
			if _, err := ts[1].Recv(ctx, src1, 1, buf1); err != nil {
				done <- err
				return
			}
			if err := ts[1].Send(ctx, 0, 1, buf1); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	buf := make([]byte, 8)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := ts[0].Send(ctx, 1, 1, buf); err != nil {
			b.Fatal(err)
		}
		if _, err := ts[0].Recv(ctx, 1, 1, buf); err != nil {
			b.Fatal(err)
		}
	}
	if err := <-done; err != nil {
		b.Fatal(err)
	}
}

// BenchmarkTypedPingPong measures a typed round trip (a vector of 64
// blocks of 64 B) between two in-process ranks, rank 1 receiving from rank
// 0 or with AnySource.
func BenchmarkTypedPingPong(b *testing.B) {
	for _, c := range []struct {
		name string
		src  int
	}{{"exact", 0}, {"any-source", AnySource}} {
		b.Run(c.name, func(b *testing.B) { typedPingPong(b, c.src) })
	}
}

func typedPingPong(b *testing.B, src1 int) {
	ctx := context.Background()
	ts, stop, err := StartLocal(ctx, 2, Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer stop()
	vec, err := datatype.Vector(64, 8, 16, datatype.Float64)
	if err != nil {
		b.Fatal(err)
	}
	done := make(chan error, 1)
	buf1 := make([]byte, vec.Extent())
	go func() {
		for i := 0; i < b.N; i++ {
			if _, err := ts[1].RecvTyped(ctx, src1, 1, buf1, vec, 1); err != nil {
				done <- err
				return
			}
			if err := ts[1].SendTyped(ctx, 0, 1, buf1, vec, 1); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	buf := make([]byte, vec.Extent())
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := ts[0].SendTyped(ctx, 1, 1, buf, vec, 1); err != nil {
			b.Fatal(err)
		}
		if _, err := ts[0].RecvTyped(ctx, 1, 1, buf, vec, 1); err != nil {
			b.Fatal(err)
		}
	}
	if err := <-done; err != nil {
		b.Fatal(err)
	}
}
