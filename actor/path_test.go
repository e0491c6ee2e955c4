package actor

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"

	"github.com/troupe-hpc/troupe/transport"
)

// seqBlob is a numbered message with an out-of-band payload.
type seqBlob struct {
	N    int
	Data Payload
}

func init() { MustRegister[seqBlob]() }

// TestSendOrderAcrossPaths: messages small enough to be posted (copied,
// no transport request) and larger ones sent through requests (eager,
// rendezvous, same-host zero copy), in both body forms (payload as the
// data, body as the data), arrive in send order with their bytes, also
// when the sender reuses its buffers at once.
func TestSendOrderAcrossPaths(t *testing.T) {
	rts := startLocal(t, 2)
	sizes := []int{0, 64, transport.MaxPostAM - 200, transport.MaxPostAM + 1, 40 << 10, 300 << 10, 8}
	const n = 700
	type got struct {
		n    int
		data []byte
		text string
	}
	arrived := make(chan got, n)
	_, err := rts[1].Root().SpawnNamed(rts[1].PropsFromFunc(func(c pa.Context) {
		switch m := c.Message().(type) {
		case *seqBlob:
			arrived <- got{n: m.N, data: bytes.Clone(m.Data)}
			ReleasePayload(m.Data)
		case *ping:
			arrived <- got{n: m.N, text: m.Text}
		}
	}), "sink")
	if err != nil {
		t.Fatal(err)
	}
	sink := rts[0].PID(1, "sink")
	buf := make([]byte, 300<<10)
	want := func(i int) []byte {
		size := sizes[i%len(sizes)]
		b := make([]byte, size)
		for j := range b {
			b[j] = byte(i + j*7)
		}
		return b
	}
	for i := 0; i < n; i++ {
		w := want(i)
		var msg any
		if i%3 == 2 {
			msg = &ping{N: i, Text: string(w)} // the body is the data
		} else {
			data := Payload(buf[:len(w)])
			copy(data, w)
			msg = &seqBlob{N: i, Data: data}
		}
		if err := rts[0].Send(sink, msg); err != nil {
			t.Fatal(err)
		}
		if len(w) <= transport.MaxPostAM-200 {
			for j := range buf[:len(w)] {
				buf[j] = 0xee // posted: copied already
			}
		} else {
			buf = make([]byte, len(buf)) // in flight: hands off
		}
	}
	for i := 0; i < n; i++ {
		select {
		case g := <-arrived:
			if g.n != i {
				t.Fatalf("message %d arrived as number %d", i, g.n)
			}
			w := want(i)
			if i%3 == 2 {
				if g.text != string(w) {
					t.Fatalf("message %d: body differs", i)
				}
			} else if !bytes.Equal(g.data, w) {
				t.Fatalf("message %d (%d bytes): payload differs", i, len(w))
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("%d of %d messages arrived", i, n)
		}
	}
}

// TestSendFailsAtOnce: a message the transport refuses at once (here: the
// sending rank's transport is closed) fails its Send with that error, and
// the credits it took come back.
func TestSendFailsAtOnce(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ts, stopT, err := transport.StartLocal(ctx, 2, transport.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer stopT()
	rts := runtimesOn(ctx, t, ts)
	defer func() {
		done := make(chan struct{}, len(rts))
		for _, rt := range rts {
			go func() {
				sctx, c := context.WithTimeout(context.Background(), 10*time.Second)
				defer c()
				_ = rt.Shutdown(sctx) // rank 0's flush fails: its transport is closed
				done <- struct{}{}
			}()
		}
		for range rts {
			<-done
		}
	}()
	if err := ts[0].Close(); err != nil {
		t.Fatal(err)
	}
	for _, msg := range []any{&ping{N: 1}, &seqBlob{N: 2, Data: make(Payload, 64)}, &seqBlob{N: 3, Data: make(Payload, 100<<10)}} {
		err := rts[0].Send(rts[0].PID(1, "anyone"), msg)
		if !errors.Is(err, transport.ErrClosed) {
			t.Fatalf("Send %T on a closed transport: %v", msg, err)
		}
	}
	if avail := rts[0].out[1].avail; avail != rts[0].credits {
		t.Fatalf("%d of %d credits back after failed sends", avail, rts[0].credits)
	}
	_, err = rts[0].Request(rts[0].PID(1, "anyone"), &ping{N: 4}, time.Second)
	if !errors.Is(err, transport.ErrClosed) {
		t.Fatalf("Request on a closed transport: %v", err)
	}
}

// runtimesOn starts a runtime on each of ts (transports the test owns and
// closes itself), all at once, as the ranks of a job do.
func runtimesOn(ctx context.Context, t *testing.T, ts []*transport.Transport) []*Runtime {
	t.Helper()
	return runtimesWith(ctx, t, ts, func(int) Options { return Options{} })
}

// runtimesWith is runtimesOn with rank r's options opts(r) (its Transport
// is set to ts[r]).
func runtimesWith(ctx context.Context, t *testing.T, ts []*transport.Transport, opts func(r int) Options) []*Runtime {
	t.Helper()
	rts := make([]*Runtime, len(ts))
	errs := make(chan error, len(ts))
	for i := range ts {
		go func() {
			var err error
			o := opts(i)
			o.Transport = ts[i]
			rts[i], err = Init(ctx, o)
			errs <- err
		}()
	}
	for range ts {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	return rts
}
