package transport

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"
)

// cmaJob2 is a local two-rank job whose ranks use CMA for messages of at
// least 1 KiB (ranks of one process share the host, so they take part).
func cmaJob2(t *testing.T, mode ProgressMode) []*Transport {
	t.Helper()
	t.Setenv("TROUPE_CMA_THRESHOLD", "1024")
	ts := localJob(t, 2, mode)
	if !ts[0].CMAStats().Enabled || !ts[1].CMAStats().Enabled {
		t.Skip("CMA is not available on this machine (process_vm_readv refused)")
	}
	return ts
}

// Ping-pong of CMA messages in both directions, many times: every message
// arrives whole and every send completes (the acknowledgement path).
func TestCMAPingPong(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := cmaJob2(t, mode)
		ctx := testCtx(t)
		const n, rounds = 256 << 10, 300
		var wg sync.WaitGroup
		errs := make([]error, 2)
		for me := 0; me < 2; me++ {
			wg.Add(1)
			go func(me int) {
				defer wg.Done()
				buf := make([]byte, n)
				for i := 0; i < rounds; i++ {
					want := pattern(n, i)
					if (i%2 == 0) == (me == 0) {
						if err := ts[me].Send(ctx, 1-me, 3, want); err != nil {
							errs[me] = err
							return
						}
						continue
					}
					st, err := ts[me].Recv(ctx, 1-me, 3, buf)
					if err != nil {
						errs[me] = err
						return
					}
					if st.Size != n || !bytes.Equal(buf, want) {
						errs[me] = context.Canceled
						t.Errorf("rank %d round %d: status %+v, data equal %v", me, i, st, bytes.Equal(buf, want))
						return
					}
				}
			}(me)
		}
		wg.Wait()
		for me, err := range errs {
			if err != nil {
				t.Fatalf("rank %d: %v", me, err)
			}
		}
		s0, s1 := ts[0].CMAStats(), ts[1].CMAStats()
		if s0.Sent != rounds/2 || s1.Received != rounds/2 || s1.Sent != rounds/2 || s0.Received != rounds/2 {
			t.Fatalf("CMA counts: rank 0 %+v, rank 1 %+v; want %d each way", s0, s1, rounds/2)
		}
	})
}

// A window of receives into one shared buffer (as bandwidth benchmarks
// do): every descriptor must be read from its own completion, not from the
// buffer a later descriptor has already overwritten, so every send is
// acknowledged exactly once.
func TestCMASharedReceiveBuffer(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := cmaJob2(t, mode)
		ctx := testCtx(t)
		const n, window = 64 << 10, 32
		want := pattern(n, 5)
		shared := make([]byte, n)
		var recvs, sends []*Request
		for i := 0; i < window; i++ {
			r, err := ts[1].Irecv(0, 4, shared)
			if err != nil {
				t.Fatal(err)
			}
			recvs = append(recvs, r)
		}
		for i := 0; i < window; i++ {
			s, err := ts[0].Isend(1, 4, want)
			if err != nil {
				t.Fatal(err)
			}
			sends = append(sends, s)
		}
		waitRequests(t, ctx, "receive", recvs, n)
		waitRequests(t, ctx, "send", sends, -1)
		if !bytes.Equal(shared, want) {
			t.Fatal("shared buffer does not hold the message")
		}
		if s := ts[0].CMAStats(); s.Sent != window {
			t.Fatalf("rank 0 sent %d messages by CMA, want %d", s.Sent, window)
		}
	})
}

// waitRequests waits for every request; receives (size >= 0) must report size.
func waitRequests(t *testing.T, ctx context.Context, what string, rs []*Request, size int) {
	t.Helper()
	for i, r := range rs {
		st, err := r.Wait(ctx)
		if err != nil || (size >= 0 && st.Size != size) {
			t.Fatalf("%s %d: %+v %v", what, i, st, err)
		}
	}
}

// Receives posted one after another into one buffer while the messages
// are already there: the read of message k (by the progress goroutine,
// outside the worker lock) overlaps UCX landing descriptor k+1 in the same
// buffer. Every receive must complete with the message's size; a
// descriptor clobbered by a read would fail with ErrProtocol.
func TestCMASharedBufferLateReceives(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := cmaJob2(t, mode)
		ctx := testCtx(t)
		const n, window, rounds = 256 << 10, 16, 8
		want := pattern(n, 9)
		shared := make([]byte, n)
		for round := 0; round < rounds; round++ {
			var sends []*Request
			for i := 0; i < window; i++ {
				s, err := ts[0].Isend(1, 6, want)
				if err != nil {
					t.Fatal(err)
				}
				sends = append(sends, s)
			}
			// Wait until the first descriptor is there, so that the
			// receives below match messages that already arrived.
			if _, err := ts[1].Probe(ctx, 0, 6); err != nil {
				t.Fatal(err)
			}
			var recvs []*Request
			for i := 0; i < window; i++ {
				r, err := ts[1].Irecv(0, 6, shared)
				if err != nil {
					t.Fatal(err)
				}
				recvs = append(recvs, r)
			}
			waitRequests(t, ctx, fmt.Sprintf("round %d receive", round), recvs, n)
			waitRequests(t, ctx, fmt.Sprintf("round %d send", round), sends, -1)
		}
		if !bytes.Equal(shared, want) {
			t.Fatal("shared buffer does not hold the message")
		}
	})
}

// Large active messages go by CMA too: RecvData reads the sender's memory
// (and completes at once), a message its handler drops is acknowledged all
// the same, and both senders complete.
func TestCMAActiveMessages(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := cmaJob2(t, mode)
		ctx := testCtx(t)
		const n = 200 << 10
		got := make(chan []byte, 2)
		errc := make(chan error, 2)
		if err := ts[1].SetAMHandler(9, func(m *AMMessage) {
			if string(m.Header) == "drop" {
				got <- nil
				return // not kept: released, which acknowledges
			}
			dst := make([]byte, m.Size)
			r, err := m.RecvData(dst)
			if err != nil {
				errc <- err
				return
			}
			if done, err := r.Finished(); !done || err != nil {
				errc <- fmt.Errorf("RecvData of a CMA message: finished %v, %v", done, err)
				return
			}
			got <- dst
		}); err != nil {
			t.Fatal(err)
		}
		want := pattern(n, 9)
		s1, err := ts[0].SendAM(1, 9, []byte("keep"), want, AMAuto)
		if err != nil {
			t.Fatal(err)
		}
		s2, err := ts[0].SendAM(1, 9, []byte("drop"), want, AMAuto)
		if err != nil {
			t.Fatal(err)
		}
		for i, s := range []*Request{s1, s2} {
			if _, err := s.Wait(ctx); err != nil {
				t.Fatalf("send %d: %v", i, err)
			}
		}
		for i := 0; i < 2; i++ {
			select {
			case b := <-got:
				if b != nil && !bytes.Equal(b, want) {
					t.Fatal("active message data differs")
				}
			case err := <-errc:
				t.Fatal(err)
			case <-ctx.Done():
				t.Fatal(ctx.Err())
			}
		}
		if s := ts[0].CMAStats(); s.Sent != 2 {
			t.Fatalf("rank 0 sent %d active messages by CMA, want 2", s.Sent)
		}
		if s := ts[1].CMAStats(); s.Received != 1 {
			t.Fatalf("rank 1 read %d active messages by CMA, want 1", s.Received)
		}
	})
}

// A receive whose descriptor has arrived can no longer be cancelled: a
// context that ends then does not touch the freed UCX request, and the
// receive still completes with the data.
func TestCMAReceiveOutlivesItsContext(t *testing.T) {
	ts := cmaJob2(t, ProgressDirect)
	ctx := testCtx(t)
	const n = 512 << 10
	want := pattern(n, 11)
	got := make([]byte, n)
	for i := 0; i < 50; i++ {
		r, err := ts[1].Irecv(0, 6, got)
		if err != nil {
			t.Fatal(err)
		}
		s, err := ts[0].Isend(1, 6, want)
		if err != nil {
			t.Fatal(err)
		}
		// An already ended context: Wait cancels the receive if it can.
		dead, cancel := context.WithCancel(ctx)
		cancel()
		st, err := r.Wait(dead)
		switch {
		case err == nil:
			if st.Size != n || !bytes.Equal(got, want) {
				t.Fatalf("round %d: status %+v, data equal %v", i, st, bytes.Equal(got, want))
			}
		case errors.Is(err, context.Canceled):
			// Cancelled before the descriptor arrived: the message is
			// still there for the next receive.
			if _, err := ts[1].Recv(ctx, 0, 6, got); err != nil {
				t.Fatalf("round %d: receive after a cancel: %v", i, err)
			}
		default:
			t.Fatalf("round %d: %v", i, err)
		}
		if _, err := s.Wait(ctx); err != nil {
			t.Fatalf("round %d: send: %v", i, err)
		}
	}
}

// A receive posted while Iprobe is still receiving the descriptor it took
// out of UCX is served by that probe (the message is no longer in UCX's
// queue for the receive to match).
func TestCMAReceiveDuringProbe(t *testing.T) {
	ts := cmaJob2(t, ProgressDirect)
	ctx := testCtx(t)
	const n = 128 << 10
	want := pattern(n, 3)
	attached := 0
	for i := 0; i < 100; i++ {
		s, err := ts[0].Isend(1, 8, want)
		if err != nil {
			t.Fatal(err)
		}
		got := make([]byte, n)
		var r *Request
		for r == nil {
			_, ok, err := ts[1].Iprobe(0, 8)
			if err != nil {
				t.Fatal(err)
			}
			ts[1].mu.Lock()
			inFlight := len(ts[1].cma.probing) > 0
			ts[1].mu.Unlock()
			if ok || inFlight {
				if inFlight {
					attached++
				}
				if r, err = ts[1].Irecv(0, 8, got); err != nil {
					t.Fatal(err)
				}
			}
		}
		if st, err := r.Wait(ctx); err != nil || st.Size != n || !bytes.Equal(got, want) {
			t.Fatalf("round %d: %+v %v, data equal %v", i, st, err, bytes.Equal(got, want))
		}
		if _, err := s.Wait(ctx); err != nil {
			t.Fatalf("round %d: send: %v", i, err)
		}
	}
	t.Logf("%d of 100 receives were posted while the probe was receiving the descriptor", attached)
}

// AMPull: an active message between PullMin and the CMA threshold goes by
// UCX with AMAuto and by CMA with AMPull; one below PullMin stays eager
// either way; the data arrives intact on both paths.
func TestCMAPullActiveMessages(t *testing.T) {
	t.Setenv("TROUPE_CMA_THRESHOLD", "65536")
	ts := localJob(t, 2, ProgressDirect)
	if !ts[0].CMAStats().Enabled || !ts[1].CMAStats().Enabled {
		t.Skip("CMA is not available on this machine (process_vm_readv refused)")
	}
	ctx := testCtx(t)
	if ts[0].cma.thresh <= PullMin {
		t.Fatalf("CMA threshold %d leaves no room above PullMin %d", ts[0].cma.thresh, PullMin)
	}
	got := make(chan []byte, 1)
	errc := make(chan error, 1)
	if err := ts[1].SetAMHandler(10, func(m *AMMessage) {
		dst := make([]byte, m.Size)
		r, err := m.RecvData(dst)
		if err != nil {
			errc <- err
			return
		}
		go func() {
			if _, err := r.Wait(ctx); err != nil {
				errc <- err
				return
			}
			got <- dst
		}()
	}); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		size    int
		mode    uint32
		viaCMA  bool
		comment string
	}{
		{PullMin + 1000, AMAuto, false, "below the CMA threshold, no pull"},
		{PullMin + 1000, AMAuto | AMPull, true, "pull"},
		{PullMin - 1000, AMAuto | AMPull, false, "pull, below PullMin"},
		{ts[0].cma.thresh - 1, AMRndv | AMPull, true, "pull with forced rendezvous"},
	} {
		before := ts[0].CMAStats().Sent
		want := pattern(c.size, c.size%251)
		s, err := ts[0].SendAM(1, 10, []byte("h"), want, c.mode)
		if err != nil {
			t.Fatalf("%s: %v", c.comment, err)
		}
		select {
		case b := <-got:
			if !bytes.Equal(b, want) {
				t.Fatalf("%s: data differs", c.comment)
			}
		case err := <-errc:
			t.Fatalf("%s: %v", c.comment, err)
		case <-ctx.Done():
			t.Fatalf("%s: %v", c.comment, ctx.Err())
		}
		if _, err := s.Wait(ctx); err != nil {
			t.Fatalf("%s: send: %v", c.comment, err)
		}
		if n := ts[0].CMAStats().Sent - before; (n == 1) != c.viaCMA || n > 1 {
			t.Fatalf("%s: %d bytes sent by CMA %d times, want via CMA %v", c.comment, c.size, n, c.viaCMA)
		}
	}
}

// UCX_TLS values that allow shared memory, by alias or by naming one of
// UCX's shared-memory transports, allow CMA; ones that leave it out (TCP
// only, or excluding shared memory) do not.
func TestTLSAllowsCMA(t *testing.T) {
	for v, want := range map[string]bool{
		"": true, "all": true, "self,sm": true, "shm": true, "self,posix": true,
		"sysv,tcp": true, "cma": true, "self, xpmem": true, "knem": true,
		"self,tcp": false, "tcp": false, "^sm": false, "^posix": false, "^tcp": true, "^all": false,
	} {
		if got := tlsAllowsCMA(v); got != want {
			t.Errorf("tlsAllowsCMA(%q) = %v, want %v", v, got, want)
		}
	}
}

// TestCMADoneOfArrivedMessage: a receive posted (direct mode, engine off)
// for a same-host message whose descriptor is already here queues its read
// for the next progress call. A caller that then selects on Done makes no
// such call, so Done wakes the progress goroutine; before, the read waited
// for that goroutine's sleep on the event fd to time out (70-100 ms a
// message). The test stretches that sleep, and UCX's keepalive (whose
// traffic would end it too), to ten minutes, so that only the wake-up can
// complete the receive.
func TestCMADoneOfArrivedMessage(t *testing.T) {
	old := idleWaitMax.Swap(int64(10 * time.Minute))
	t.Cleanup(func() { idleWaitMax.Store(old) })
	t.Setenv("TROUPE_CMA_THRESHOLD", "1024")
	ts := localJobWith(t, 2, Options{Progress: ProgressDirect, KeepAlive: 10 * time.Minute})
	if !ts[0].CMAStats().Enabled {
		t.Skip("CMA is not available on this machine (process_vm_readv refused)")
	}
	ctx := testCtx(t)
	const n = 64 << 10
	for i := range 3 {
		want := pattern(n, i)
		sr, err := ts[0].Isend(1, 4, want)
		if err != nil {
			t.Fatal(err)
		}
		for { // the descriptor is here once a probe sees it (and holds it)
			if _, ok, err := ts[1].Iprobe(0, 4); err != nil {
				t.Fatal(err)
			} else if ok {
				break
			}
		}
		for !ts[1].sleeping.Load() { // rank 1's progress goroutine asleep
			runtime.Gosched()
		}
		buf := make([]byte, n)
		r, err := ts[1].Irecv(0, 4, buf)
		if err != nil {
			t.Fatal(err)
		}
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		select {
		case <-r.Done():
		case <-wctx.Done():
			cancel()
			t.Fatalf("message %d: Done of a receive whose message had arrived never closed", i)
		}
		cancel()
		if _, err := r.Wait(ctx); err != nil || !bytes.Equal(buf, want) {
			t.Fatalf("message %d: %v, bytes equal %v", i, err, bytes.Equal(buf, want))
		}
		if _, err := sr.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if ts[1].CMAStats().Received < 3 {
		t.Fatalf("the messages did not travel by CMA: %+v", ts[1].CMAStats())
	}
}
