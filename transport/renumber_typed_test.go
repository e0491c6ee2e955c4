package transport

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/datatype"
)

// TestTypedCancelledReceiveOwedMessageGoesToEarliestPending: typed
// receives prepared in order (their RTS receives in UCX) of which some are
// cancelled before any message arrives; the messages then go, in send
// order, to the receives still pending in the order they were placed, and
// the messages left over to the next typed receives posted, as MPI has it.
// Before typed receives were renumbered, the message a cancelled receive
// was owed went to the next receive posted instead (the pending ones got
// the later messages), which every case below detects.
func TestTypedCancelledReceiveOwedMessageGoesToEarliestPending(t *testing.T) {
	small, err := datatype.Contiguous(1, datatype.Byte)
	if err != nil {
		t.Fatal(err)
	}
	big, err := datatype.Vector(1024, 64, 128, datatype.Byte) // 64 KiB in 1024 blocks
	if err != nil {
		t.Fatal(err)
	}
	layouts := []struct {
		dt            *datatype.Type
		block, stride int
	}{{small, 1, 1}, {big, 64, 128}}
	cases := []struct {
		name      string
		prepared  int
		cancelled []int
	}{
		{"first of 3", 3, []int{0}},
		{"middle of 4", 4, []int{1}},
		{"two of 4", 4, []int{0, 2}},
		{"two of 4 newest first", 4, []int{2, 0}},
		{"last of 3", 3, []int{2}},
	}
	for _, mode := range []ProgressMode{ProgressDirect, ProgressQueue} {
		for _, l := range layouts {
			ts := localJob(t, 2, mode)
			for tag, tc := range cases {
				t.Run(fmt.Sprintf("%v/%dB/%s", mode, l.dt.Size(), tc.name), func(t *testing.T) {
					typedRenumberCase(t, ts, 50+tag, l.dt, l.block, l.stride, tc.prepared, tc.cancelled)
				})
			}
		}
	}
}

// typedRenumberCase prepares receives of dt (blocks of block bytes at a
// stride of stride) on rank 1, cancels those in cancelled, sends one
// message per prepared receive from rank 0 and checks who gets which.
func typedRenumberCase(t *testing.T, ts []*Transport, tag int, dt *datatype.Type, block, stride, prepared int, cancelled []int) {
	ctx := testCtx(t)
	span := int(dt.Extent())
	xs := make([]*TypedTransfer, prepared)
	bufs := make([][]byte, prepared)
	for i := range xs {
		bufs[i] = bytes.Repeat([]byte{0xee}, span)
		x, err := ts[1].PrepareRecvTyped(0, tag, bufs[i], dt, 1, TypedOptions{})
		if err != nil {
			t.Fatal(err)
		}
		xs[i] = x
	}
	ended, cancel := context.WithCancel(ctx)
	cancel()
	gone := map[int]bool{}
	for _, i := range cancelled {
		if _, err := xs[i].Run(ended); !errors.Is(err, context.Canceled) {
			t.Fatalf("prepared receive %d run with an ended context: %v", i, err)
		}
		gone[i] = true
	}
	// One message per prepared receive, all in flight at once.
	var sends []*Request
	for m := range prepared {
		sr, err := ts[0].IsendTyped(1, tag, pattern(span, m), dt, 1)
		if err != nil {
			t.Fatal(err)
		}
		sends = append(sends, sr)
	}
	next := 0 // the message the next receive is owed
	check := func(who string, got []byte) {
		t.Helper()
		for m := range prepared {
			if blockDiff(got, pattern(span, m), block, stride) == "" {
				if m != next {
					t.Fatalf("%s got message %d, want message %d", who, m, next)
				}
				next++
				return
			}
		}
		t.Fatalf("%s got none of the messages sent", who)
	}
	rctx, rcancel := context.WithTimeout(ctx, 5*time.Second)
	defer rcancel()
	for i, x := range xs {
		if gone[i] {
			continue
		}
		if _, err := x.Run(rctx); err != nil {
			t.Fatalf("prepared receive %d: %v", i, err)
		}
		check(fmt.Sprintf("prepared receive %d", i), bufs[i])
	}
	for range cancelled {
		got := bytes.Repeat([]byte{0xee}, span)
		if _, err := ts[1].RecvTyped(rctx, 0, tag, got, dt, 1); err != nil {
			t.Fatalf("typed receive after the prepared ones: %v", err)
		}
		check("a typed receive posted later", got)
	}
	for i, sr := range sends {
		if _, err := sr.Wait(ctx); err != nil {
			t.Fatalf("send %d: %v", i, err)
		}
	}
}

// TestTypedCancelledReceiveBeforeAnySource: with an any-source typed
// receive of the tag pending, whose masked RTS receive UCX holds behind
// the exact ones, a cancelled exact receive's message goes to the exact
// receive pending behind it, and the next message to the any-source
// receive, placed last: the masked receive is withdrawn while the exact
// one is renumbered and posted again behind it. Without the withdrawal
// the any-source receive took the first message.
func TestTypedCancelledReceiveBeforeAnySource(t *testing.T) {
	bytesType, err := datatype.Contiguous(1, datatype.Byte)
	if err != nil {
		t.Fatal(err)
	}
	for _, mode := range []ProgressMode{ProgressDirect, ProgressQueue} {
		t.Run(mode.String(), func(t *testing.T) {
			ts := localJob(t, 2, mode)
			ctx := testCtx(t)
			const tag = 60
			var xs []*TypedTransfer
			var bufs [][]byte
			for range 2 {
				b := make([]byte, 1)
				x, err := ts[1].PrepareRecvTyped(0, tag, b, bytesType, 1, TypedOptions{})
				if err != nil {
					t.Fatal(err)
				}
				xs, bufs = append(xs, x), append(bufs, b)
			}
			anyBuf := make([]byte, 1)
			ar, err := ts[1].IrecvTyped(AnySource, tag, anyBuf, bytesType, 1)
			if err != nil {
				t.Fatal(err)
			}
			waitMaskedRTS(ctx, t, ts[1], tag)
			ended, cancel := context.WithCancel(ctx)
			cancel()
			if _, err := xs[0].Run(ended); !errors.Is(err, context.Canceled) {
				t.Fatalf("prepared receive 0 run with an ended context: %v", err)
			}
			var sends []*Request
			for _, m := range []byte("ab") {
				sr, err := ts[0].IsendTyped(1, tag, []byte{m}, bytesType, 1)
				if err != nil {
					t.Fatal(err)
				}
				sends = append(sends, sr)
			}
			if _, err := ar.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			if _, err := xs[1].Run(ctx); err != nil {
				t.Fatal(err)
			}
			if bufs[1][0] != 'a' || anyBuf[0] != 'b' {
				t.Fatalf("prepared receive 1 got %q, any-source receive got %q; want a and b", bufs[1], anyBuf)
			}
			for i, sr := range sends {
				if _, err := sr.Wait(ctx); err != nil {
					t.Fatalf("send %d: %v", i, err)
				}
			}
		})
	}
}

// waitMaskedRTS waits until tr's any-source typed receive of tag has its
// masked RTS receive in UCX (it is posted from the receive's goroutine).
func waitMaskedRTS(ctx context.Context, t *testing.T, tr *Transport, tag int) {
	t.Helper()
	nc, err := tr.noncontig()
	if err != nil {
		t.Fatal(err)
	}
	for {
		nc.mu.Lock()
		posted := nc.anyRTS[tag] != nil
		nc.mu.Unlock()
		if posted {
			return
		}
		if ctx.Err() != nil {
			t.Fatal("the any-source typed receive's masked RTS receive was never posted")
		}
		runtime.Gosched()
	}
}
