package transport

import (
	"bytes"
	"errors"
	"runtime"
	"testing"
)

// copyInFlight sends an unexpected message of n bytes from rank 0 to
// rank 1 (prefetched into the slot), waits until the sender is released,
// posts the receive with post, and waits until a goroutine has taken the
// copy out of the slot (OverlapTable().Copies back to 0) while the receive
// is still pending. It reports false when the copy finished before that
// could be observed.
func copyInFlight(t *testing.T, n int, post func(tr *Transport) *Request) ([]*Transport, *Request, bool) {
	ctx := testCtx(t)
	pol := &recordingPolicy{slotSize: int64(n)}
	ts := localJobWith(t, 2, Options{Overlap: pol})
	want := pattern(n, 3)
	sr, err := ts[0].Isend(1, 9, want)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sr.Wait(ctx); err != nil { // released by the prefetch
		t.Fatal(err)
	}
	if st := pol.Stats(); st.PoolInUse != 1 {
		t.Fatalf("message not prefetched (pool in use %d, table %+v)", st.PoolInUse, ts[1].OverlapTable())
	}
	rr := post(ts[1])
	for ts[1].OverlapTable().Copies != 0 {
		runtime.Gosched()
	}
	if rr.fin.Load() {
		return ts, rr, false
	}
	return ts, rr, true
}

// Close while a receive's copy out of a prefetch slot runs outside the
// lock (ovRunCopies): Close failed the receive (its Wait returned
// ErrClosed, the buffer the caller's again) while the copy went on writing
// into it, and with an IOV receive the copy read the IOV list complete had
// freed and crashed the process. Now the copy completes its receive: the
// receive gets its message, or at worst ErrClosed, and nothing is written
// after Wait returns.
func TestCloseDuringPrefetchCopy(t *testing.T) {
	const n = 32 << 20 // a copy long enough to close beside
	want := pattern(n, 3)
	for _, iov := range []bool{false, true} {
		name := "plain"
		if iov {
			name = "iov"
		}
		t.Run(name, func(t *testing.T) {
			for attempt := 0; attempt < 5; attempt++ {
				bufs := [][]byte{make([]byte, n)}
				if iov {
					const parts = 4096
					bufs = make([][]byte, parts)
					for i := range bufs {
						bufs[i] = make([]byte, n/parts)
					}
				}
				ts, rr, ok := copyInFlight(t, n, func(tr *Transport) *Request {
					r, err := tr.IrecvIOV(0, 9, bufs)
					if err != nil {
						t.Fatal(err)
					}
					return r
				})
				if !ok {
					t.Logf("attempt %d: the copy finished before Close", attempt)
					continue
				}
				closed := make(chan error, 1)
				go func() { closed <- ts[1].Close() }()
				st, err := rr.Wait(testCtx(t))
				switch {
				case err == nil:
					if got := bytes.Join(bufs, nil); st.Size != n || !bytes.Equal(got, want) {
						t.Fatalf("the receive completed with %d bytes that are not the message's", st.Size)
					}
				case !errors.Is(err, ErrClosed):
					t.Fatalf("Wait: %v, want the message or ErrClosed", err)
				}
				const mark = 0x5a // the buffer is the caller's again
				last := bufs[len(bufs)-1]
				last[len(last)-1] = mark
				if err := <-closed; err != nil {
					t.Fatal(err)
				}
				if last[len(last)-1] != mark {
					t.Fatal("the transport wrote into the receive's buffer after Wait returned")
				}
				return
			}
			t.Skip("the copy always finished before Close could run beside it (five attempts)")
		})
	}
}
