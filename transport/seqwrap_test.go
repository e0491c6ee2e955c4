package transport

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/troupe-hpc/troupe/datatype"
)

// setSeqNearWrap starts the (0 -> 1, tag) counters of both sides at
// userSeqMask-1, so that the next messages' sequence numbers wrap at
// 2^20 (about a million messages sent before, in effect).
func setSeqNearWrap(ts []*Transport, tag int) {
	start := uint32(userSeqMask - 1)
	ts[0].mu.Lock()
	ts[0].sendSeq[seqKey{1, tag}] = start
	ts[0].mu.Unlock()
	ts[1].mu.Lock()
	ts[1].recvSeq[seqKey{0, tag}] = &recvCounter{next: start, mask: userSeqMask}
	ts[1].mu.Unlock()
}

// Cancelled receives renumbered across the wrap of the 20-bit sequence
// counter: the receives still pending, and then fresh ones, get the
// messages in order, as far from the wrap as from it.
func TestRenumberAcrossSequenceWrap(t *testing.T) {
	cases := []struct {
		posted int
		cancel []int
	}{
		{4, []int{0}},
		{4, []int{1}},
		{4, []int{2, 0}},
		{4, []int{0, 1}},
		{4, []int{3, 1}},
		{4, []int{1, 2, 0}},
	}
	for _, mode := range []ProgressMode{ProgressDirect, ProgressQueue} {
		for _, engine := range []string{"off", "on"} {
			t.Run(fmt.Sprintf("%s/engine-%s", mode, engine), func(t *testing.T) {
				t.Setenv(OverlapEnv, engine)
				ts := localJob(t, 2, mode)
				for i, c := range cases {
					tag := 40 + i
					setSeqNearWrap(ts, tag)
					cancelledThenReceived(t, ts, tag, 8, c.posted, c.cancel)
				}
			})
		}
	}
}

// An any-source receive and a matched probe across the wrap: an exact
// receive holding the last number before the wrap is cancelled while a
// masked any-source receive waits behind the next one's.
func TestAnySourceAndImprobeAcrossSequenceWrap(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 2, mode)
		ctx := testCtx(t)
		const tag = 7
		setSeqNearWrap(ts, tag)
		bufs := [][]byte{make([]byte, 8), make([]byte, 8), make([]byte, 8), make([]byte, 8)}
		var rs []*Request
		for i, src := range []int{0, 0, 0, AnySource} {
			r, err := ts[1].Irecv(src, tag, bufs[i])
			if err != nil {
				t.Fatal(err)
			}
			rs = append(rs, r)
		}
		done, stop := context.WithCancel(ctx)
		stop()
		if _, err := rs[0].Wait(done); !errors.Is(err, context.Canceled) {
			t.Fatalf("cancelled receive: %v", err)
		}
		msgs := [][]byte{[]byte("m0"), []byte("m1"), []byte("m2"), []byte("m3"), []byte("m4")}
		for _, m := range msgs {
			if err := ts[0].Send(ctx, 1, tag, m); err != nil {
				t.Fatal(err)
			}
		}
		for i, r := range rs[1:] {
			st, err := r.Wait(ctx)
			if err != nil || !bytes.Equal(bufs[i+1][:st.Size], msgs[i]) {
				t.Fatalf("receive %d: %q %v, want %q", i+1, bufs[i+1][:st.Size], err, msgs[i])
			}
		}
		m, err := ts[1].Mprobe(ctx, AnySource, tag)
		if err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 8)
		st, err := m.Recv(ctx, buf)
		if err != nil || !bytes.Equal(buf[:st.Size], msgs[3]) {
			t.Fatalf("probed message: %q %v, want %q", buf[:st.Size], err, msgs[3])
		}
		st, err = ts[1].Recv(ctx, 0, tag, buf)
		if err != nil || !bytes.Equal(buf[:st.Size], msgs[4]) {
			t.Fatalf("last receive: %q %v, want %q", buf[:st.Size], err, msgs[4])
		}
	})
}

// Typed receives renumbered after cancellations across the wrap of the
// 19-bit typed sequence counter.
func TestTypedRenumberAcrossSequenceWrap(t *testing.T) {
	small, err := datatype.Contiguous(1, datatype.Byte)
	if err != nil {
		t.Fatal(err)
	}
	cases := [][2]any{{3, []int{0}}, {4, []int{1}}, {4, []int{0, 2}}, {4, []int{2, 0}}}
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 2, mode)
		for i, c := range cases {
			tag := 60 + i
			start := uint32(ncSeqMask - 1)
			nc0, err := ts[0].noncontig()
			if err != nil {
				t.Fatal(err)
			}
			nc1, err := ts[1].noncontig()
			if err != nil {
				t.Fatal(err)
			}
			k := seqKey{1, tag}
			nc0.mu.Lock()
			nc0.sendSeq[k] = start
			nc0.turnLocked(k).next = start
			nc0.mu.Unlock()
			nc1.mu.Lock()
			nc1.recvCounter(seqKey{0, tag}).next = start
			nc1.mu.Unlock()
			typedRenumberCase(t, ts, tag, small, 1, 1, c[0].(int), c[1].([]int))
		}
	})
}
