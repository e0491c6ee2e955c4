package actor

import (
	"context"
	"os"
	"testing"
	"time"
)

func BenchmarkRequest(b *testing.B) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	o := Options{}
	if d, err := time.ParseDuration(os.Getenv("BSPIN")); err == nil {
		o.TransportOptions.Spin = d
	}
	rts, stop, err := StartLocal(ctx, 2, o)
	if err != nil {
		b.Fatal(err)
	}
	defer stop()
	pid, err := rts[1].Root().SpawnNamed(echoProps(rts[1]), "echo")
	if err != nil {
		b.Fatal(err)
	}
	remote := rts[0].PID(1, pid.Id)
	msg := &ping{N: 1}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := rts[0].Request(remote, msg, 5*time.Second); err != nil {
			b.Fatal(err)
		}
	}
}
