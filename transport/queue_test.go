package transport

import (
	"bytes"
	"context"
	"errors"
	"runtime"
	"testing"

	"github.com/troupe-hpc/troupe/gpu"
)

// TestQueueMatchesTaggedOps: rank 0's enqueued sends meet rank 1's ordinary
// receives and rank 1's ordinary sends meet rank 0's enqueued receives; the
// stream waits for the completion counter before it copies the received
// data out, and the host never blocks in Start or Wait.
func TestQueueMatchesTaggedOps(t *testing.T) {
	sys := hostSystem(t)
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	dev := sys.Devices()[0]
	s, err := dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	q, err := ts[0].NewQueue(s)
	if err != nil {
		t.Fatal(err)
	}
	sizes := []int{0, 8, 100000, 1 << 20}
	for iter := 0; iter < 3; iter++ {
		var recvs []gpu.Buffer
		var hostGot [][]byte
		var outs []gpu.Buffer
		var hostRecv []*Request
		for i, n := range sizes {
			src := devBuf(t, sys, n, nil)
			// "Kernel" producing the data: a stream-ordered copy, before the
			// Start that triggers the send.
			in, _ := sys.AllocHost(max(n, 1))
			inB, _ := in.Bytes()
			copy(inB, pattern(n, iter*10+i))
			in, _ = in.Slice(0, n)
			if err := gpu.CopyAsync(s, src, in); err != nil {
				t.Fatal(err)
			}
			if _, err := q.EnqueueSend(src, 1, 20+i); err != nil {
				t.Fatal(err)
			}
			got := make([]byte, n)
			r, err := ts[1].Irecv(0, 20+i, got)
			if err != nil {
				t.Fatal(err)
			}
			hostRecv = append(hostRecv, r)
			hostGot = append(hostGot, got)
			dst := devBuf(t, sys, n, nil)
			if _, err := q.EnqueueRecv(dst, 1, 40+i); err != nil {
				t.Fatal(err)
			}
			recvs = append(recvs, dst)
		}
		startWait(t, q)
		// After the Wait, the stream copies the received data out.
		for i, n := range sizes {
			out, _ := sys.AllocHost(max(n, 1))
			out, _ = out.Slice(0, n)
			if err := gpu.CopyAsync(s, out, recvs[i]); err != nil {
				t.Fatal(err)
			}
			outs = append(outs, out)
		}
		for i, n := range sizes {
			if err := ts[1].Send(ctx, 0, 40+i, pattern(n, 100+iter*10+i)); err != nil {
				t.Fatal(err)
			}
			st, err := hostRecv[i].Wait(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if st.Size != n {
				t.Fatalf("size %d, want %d", st.Size, n)
			}
			if !bytes.Equal(hostGot[i], pattern(n, iter*10+i)) {
				t.Fatalf("iter %d: enqueued send %d delivered other bytes", iter, i)
			}
		}
		if err := s.Synchronize(); err != nil {
			t.Fatal(err)
		}
		for i, n := range sizes {
			b, _ := outs[i].Bytes()
			if !bytes.Equal(b, pattern(n, 100+iter*10+i)) {
				t.Fatalf("iter %d: enqueued receive %d differs", iter, i)
			}
		}
	}
	if err := q.Free(); err != nil {
		t.Fatal(err)
	}
}

func TestQueueErrors(t *testing.T) {
	sys := hostSystem(t)
	ts := localJob(t, 2, ProgressDirect)
	s, _ := sys.Devices()[0].NewStream()
	q, err := ts[0].NewQueue(s)
	if err != nil {
		t.Fatal(err)
	}
	b := devBuf(t, sys, 8, nil)
	if _, err := q.EnqueueRecv(b, -1, 3); !errors.Is(err, ErrInvalid) {
		t.Fatalf("any-source receive: %v", err)
	}
	if _, err := q.EnqueueRecv(b, 1, -1); !errors.Is(err, ErrInvalid) {
		t.Fatalf("any-tag receive: %v", err)
	}
	if _, err := q.EnqueueSend(b, 5, 3); !errors.Is(err, ErrInvalid) {
		t.Fatalf("bad rank: %v", err)
	}
	if _, err := q.EnqueueSend(gpu.Buffer{}, 1, 3); !errors.Is(err, ErrInvalid) {
		t.Fatalf("zero buffer: %v", err)
	}
	// A started receive that never matches: Free withdraws it and releases
	// the stream's wait.
	op, err := q.EnqueueRecv(b, 1, 3)
	if err != nil {
		t.Fatal(err)
	}
	startWait(t, q)
	if err := q.Free(); err != nil {
		t.Fatal(err)
	}
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if _, err := op.Wait(testCtx(t)); err == nil {
		t.Fatal("withdrawn receive reported success")
	}
	if _, err := q.EnqueueSend(b, 1, 3); !errors.Is(err, ErrQueueFreed) {
		t.Fatalf("after Free: %v", err)
	}
}

// waitIssued waits (no sleeping) until q's agent has issued a batch.
func waitIssued(ctx context.Context, t *testing.T, q *Queue) {
	t.Helper()
	for {
		q.mu.Lock()
		n := len(q.issued)
		q.mu.Unlock()
		if n > 0 {
			return
		}
		if ctx.Err() != nil {
			t.Fatal("the queue's batch was never issued")
		}
		runtime.Gosched()
	}
}

// startWait starts what q has enqueued and enqueues the stream's wait for
// it.
func startWait(t *testing.T, q *Queue) {
	t.Helper()
	if err := q.Start(); err != nil {
		t.Fatal(err)
	}
	if err := q.Wait(); err != nil {
		t.Fatal(err)
	}
}

// hostQueue makes a queue of tr on a new stream of the host backend's
// first device; it is freed when the test ends, if not before.
func hostQueue(t *testing.T, tr *Transport) (*gpu.System, *gpu.Stream, *Queue) {
	t.Helper()
	sys := hostSystem(t)
	s, err := sys.Devices()[0].NewStream()
	if err != nil {
		t.Fatal(err)
	}
	q, err := tr.NewQueue(s)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = q.Free() })
	return sys, s, q
}

// Free with a receive and a send already issued, in either order: the
// receive is withdrawn and fails with ErrQueueFreed (an ordinary receive
// then gets the message meant for it); the send cannot be recalled, so it
// is delivered, its op reports success, and its staging buffer goes back
// to the pool. With the send first, the agent waits for it when Free comes:
// until 2026-12-07 the receive behind it stayed posted, reported freed, and
// took the ordinary receive's message.
func TestQueueFreeWithOpsInFlight(t *testing.T) {
	for _, sendFirst := range []bool{false, true} {
		t.Run(map[bool]string{false: "recv-first", true: "send-first"}[sendFirst], func(t *testing.T) {
			sys, ts, s, q := queueJob(t)
			ctx := testCtx(t)
			const n = 1 << 20
			var recvOp, sendOp *QueueOp
			for _, send := range []bool{sendFirst, !sendFirst} {
				var err error
				if send {
					sendOp, err = q.EnqueueSend(devBuf(t, sys, n, pattern(n, 9)), 1, 5) // rank 1 takes it only later
				} else {
					recvOp, err = q.EnqueueRecv(devBuf(t, sys, 8, nil), 1, 3)
				}
				if err != nil {
					t.Fatal(err)
				}
			}
			if err := q.Start(); err != nil {
				t.Fatal(err)
			}
			waitIssued(ctx, t, q)
			if err := q.Free(); err != nil {
				t.Fatal(err)
			}
			if err := s.Synchronize(); err != nil {
				t.Fatal(err)
			}
			if _, err := recvOp.Wait(ctx); !errors.Is(err, ErrQueueFreed) {
				t.Fatalf("receive withdrawn by Free: %v, want ErrQueueFreed", err)
			}
			if !recvOp.req.fin.Load() {
				t.Fatal("the freed queue's receive is still posted")
			}
			small := make([]byte, 8)
			r, err := ts[0].Irecv(1, 3, small)
			if err != nil {
				t.Fatal(err)
			}
			if err := ts[1].Send(ctx, 0, 3, pattern(8, 1)); err != nil {
				t.Fatal(err)
			}
			if _, err := r.Wait(ctx); err != nil || !bytes.Equal(small, pattern(8, 1)) {
				t.Fatalf("ordinary receive after Free: %v", err)
			}
			got := make([]byte, n)
			if _, err := ts[1].Recv(ctx, 0, 5, got); err != nil || !bytes.Equal(got, pattern(n, 9)) {
				t.Fatalf("the send issued before Free: %v", err)
			}
			if _, err := sendOp.Wait(ctx); err != nil {
				t.Fatalf("a send delivered after Free reported %v", err)
			}
			if _, inUse, _ := q.pool.Stats(); inUse != 0 {
				t.Fatalf("%d staging buffers still in use", inUse)
			}
		})
	}
}

// queueJob opens the host GPU system, then two ranks (so that the ranks
// close before the system frees the memory they may still move), and a
// queue of rank 0 on a new stream, freed when the test ends.
func queueJob(t *testing.T) (*gpu.System, []*Transport, *gpu.Stream, *Queue) {
	t.Helper()
	sys := hostSystem(t)
	ts := localJob(t, 2, ProgressDirect)
	s, err := sys.Devices()[0].NewStream()
	if err != nil {
		t.Fatal(err)
	}
	q, err := ts[0].NewQueue(s)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = q.Free() })
	return sys, ts, s, q
}

// TestQueueFreedPinnedBuffer: pinned host buffers freed while enqueued (the
// caller's bug) fail their operations with gpu.ErrFreed when the trigger
// comes, and the queue reports it; the transport moved bytes at the
// unmapped address before, and the process died (SIGSEGV). Nothing is
// sent, and nothing of rank 1's is received.
func TestQueueFreedPinnedBuffer(t *testing.T) {
	sys, ts, _, q := queueJob(t)
	ctx := testCtx(t)
	var ops []*QueueOp
	for i, send := range []bool{false, true} {
		buf, err := sys.AllocHost(1 << 20)
		if err != nil {
			t.Fatal(err)
		}
		var op *QueueOp
		if send {
			op, err = q.EnqueueSend(buf, 1, 7+i)
		} else {
			op, err = q.EnqueueRecv(buf, 1, 7+i)
		}
		if err != nil {
			t.Fatal(err)
		}
		if err := gpu.Free(buf); err != nil {
			t.Fatal(err)
		}
		ops = append(ops, op)
	}
	if err := q.Start(); err != nil {
		t.Fatal(err)
	}
	// The agent may have failed the batch already: Wait then reports the
	// queue's error (it still enqueues its stream wait).
	if err := q.Wait(); err != nil && !errors.Is(err, gpu.ErrFreed) {
		t.Fatal(err)
	}
	for i, op := range ops {
		if _, err := op.Wait(ctx); !errors.Is(err, gpu.ErrFreed) {
			t.Fatalf("operation %d on a freed pinned buffer: %v, want gpu.ErrFreed", i, err)
		}
	}
	if err := q.Err(); !errors.Is(err, gpu.ErrFreed) {
		t.Fatalf("queue error: %v, want gpu.ErrFreed", err)
	}
	r, err := ts[0].Irecv(1, 7, make([]byte, 8))
	if err != nil {
		t.Fatal(err)
	}
	if err := ts[1].Send(ctx, 0, 7, pattern(8, 1)); err != nil {
		t.Fatal(err)
	}
	if st, err := r.Wait(ctx); err != nil || st.Size != 8 {
		t.Fatalf("an ordinary receive of tag 7 after the failed one: %+v %v", st, err)
	}
	if _, ok, err := ts[1].Iprobe(0, 8); err != nil || ok {
		t.Fatalf("the freed send's message arrived (%v %v)", ok, err)
	}
}
