package transport

import (
	"context"
	"errors"
	"testing"

	"github.com/troupe-hpc/troupe/gpu"
)

// syncOrFail runs s.Synchronize and fails the test if it does not return
// before ctx ends.
func syncOrFail(ctx context.Context, t *testing.T, s *gpu.Stream) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- s.Synchronize() }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		t.Fatal("Synchronize did not return: the stream waits for ever on the queue's completion counter")
		return nil
	}
}

// TestQueuePeerLost: rank 0's queue has a receive from rank 1 and a send to
// it in flight, and a second batch started behind the first, when rank 1 is
// declared lost. The stream's wait ends (Synchronize returns), both
// operations report a *PeerLostError, the queue is in error from then on
// (Err, Start, Wait and Enqueue report it: faces used to go on iterating
// for ever with half its faces missing, since nothing but the discarded
// QueueOps knew), and the second batch is not issued.
func TestQueuePeerLost(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 3, mode)
		ctx := testCtx(t)
		sys, s, q := hostQueue(t, ts[0])
		// Connect to rank 1 first, so that the loss finds the operations
		// posted on its endpoint, as in a running job.
		ts[0].mu.Lock()
		_, err := ts[0].peerLocked(1, "test")
		ts[0].mu.Unlock()
		if err != nil {
			t.Fatal(err)
		}
		recvOp, err := q.EnqueueRecv(devBuf(t, sys, 512, nil), 1, 3)
		if err != nil {
			t.Fatal(err)
		}
		sendOp, err := q.EnqueueSend(devBuf(t, sys, 1<<20, pattern(1<<20, 1)), 1, 4)
		if err != nil {
			t.Fatal(err)
		}
		startWait(t, q)
		// A second batch, triggered by the stream once the first is over: a
		// send to a live rank that must not be issued once the queue failed.
		lateOp, err := q.EnqueueSend(devBuf(t, sys, 8, pattern(8, 2)), 2, 5)
		if err != nil {
			t.Fatal(err)
		}
		startWait(t, q)
		waitIssued(ctx, t, q)
		ts[0].mu.Lock()
		ts[0].peerFailed(1, "killed by the test")
		ts[0].mu.Unlock()

		if err := syncOrFail(ctx, t, s); err != nil {
			t.Fatalf("Synchronize: %v", err)
		}
		var lost *PeerLostError
		for name, op := range map[string]*QueueOp{"receive": recvOp, "send": sendOp, "second batch's send": lateOp} {
			select {
			case <-op.Done():
			default:
				t.Fatalf("%s not done after the stream passed the Wait covering it", name)
			}
			if _, err := op.Wait(ctx); !errors.As(err, &lost) || lost.Rank != 1 {
				t.Fatalf("%s: %v, want a *PeerLostError for rank 1", name, err)
			}
		}
		if err := q.Err(); !errors.As(err, &lost) || lost.Rank != 1 {
			t.Fatalf("Err: %v, want a *PeerLostError for rank 1", err)
		}
		if err := q.Start(); !errors.Is(err, ErrPeerLost) {
			t.Fatalf("Start on a queue in error: %v, want ErrPeerLost", err)
		}
		if err := q.Wait(); !errors.Is(err, ErrPeerLost) {
			t.Fatalf("Wait on a queue in error: %v, want ErrPeerLost", err)
		}
		if _, err := q.EnqueueRecv(devBuf(t, sys, 8, nil), 2, 6); !errors.Is(err, ErrPeerLost) {
			t.Fatalf("EnqueueRecv on a queue in error: %v, want ErrPeerLost", err)
		}
		// The second batch's send was not issued: rank 2 has nothing.
		if _, ok, err := ts[2].Iprobe(0, 5); err != nil || ok {
			t.Fatalf("rank 2 probe: found %v, %v: a send triggered after the failure was issued", ok, err)
		}
		if _, inUse, _ := q.pool.Stats(); inUse != 0 {
			t.Fatalf("%d staging buffers still in use", inUse)
		}
	})
}

// TestQueueTransportClosed: the queue's own transport closes with a
// receive in flight: the stream's wait ends and the receive and Err report
// ErrClosed.
func TestQueueTransportClosed(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 2, mode)
		ctx := testCtx(t)
		sys, s, q := hostQueue(t, ts[0])
		op, err := q.EnqueueRecv(devBuf(t, sys, 64, nil), 1, 3)
		if err != nil {
			t.Fatal(err)
		}
		startWait(t, q)
		waitIssued(ctx, t, q)
		if err := ts[0].Close(); err != nil {
			t.Fatal(err)
		}
		if err := syncOrFail(ctx, t, s); err != nil {
			t.Fatalf("Synchronize: %v", err)
		}
		if _, err := op.Wait(ctx); !errors.Is(err, ErrClosed) {
			t.Fatalf("receive: %v, want ErrClosed", err)
		}
		if err := q.Err(); !errors.Is(err, ErrClosed) {
			t.Fatalf("Err: %v, want ErrClosed", err)
		}
	})
}

// TestQueueStagingReused: batches of 12 staged operations (Faces' six faces
// each way) reuse the queue's pinned staging buffers. The pool kept only 8
// idle buffers per size class, so every batch freed 4 and allocated 4 new
// ones (mmap, or cuMemHostAlloc and a device-synchronising cuMemFreeHost on
// cuda) in the trigger agent's path: where goroutine dumps of a busy
// queue-mode Faces always found it.
func TestQueueStagingReused(t *testing.T) {
	ts := localJob(t, 1, ProgressDirect)
	ctx := testCtx(t)
	sys, s, q := hostQueue(t, ts[0])
	const faces = 6
	var send, recv [faces]gpu.Buffer
	for d := range send {
		send[d] = devBuf(t, sys, 512, pattern(512, d))
		recv[d] = devBuf(t, sys, 512, nil)
	}
	held0 := -1
	for iter := 0; iter < 3; iter++ {
		for d := 0; d < faces; d++ {
			if _, err := q.EnqueueRecv(recv[d], 0, d); err != nil {
				t.Fatal(err)
			}
		}
		for d := 0; d < faces; d++ {
			if _, err := q.EnqueueSend(send[d], 0, d); err != nil {
				t.Fatal(err)
			}
		}
		startWait(t, q)
		if err := syncOrFail(ctx, t, s); err != nil {
			t.Fatal(err)
		}
		if err := q.Err(); err != nil {
			t.Fatal(err)
		}
		held, inUse, idle := q.pool.Stats()
		if inUse != 0 || idle != 2*faces {
			t.Fatalf("batch %d: %d staging buffers in use, %d idle; want 0 and %d (all kept for the next batch)", iter, inUse, idle, 2*faces)
		}
		if held0 < 0 {
			held0 = held
		} else if held != held0 {
			t.Fatalf("batch %d: pool holds %d bytes, %d after the first batch", iter, held, held0)
		}
	}
}
