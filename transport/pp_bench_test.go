package transport

import (
	"context"
	"testing"
)

// BenchmarkPingPong8 measures an 8-byte round trip between two in-process
// ranks; in any-source, rank 1 receives with AnySource, so each of its
// receives waits in the software matcher until the message has arrived.
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
