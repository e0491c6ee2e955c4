package transport

import (
	"context"
	"errors"
	"testing"
)

// inHandler runs f in an active-message handler of ts[to] (id 30), which
// ts[from] sends it, and returns what f returned.
func inHandler[T any](ctx context.Context, t *testing.T, ts []*Transport, from, to int, f func() T) T {
	t.Helper()
	res := make(chan T, 1)
	if err := ts[to].SetAMHandler(30, func(m *AMMessage) { res <- f() }); err != nil {
		t.Fatal(err)
	}
	if err := ts[from].PostAM(to, 30, nil, nil); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-res:
		return r
	case <-ctx.Done():
		t.Fatal("the handler never returned")
	}
	var zero T
	return zero
}

// An active-message handler that waits for an operation (a blocking
// receive, a Wait on a request it started, a probe) is refused at once
// with ErrInHandler, in both progress modes: handlers run on the goroutine
// that progresses the worker, and before 2026-11-25 such a wait never
// ended (in queue mode not even when its context did, and Close then hung;
// found by review). Nothing is lost: the refused Recv posted nothing, so
// its message goes to a receive outside the handler, and the request the
// handler started completes when waited for elsewhere.
func TestHandlerWaitRefused(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 2, mode)
		ctx := testCtx(t)
		type result struct {
			recv, wait, probe error
			req               *Request
		}
		started := make([]byte, 4)
		r := inHandler(ctx, t, ts, 0, 1, func() (r result) {
			_, r.recv = ts[1].Recv(ctx, 0, 6, make([]byte, 4))
			if r.req, r.wait = ts[1].Irecv(0, 7, started); r.wait == nil {
				_, r.wait = r.req.Wait(ctx)
			}
			_, r.probe = ts[1].Probe(ctx, 0, 8)
			return r
		})
		for name, err := range map[string]error{"Recv": r.recv, "Wait": r.wait, "Probe": r.probe} {
			if !errors.Is(err, ErrInHandler) {
				t.Fatalf("%s in a handler: %v, want ErrInHandler", name, err)
			}
		}
		if err := ts[0].Send(ctx, 1, 6, []byte("six!")); err != nil {
			t.Fatal(err)
		}
		if err := ts[0].Send(ctx, 1, 7, []byte("7777")); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, 4)
		if _, err := ts[1].Recv(ctx, 0, 6, got); err != nil || string(got) != "six!" {
			t.Fatalf("receive outside the handler: %q %v", got, err)
		}
		if _, err := r.req.Wait(ctx); err != nil || string(started) != "7777" {
			t.Fatalf("the handler's receive, waited for outside it: %q %v", started, err)
		}
	})
}

// Close called by an active-message handler (a "shutdown" message) fails
// with ErrInHandler instead of hanging: it waits for the progress
// goroutine, which runs the handler (found by review, 2026-11-25). The
// transport stays usable, and closes from outside the handler.
func TestHandlerCloseRefused(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 2, mode)
		ctx := testCtx(t)
		if err := inHandler(ctx, t, ts, 0, 1, ts[1].Close); !errors.Is(err, ErrInHandler) {
			t.Fatalf("Close in a handler: %v, want ErrInHandler", err)
		}
		if err := ts[0].Send(ctx, 1, 3, []byte("ok")); err != nil {
			t.Fatal(err)
		}
		if _, err := ts[1].Recv(ctx, 0, 3, make([]byte, 2)); err != nil {
			t.Fatalf("receive after the refused Close: %v", err)
		}
		if err := ts[1].Close(); err != nil {
			t.Fatal(err)
		}
	})
}

// A handler that waits for a channel transfer or a stream-triggered
// queue's operation is refused with ErrInHandler too (their transfers
// progress on other goroutines that need the worker progressed); the
// transfers complete when waited for outside the handler.
func TestHandlerWaitChannelQueueRefused(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	sys, _, q := hostQueue(t, ts[1])
	ch0, err := ts[0].Channel(1, 1)
	if err != nil {
		t.Fatal(err)
	}
	ch1, err := ts[1].Channel(1, 0)
	if err != nil {
		t.Fatal(err)
	}
	chanBuf := make([]byte, 4)
	qBuf := devBuf(t, sys, 4, nil)
	type result struct {
		chanErr, queueErr error
		cr                *ChannelRequest
		op                *QueueOp
	}
	r := inHandler(ctx, t, ts, 0, 1, func() (r result) {
		if r.cr, r.chanErr = ch1.RecvBytes(chanBuf); r.chanErr == nil {
			r.chanErr = r.cr.Wait(ctx)
		}
		if r.op, r.queueErr = q.EnqueueRecv(qBuf, 0, 5); r.queueErr == nil {
			if r.queueErr = q.Start(); r.queueErr == nil {
				_, r.queueErr = r.op.Wait(ctx)
			}
		}
		return r
	})
	if !errors.Is(r.chanErr, ErrInHandler) || !errors.Is(r.queueErr, ErrInHandler) {
		t.Fatalf("in a handler: channel wait %v, queue op wait %v; want ErrInHandler", r.chanErr, r.queueErr)
	}
	cs, err := ch0.SendBytes([]byte("chan"))
	if err != nil {
		t.Fatal(err)
	}
	if err := ts[0].Send(ctx, 1, 5, []byte("queu")); err != nil {
		t.Fatal(err)
	}
	if err := cs.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if err := r.cr.Wait(ctx); err != nil || string(chanBuf) != "chan" {
		t.Fatalf("channel receive waited for outside the handler: %q %v", chanBuf, err)
	}
	if _, err := r.op.Wait(ctx); err != nil {
		t.Fatalf("queue receive waited for outside the handler: %v", err)
	}
}
