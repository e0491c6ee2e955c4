package transport

import (
	"errors"
	"sync"
	"testing"
)

// A matched probe takes the message: a plain receive posted afterwards for
// the same source and tag gets the next one, and the Message gets its own.
func TestImprobeTakesTheMessage(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 2, mode)
		ctx := testCtx(t)
		if m, ok, err := ts[1].Improbe(0, 3); m != nil || ok || err != nil {
			t.Fatalf("matched probe before any send: %v %v %v", m, ok, err)
		}
		for _, s := range []string{"first", "second!"} {
			if err := ts[0].Send(ctx, 1, 3, []byte(s)); err != nil {
				t.Fatal(err)
			}
		}
		m, err := ts[1].Mprobe(ctx, AnySource, 3)
		if err != nil {
			t.Fatal(err)
		}
		if st := m.Status(); st.Source != 0 || st.Tag != 3 || st.Size != 5 {
			t.Fatalf("matched probe status %+v, want rank 0 tag 3 size 5", st)
		}
		buf := make([]byte, 16)
		st, err := ts[1].Recv(ctx, 0, 3, buf)
		if err != nil || string(buf[:st.Size]) != "second!" {
			t.Fatalf("receive after the matched probe: %q %v, want \"second!\"", buf[:st.Size], err)
		}
		st, err = m.Recv(ctx, buf)
		if err != nil || string(buf[:st.Size]) != "first" || st.Source != 0 {
			t.Fatalf("the probed message: %+v %q %v, want \"first\"", st, buf[:st.Size], err)
		}
		if _, err := m.Irecv(buf); !errors.Is(err, ErrInvalid) {
			t.Fatalf("receiving a probed message twice: %v", err)
		}
	})
}

// Goroutines that each probe and receive with AnySource get distinct
// messages, every one intact: no goroutine's receive takes a message
// another one probed.
func TestMprobeConcurrentReceivers(t *testing.T) {
	ts := localJob(t, 3, ProgressQueue)
	ctx := testCtx(t)
	const each = 30
	var wg sync.WaitGroup
	got := make(chan [2]byte, 2*each)
	errs := make(chan error, 4)
	for g := 0; g < 2; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < each; i++ {
				m, err := ts[0].Mprobe(ctx, AnySource, 4)
				if err != nil {
					errs <- err
					return
				}
				var b [2]byte
				st, err := m.Recv(ctx, b[:])
				if err != nil || st.Size != 2 || int(b[0]) != st.Source {
					errs <- errors.Join(err, errors.New("probed message damaged or from the wrong rank"))
					return
				}
				got <- b
			}
		}()
	}
	for src := 1; src <= 2; src++ {
		go func(src int) {
			for i := 0; i < each; i++ {
				if err := ts[src].Send(ctx, 0, 4, []byte{byte(src), byte(i)}); err != nil {
					errs <- err
					return
				}
			}
		}(src)
	}
	wg.Wait()
	close(got)
	select {
	case err := <-errs:
		t.Fatal(err)
	default:
	}
	seen := map[[2]byte]bool{}
	for b := range got {
		if seen[b] {
			t.Fatalf("message %v received twice", b)
		}
		seen[b] = true
	}
	if len(seen) != 2*each {
		t.Fatalf("%d distinct messages, want %d", len(seen), 2*each)
	}
}

// A matched probe does not overtake an any-source receive posted before
// it: the receive gets the message, and the probe finds nothing more.
func TestImprobeAfterAnySourceReceive(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	wb := make([]byte, 8)
	w, err := ts[1].Irecv(AnySource, 5, wb)
	if err != nil {
		t.Fatal(err)
	}
	if m, ok, _ := ts[1].Improbe(AnySource, 5); ok {
		t.Fatalf("matched probe found %+v before anything was sent", m.Status())
	}
	if err := ts[0].Send(ctx, 1, 5, []byte("one")); err != nil {
		t.Fatal(err)
	}
	if m, ok, _ := ts[1].Improbe(0, 5); ok {
		t.Fatalf("matched probe took %+v, owed to the any-source receive posted before it", m.Status())
	}
	if _, got := recvString(t, ctx, w, wb); got != "one" {
		t.Fatalf("any-source receive posted first: %q", got)
	}
}

// In queue mode an Irecv only queues its start for the progress goroutine;
// a matched probe right after it on the same goroutine took the message
// the receive was owed (MPI: the receive posted first gets it). Probes now
// run the queued starts first.
func TestProbeAfterIrecvQueueMode(t *testing.T) {
	ts := localJob(t, 2, ProgressQueue)
	ctx := testCtx(t)
	for tag := range 20 {
		for _, s := range []string{"A", "BB"} {
			if err := ts[0].Send(ctx, 1, tag, []byte(s)); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := ts[1].Probe(ctx, 0, tag); err != nil { // "A" has arrived
			t.Fatal(err)
		}
		buf := make([]byte, 8)
		r, err := ts[1].Irecv(0, tag, buf)
		if err != nil {
			t.Fatal(err)
		}
		m, err := ts[1].Mprobe(ctx, 0, tag)
		if err != nil {
			t.Fatal(err)
		}
		st, err := r.Wait(ctx)
		if err != nil {
			t.Fatal(err)
		}
		mbuf := make([]byte, 8)
		if _, err := m.Recv(ctx, mbuf); err != nil {
			t.Fatal(err)
		}
		if string(buf[:st.Size]) != "A" || string(mbuf[:m.Status().Size]) != "BB" {
			t.Fatalf("tag %d: the Irecv posted first got %q, the Mprobe after it %q", tag, buf[:st.Size], mbuf[:m.Status().Size])
		}
	}
}

// TestNilMessage: Improbe's nil *Message (no message found) refuses Irecv
// and Recv with ErrInvalid; Recv dereferenced it and panicked.
func TestNilMessage(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	m, ok, err := ts[1].Improbe(0, 3)
	if err != nil || ok || m != nil {
		t.Fatalf("Improbe with nothing sent: %v %v %v", m, ok, err)
	}
	if _, err := m.Irecv(make([]byte, 4)); !errors.Is(err, ErrInvalid) {
		t.Fatalf("Irecv of a nil Message: %v", err)
	}
	if _, err := m.Recv(testCtx(t), make([]byte, 4)); !errors.Is(err, ErrInvalid) {
		t.Fatalf("Recv of a nil Message: %v", err)
	}
}
