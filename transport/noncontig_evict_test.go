package transport

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"testing"

	"github.com/troupe-hpc/troupe/datatype"
)

// Layouts are evicted (MaxLayouts 2) while typed receives are being posted
// on other goroutines. Evicting released the layout's registration under
// the worker lock while holding nc.mu, and posting a receive counts its RTS
// receive under nc.mu while holding the worker lock: both ranks froze for
// good (in 1 of 2 to 30 runs). Every transfer must complete with the right
// bytes.
func TestLayoutEvictionWhilePostingNoDeadlock(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	for _, tr := range ts {
		if err := tr.SetNoncontigOptions(NoncontigOptions{MaxLayouts: 2, KeyPool: 4}); err != nil {
			t.Fatal(err)
		}
	}
	ctx := testCtx(t)
	vec, err := datatype.Vector(64, 128, 256, datatype.Float64) // 64 blocks of 1 KiB, stride 2 KiB
	if err != nil {
		t.Fatal(err)
	}
	span := int(vec.Extent())
	const workers, rounds = 4, 100
	errs := make(chan error, workers)
	for g := range workers {
		go func() {
			o := TypedOptions{Scheme: datatype.SchemeAuto}
			if g%2 == 0 {
				o.Scheme = datatype.SchemeZCopy
			}
			for i := range rounds {
				src := pattern(span, g*rounds+i)
				dst := bytes.Repeat([]byte{0xee}, span)
				rr, err := ts[1].IrecvTypedWith(0, 20+g, dst, vec, 1, o)
				if err == nil {
					err = ts[0].SendTypedWith(ctx, 1, 20+g, src, vec, 1, o)
				}
				if err == nil {
					_, err = rr.Wait(ctx)
				}
				if err == nil {
					if d := vectorDiff(dst, src); d != "" {
						err = fmt.Errorf("wrong bytes: %s", d)
					}
				}
				if err != nil {
					errs <- fmt.Errorf("goroutine %d, transfer %d: %w", g, i, err)
					return
				}
			}
			errs <- nil
		}()
	}
	for range workers {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
}

// Deregister(buf), which docs/noncontig.md asks for before memory that
// typed zero-copy transfers used is freed, also drops the layouts over it:
// the next zero-copy receive into buf registers it anew and its sender
// gets fresh keys. The layout kept the invalidated registration, and the
// sender reused the old keys (with RDMA, into the old pages).
func TestDeregisterDropsLayouts(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	vec, err := datatype.Vector(64, 128, 256, datatype.Float64)
	if err != nil {
		t.Fatal(err)
	}
	span := int(vec.Extent())
	dst := make([]byte, span)
	transfer := func(seed int) {
		t.Helper()
		for i := range dst {
			dst[i] = 0xee // the gaps must stay untouched
		}
		zcopyTransfer(t, ctx, ts, 3, vec, dst, pattern(span, seed))
	}
	transfer(1)
	transfer(2) // the layout's registration and keys are cached now
	before := ts[1].NoncontigStats()
	if n := ts[1].Deregister(dst); n == 0 {
		t.Fatal("Deregister invalidated nothing")
	}
	transfer(3)
	after := ts[1].NoncontigStats()
	if after.Registrations != before.Registrations+1 || after.KeysOmitted != before.KeysOmitted {
		t.Fatalf("after Deregister: receiver registrations %d -> %d (want one more), keys omitted %d -> %d (want none: fresh keys)",
			before.Registrations, after.Registrations, before.KeysOmitted, after.KeysOmitted)
	}
}

// A receive with TypedOptions.Refuse takes the next message of its (source,
// tag) and refuses it, whatever scheme the sender proposes: the receive
// fails with ErrRefused, the sender's transfer fails, nothing lands, and
// the next transfer on that (source, tag) goes through (the sequence stays
// in step).
func TestTypedRecvRefuse(t *testing.T) {
	vec, err := datatype.Vector(64, 128, 256, datatype.Float64)
	if err != nil {
		t.Fatal(err)
	}
	span := int(vec.Extent())
	for _, scheme := range []datatype.Scheme{datatype.SchemePack, datatype.SchemeSGL, datatype.SchemeZCopy} {
		t.Run(scheme.String(), func(t *testing.T) {
			ts := localJob(t, 2, ProgressDirect)
			ctx := testCtx(t)
			o := TypedOptions{Scheme: scheme}
			refused, err := ts[1].IrecvTypedWith(0, 4, nil, datatype.Byte, 0, TypedOptions{Refuse: true})
			if err != nil {
				t.Fatal(err)
			}
			if err := ts[0].SendTypedWith(ctx, 1, 4, pattern(span, 1), vec, 1, o); err == nil {
				t.Fatal("the refused transfer's send succeeded")
			}
			if _, err := refused.Wait(ctx); !errors.Is(err, ErrRefused) {
				t.Fatalf("refusing receive: %v, want ErrRefused", err)
			}
			dst := bytes.Repeat([]byte{0xee}, span)
			rr, err := ts[1].IrecvTypedWith(0, 4, dst, vec, 1, o)
			if err != nil {
				t.Fatal(err)
			}
			src := pattern(span, 2)
			if err := ts[0].SendTypedWith(ctx, 1, 4, src, vec, 1, o); err != nil {
				t.Fatal(err)
			}
			if _, err := rr.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			if d := vectorDiff(dst, src); d != "" {
				t.Fatalf("the transfer after the refused one: %s", d)
			}
		})
	}
}

// A receiver that drops layouts (MaxLayouts 1: each new receive buffer
// evicts the last) tells its sender to forget their window sets: the
// sender's remote window cache and its unpacked remote keys stay at one
// set. Before, the sender kept every set it had ever been sent, and the
// remote key unpacked for it, for as long as the ranks ran.
func TestRetiredWindowSetsForgotten(t *testing.T) {
	for _, mode := range []ProgressMode{ProgressDirect, ProgressQueue} {
		t.Run(mode.String(), func(t *testing.T) { testRetiredWindowSetsForgotten(t, mode) })
	}
}

func testRetiredWindowSetsForgotten(t *testing.T, mode ProgressMode) {
	ts := localJob(t, 2, mode)
	if err := ts[1].SetNoncontigOptions(NoncontigOptions{MaxLayouts: 1, KeyPool: 4}); err != nil {
		t.Fatal(err)
	}
	ctx := testCtx(t)
	vec, err := datatype.Vector(64, 128, 256, datatype.Float64)
	if err != nil {
		t.Fatal(err)
	}
	span := int(vec.Extent())
	const transfers = 12
	bufs := make([][]byte, transfers) // all alive: a new layout each time
	for i := range bufs {
		bufs[i] = bytes.Repeat([]byte{0xee}, span)
		zcopyTransfer(t, ctx, ts, 5, vec, bufs[i], pattern(span, i))
	}
	recv := ts[1].NoncontigStats()
	if recv.Received.ZCopy != transfers || recv.KeyExchanges != transfers {
		t.Fatalf("receiver: %d zero-copy receives, %d key exchanges; want %d of each", recv.Received.ZCopy, recv.KeyExchanges, transfers)
	}
	if recv.WindowSetsRetired != transfers-1 {
		t.Fatalf("receiver retired %d window sets, want %d", recv.WindowSetsRetired, transfers-1)
	}
	nc, err := ts[0].noncontig()
	if err != nil {
		t.Fatal(err)
	}
	for ts[0].NoncontigStats().RemoteSetsForgotten < recv.WindowSetsRetired {
		select {
		case <-nc.retired:
		case <-ctx.Done():
			t.Fatalf("sender forgot %d of %d retired window sets", ts[0].NoncontigStats().RemoteSetsForgotten, recv.WindowSetsRetired)
		}
	}
	if s := ts[0].NoncontigStats(); s.RemoteSets != 1 {
		t.Fatalf("sender's remote window cache holds %d sets, want 1", s.RemoteSets)
	}
	ts[0].mu.Lock()
	rkeys := len(ts[0].peers[1].ncRkeys)
	ts[0].mu.Unlock()
	if rkeys != 1 {
		t.Fatalf("sender holds %d unpacked remote keys for rank 1, want 1", rkeys)
	}
}

// Retirements a corrupt or hostile peer could send (a short header, data
// that is not whole set ids, a rank that does not exist, ids of sets never
// sent) are dropped: the sender's cached window keys stay, and the next
// transfer still takes them from its remote window cache.
func TestHostileRetirementsDropped(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	vec, err := datatype.Vector(64, 128, 256, datatype.Float64)
	if err != nil {
		t.Fatal(err)
	}
	span := int(vec.Extent())
	dst := bytes.Repeat([]byte{0xee}, span)
	transfer := func(seed int) {
		t.Helper()
		zcopyTransfer(t, ctx, ts, 6, vec, dst, pattern(span, seed))
	}
	transfer(1)
	recvNC, err := ts[1].noncontig()
	if err != nil {
		t.Fatal(err)
	}
	sendNC, err := ts[0].noncontig()
	if err != nil {
		t.Fatal(err)
	}
	id := make([]byte, 8)
	recvNC.mu.Lock()
	for _, ws := range recvNC.wsets {
		binary.LittleEndian.PutUint64(id, ws.id)
	}
	recvNC.mu.Unlock()
	rank := func(r uint64) []byte { return binary.LittleEndian.AppendUint64(nil, r) }
	for _, m := range []struct{ hdr, data []byte }{
		{rank(1)[:7], id},            // short header
		{rank(1), id[:5]},            // not a whole id
		{rank(1), nil},               // no ids
		{rank(7), id},                // no such rank
		{rank(0), id},                // not the rank that sent the keys
		{rank(1), rank(1<<40 + 123)}, // a set never sent: the only one handled
	} {
		if _, err := ts[1].sendAM(0, amWinRetire, m.hdr, m.data, AMEager); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case <-sendNC.retired:
	case <-ctx.Done():
		t.Fatal("the well-formed retirement was not handled")
	}
	if s := ts[0].NoncontigStats(); s.RemoteSets != 1 || s.RemoteSetsForgotten != 0 {
		t.Fatalf("after hostile retirements the sender holds %d remote sets (want 1) and forgot %d (want 0)", s.RemoteSets, s.RemoteSetsForgotten)
	}
	before := ts[0].NoncontigStats().RemoteKeyHits
	transfer(2)
	if hits := ts[0].NoncontigStats().RemoteKeyHits - before; hits != 1 {
		t.Fatalf("the transfer after hostile retirements took its keys from the cache %d times, want 1", hits)
	}
}

// The transport's own active-message ids are refused to the API: a
// handler installed there would have taken CMA acknowledgements or window
// set retirements.
func TestReservedAMIDsRefused(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	for id := ReservedAMLow; id <= ReservedAMHigh; id++ {
		if err := ts[0].SetAMHandler(id, func(*AMMessage) {}); !errors.Is(err, ErrInvalid) {
			t.Fatalf("SetAMHandler(%#x): %v, want ErrInvalid", id, err)
		}
		if err := ts[0].SetInlineAMHandler(id, func(*AMMessage) {}); !errors.Is(err, ErrInvalid) {
			t.Fatalf("SetInlineAMHandler(%#x): %v, want ErrInvalid", id, err)
		}
		if _, err := ts[0].SendAM(1, id, nil, nil, AMEager); !errors.Is(err, ErrInvalid) {
			t.Fatalf("SendAM(%#x): %v, want ErrInvalid", id, err)
		}
		if err := ts[0].PostAM(1, id, nil, nil); !errors.Is(err, ErrInvalid) {
			t.Fatalf("PostAM(%#x): %v, want ErrInvalid", id, err)
		}
	}
	for _, id := range []uint16{ReservedAMLow - 1, ReservedAMHigh + 1} {
		if err := ts[0].SetAMHandler(id, func(*AMMessage) {}); err != nil {
			t.Fatalf("SetAMHandler(%#x) next to the reserved ids: %v", id, err)
		}
	}
}

// zcopyTransfer sends src from rank 0 to dst at rank 1 under tag, both
// laid out by vec (1 KiB blocks at a 2 KiB stride), zero-copy on both
// sides, and checks the blocks landed and the gaps kept their bytes.
func zcopyTransfer(t *testing.T, ctx context.Context, ts []*Transport, tag int, vec *datatype.Type, dst, src []byte) {
	t.Helper()
	o := TypedOptions{Scheme: datatype.SchemeZCopy}
	rr, err := ts[1].IrecvTypedWith(0, tag, dst, vec, 1, o)
	if err != nil {
		t.Fatal(err)
	}
	if err := ts[0].SendTypedWith(ctx, 1, tag, src, vec, 1, o); err != nil {
		t.Fatal(err)
	}
	if _, err := rr.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if d := vectorDiff(dst, src); d != "" {
		t.Fatal(d)
	}
}

// TestBouncePoolKeepsRegisteredBuffers: buffers made while the pool was
// empty never take a pooled (registered) buffer's place. One of PackChunk
// bytes given back first used to fill the pool, and the registered buffer
// given back after it was dropped with its registration still held.
func TestBouncePoolKeepsRegisteredBuffers(t *testing.T) {
	ts := localJob(t, 1, ProgressDirect)
	const chunk = 4096
	if err := ts[0].SetNoncontigOptions(NoncontigOptions{PackBuffers: 2, PackChunk: chunk}); err != nil {
		t.Fatal(err)
	}
	nc, err := ts[0].noncontig()
	if err != nil {
		t.Fatal(err)
	}
	a, b := nc.getBounce(chunk), nc.getBounce(chunk) // the pool's two
	c := nc.getBounce(chunk)                         // the pool is empty: a fresh one
	nc.putBounce(c)
	nc.putBounce(a)
	nc.putBounce(b)
	if len(nc.bounce) != 2 {
		t.Fatalf("the pool holds %d buffers, want 2", len(nc.bounce))
	}
	for range 2 {
		x := <-nc.bounce
		if &x[0] != &a[0] && &x[0] != &b[0] {
			t.Fatal("a buffer made outside the pool took a pooled one's place")
		}
	}
}
