package transport

import (
	"context"
	"testing"
)

// BenchmarkPingPong8 measures an 8-byte round trip between two in-process ranks.
func BenchmarkPingPong8(b *testing.B) {
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
			if _, err := ts[1].Recv(ctx, 0, 1, buf1); err != nil {
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
