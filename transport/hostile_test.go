package transport

import (
	"context"
	"encoding/binary"
	"errors"
	"testing"
	"time"
	"unsafe"

	"github.com/troupe-hpc/troupe/datatype"
)

// Wire data a corrupt or hostile peer could send, and what the receiver
// must do with it: a typed error for the receive it reaches, nothing
// dropped silently, no panic, and the rank goes on.

// hostileRTS sends a raw typed RTS from ts[0] to ts[1] under user tag tag
// and sequence number seq.
func hostileRTS(t *testing.T, ctx context.Context, ts []*Transport, tag int, seq uint32, h rts) {
	t.Helper()
	msg := make([]byte, rtsHdrLen)
	h.encode(msg)
	if _, err := ts[0].ncSend(1, ncRTSTag(KindTyped, 0, uint16(tag), seq), bufOf(msg), nil).Wait(ctx); err != nil {
		t.Fatal(err)
	}
}

// An RTS whose chunk size would make the receiver allocate exabytes (it
// panicked in makeslice) is refused as invalid.
func TestHostileRTSHugeChunk(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	dt, err := datatype.Contiguous(16, datatype.Float64)
	if err != nil {
		t.Fatal(err)
	}
	sig, _ := dt.SignatureHash(1)
	hostileRTS(t, ctx, ts, 5, 0, rts{proposal: datatype.SchemePack, xid: 1, bytes: 1 << 62, sig: sig, chunk: 1 << 62})
	if _, err := ts[1].RecvTyped(ctx, 0, 5, make([]byte, 128), dt, 1); !errors.Is(err, ErrInvalid) {
		t.Fatalf("typed receive of a hostile RTS: %v, want ErrInvalid", err)
	}
}

// Pack chunks that do not have the announced size fail the typed receive
// (once more than PackDepth of them failed, it indexed an empty queue and
// panicked), and every chunk is still taken off UCX's queue.
func TestHostilePackChunks(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	dt, err := datatype.Contiguous(1024, datatype.Float64) // 8 KiB
	if err != nil {
		t.Fatal(err)
	}
	sig, _ := dt.SignatureHash(1)
	const xid = 7
	hostileRTS(t, ctx, ts, 5, 0, rts{proposal: datatype.SchemePack, xid: xid, bytes: 8192, sig: sig, chunk: 1024})
	for k := range 8 { // eight chunks of twice the announced size
		ts[0].ncSend(1, ncXferTag(dirData, 0, xid, uint32(k)), bufOf(make([]byte, 2048)), nil)
	}
	if _, err := ts[1].RecvTyped(ctx, 0, 5, make([]byte, 8192), dt, 1); err == nil {
		t.Fatal("a typed receive of oversized pack chunks succeeded")
	}
	if _, ok, _ := ts[1].Iprobe(0, 0); ok {
		t.Fatal("something was left behind")
	}
}

// A typed receive cancelled before it matched gave sequence number 0 of
// (rank 0, tag 0) back to the plain API's counter, whatever its own peer
// and tag: two plain receives then both took number 0 and the second
// message was never matched.
func TestCancelledTypedRecvKeepsPlainOrder(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	dt, err := datatype.Contiguous(16, datatype.Float64)
	if err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithCancel(ctx)
	r, err := ts[1].IrecvTyped(0, 5, make([]byte, 128), dt, 1)
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	if _, err := r.Wait(short); !errors.Is(err, context.Canceled) {
		t.Fatalf("typed receive with no sender: %v, want cancelled", err)
	}
	for _, m := range []string{"a", "b"} {
		if err := ts[0].Send(ctx, 1, 0, []byte(m)); err != nil {
			t.Fatal(err)
		}
	}
	for _, want := range []string{"a", "b"} {
		buf := make([]byte, 1)
		if _, err := ts[1].Recv(ctx, 0, 0, buf); err != nil || string(buf) != want {
			t.Fatalf("plain receive after a cancelled typed one: %q %v, want %q", buf, err, want)
		}
	}
}

// Messages whose tag names a rank outside the job are dropped (counted in
// ForeignDropped) wherever an any-source receive meets them: waiting in
// UCX's queue before the receive, matched by a receive UCX already held
// (it goes back to waiting), or as a typed RTS; the receive then gets the
// next real message. Before, these panicked under the worker lock (a rank
// that could not even Close) or completed with Source 999 in a job of two.
func TestForeignSourceRank(t *testing.T) {
	const bogus = 999
	for _, engine := range []bool{false, true} {
		opts := Options{}
		if engine {
			opts.Overlap = &recordingPolicy{}
		}
		ts := localJobWith(t, 2, opts)
		ctx := testCtx(t)
		send := func(wire uint64, b []byte) {
			t.Helper()
			if _, err := ts[0].ncSend(1, wire, bufOf(b), nil).Wait(ctx); err != nil {
				t.Fatal(err)
			}
		}
		check := func(what string, st Status, got []byte, err error, want string, dropped uint64) {
			t.Helper()
			if err != nil || st.Source != 0 || string(got[:st.Size]) != want {
				t.Fatalf("engine %v: %s: %+v %q %v, want %q from rank 0", engine, what, st, got[:st.Size], err, want)
			}
			if n := ts[1].ForeignDropped(); n != dropped {
				t.Fatalf("engine %v: %s: %d foreign messages counted, want %d", engine, what, n, dropped)
			}
		}
		// Sent before the receive is posted.
		send(MakeUserTag(bogus, 5, 0), []byte("junk"))
		if err := ts[0].Send(ctx, 1, 5, []byte("real")); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 8)
		st, err := ts[1].Recv(ctx, AnySource, 5, buf)
		check("receive after", st, buf, err, "real", 1)
		// Sent after the receive is posted.
		r, err := ts[1].Irecv(AnySource, 6, buf)
		if err != nil {
			t.Fatal(err)
		}
		send(MakeUserTag(bogus, 6, 0), []byte("junk"))
		if err := ts[0].Send(ctx, 1, 6, []byte("real")); err != nil {
			t.Fatal(err)
		}
		st, err = r.Wait(ctx)
		check("receive before", st, buf, err, "real", 2)
		// A typed RTS, any source.
		dt, err := datatype.Contiguous(16, datatype.Float64)
		if err != nil {
			t.Fatal(err)
		}
		sig, _ := dt.SignatureHash(1)
		h := rts{proposal: datatype.SchemePack, flags: rtsInline, xid: 1, bytes: 128, sig: sig, chunk: 1024}
		msg := make([]byte, rtsHdrLen+128)
		h.encode(msg)
		send(ncRTSTag(KindTyped, bogus, 7, 0), msg)
		want := pattern(128, 7)
		sr, err := ts[0].IsendTyped(1, 7, want, dt, 1)
		if err != nil {
			t.Fatal(err)
		}
		got := make([]byte, 128)
		st, err = ts[1].RecvTyped(ctx, AnySource, 7, got, dt, 1)
		if err != nil || st.Source != 0 || string(got) != string(want) {
			t.Fatalf("engine %v: typed any-source receive past a foreign RTS: %+v %v", engine, st, err)
		}
		if _, err := sr.Wait(ctx); err != nil {
			t.Fatal(err)
		}
		if n := ts[1].ForeignDropped(); n != 3 {
			t.Fatalf("engine %v: %d foreign messages counted, want 3", engine, n)
		}
	}
}

// CMA descriptors: one naming a rank outside the job is dropped by an
// any-source receive; one announcing 2^63 bytes or more, or naming a
// validity word at 0 or at an address not 8-byte aligned, is a protocol
// error (its size came out negative); one whose word does not hold
// cmaValid is a withdrawn message, and one whose word cannot be read fails
// the receive; one with a valid word is read.
func TestHostileCMADescriptors(t *testing.T) {
	ts := cmaJob2(t, ProgressDirect)
	ctx := testCtx(t)
	valid, withdrawn := uint64(cmaValid), uint64(0)
	validAt := uint64(uintptr(unsafe.Pointer(&valid)))
	desc := func(addr, n, word uint64) []byte {
		d := make([]byte, cmaDescSize)
		encodeDesc(d, addr, n, word)
		return d
	}
	src := pattern(4096, 3)
	srcAt := uint64(uintptr(bytesPtr(src)))
	if _, err := ts[0].ncSend(1, MakeUserTag(999, 5, 0)|cmaBit, bufOf(desc(srcAt, 4096, validAt)), nil).Wait(ctx); err != nil {
		t.Fatal(err)
	}
	want := pattern(4096, 1)
	sr, err := ts[0].Isend(1, 5, want) // by CMA: done once received
	if err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 4096)
	if st, err := ts[1].Recv(ctx, AnySource, 5, got); err != nil || st.Source != 0 || string(got) != string(want) {
		t.Fatalf("any-source receive past a foreign descriptor: %+v %v", st, err)
	}
	if _, err := sr.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	for i, c := range []struct {
		name    string
		d       []byte
		wantErr error // nil: received whole; errAny: any error but ErrWithdrawn
	}{
		{"2^63 bytes", desc(4096, 1<<63, validAt), ErrProtocol},
		{"word at 0", desc(srcAt, 4096, 0), ErrProtocol},
		{"word not aligned", desc(srcAt, 4096, validAt+1), ErrProtocol},
		{"word cleared", desc(srcAt, 4096, uint64(uintptr(unsafe.Pointer(&withdrawn)))), ErrWithdrawn},
		{"word unreadable", desc(srcAt, 4096, 8), errAny},
		{"word valid", desc(srcAt, 4096, validAt), nil},
	} {
		tag := 10 + i
		if _, err := ts[0].ncSend(1, MakeUserTag(0, uint16(tag), 0)|cmaBit, bufOf(c.d), nil).Wait(ctx); err != nil {
			t.Fatal(err)
		}
		rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		clear(got)
		st, err := ts[1].Recv(rctx, 0, tag, got)
		cancel()
		switch {
		case c.wantErr == nil:
			if err != nil || st.Size != 4096 || string(got) != string(src) {
				t.Fatalf("descriptor with %s: %+v %v, want the message", c.name, st, err)
			}
		case c.wantErr == errAny:
			if err == nil || errors.Is(err, ErrWithdrawn) || errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("descriptor with %s: %+v %v, want a read error", c.name, st, err)
			}
		case !errors.Is(err, c.wantErr):
			t.Fatalf("descriptor with %s: %+v %v, want %v", c.name, st, err, c.wantErr)
		}
		t.Logf("%s: %v", c.name, err)
	}
}

// errAny stands for any error in a table of wanted errors.
var errAny = errors.New("any error")

// Descriptors round-trip through encodeDesc and decodeDesc.
func TestCMADescriptorWire(t *testing.T) {
	b := make([]byte, cmaDescSize)
	encodeDesc(b, 0x7f0012345678, 1<<20, 0x7f00aaaa0008)
	d, err := decodeDesc(b, 0, 5)
	if err != nil || d != (cmaDesc{addr: 0x7f0012345678, n: 1 << 20, word: 0x7f00aaaa0008}) {
		t.Fatalf("decoded %+v %v", d, err)
	}
	if _, err := decodeDesc(b[:cmaDescSize-1], 0, 5); !errors.Is(err, ErrProtocol) {
		t.Fatalf("short descriptor: %v", err)
	}
	b[0] ^= 1
	if _, err := decodeDesc(b, 0, 5); !errors.Is(err, ErrProtocol) {
		t.Fatalf("bad magic: %v", err)
	}
}

// A remote key whose bytes changed on the way (any byte flipped, cut
// short, or the packed rkey overwritten) is refused by UnmarshalBinary with
// ErrInvalid before it reaches UCX, which trusts packed rkeys entirely: a
// key of 0xff bytes crashed the process in ucp_ep_rkey_unpack. The intact
// key still works.
func TestRemoteKeyCorruptRefused(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	mem := make([]byte, 4096)
	reg, err := ts[1].Register(mem)
	if err != nil {
		t.Fatal(err)
	}
	defer reg.Release()
	wire, err := reg.Key().MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	var key RemoteKey
	for i := range wire {
		bad := append([]byte(nil), wire...)
		bad[i] ^= 0x5a
		if err := key.UnmarshalBinary(bad); !errors.Is(err, ErrInvalid) {
			t.Fatalf("byte %d of %d flipped: %v, want ErrInvalid", i, len(wire), err)
		}
	}
	for _, n := range []int{0, 8, 31, len(wire) - 1} {
		if err := key.UnmarshalBinary(wire[:n]); !errors.Is(err, ErrInvalid) {
			t.Fatalf("key cut to %d of %d bytes: %v, want ErrInvalid", n, len(wire), err)
		}
	}
	garbage := append([]byte(nil), wire...)
	for i := 24; i < len(garbage)-8; i++ {
		garbage[i] = 0xff
	}
	if err := key.UnmarshalBinary(garbage); !errors.Is(err, ErrInvalid) {
		t.Fatalf("packed rkey of 0xff bytes: %v, want ErrInvalid", err)
	}
	if err := key.UnmarshalBinary(wire); err != nil {
		t.Fatal(err)
	}
	if err := ts[0].Put(ctx, key, 0, []byte("intact")); err != nil {
		t.Fatal(err)
	}
	if err := ts[0].Flush(ctx, 1); err != nil || string(mem[:6]) != "intact" {
		t.Fatalf("put with the intact key: %q %v", mem[:6], err)
	}
}

// A receiver's window keys that arrive corrupt fail the zero-copy send that
// received them, and every other send waiting for the same keys (its CTS
// left them out, the receiver believing they had arrived), at once: they
// waited for ever (their context had been replaced, as a matched transfer
// runs to completion).
func TestHostileWindowKeysFailWaiters(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	vec, err := datatype.Vector(64, 128, 256, datatype.Float64)
	if err != nil {
		t.Fatal(err)
	}
	span := int(vec.Extent())
	o := TypedOptions{Scheme: datatype.SchemeZCopy}
	errs := make(chan error, 2)
	for i := range 2 {
		go func() { errs <- ts[0].SendTypedWith(ctx, 1, 8, pattern(span, i), vec, 1, o) }()
	}
	// Rank 1 plays a receiver that sends the keys of set 77 (corrupt) with
	// the first CTS and leaves them out of the second.
	const set = 77
	var xids []uint32
	for seq := range uint32(2) {
		hb := make([]byte, rtsHdrLen)
		if _, err := ts[1].ncRecv(0, ncRTSTag(KindTyped, 0, 8, seq), bufOf(hb), nil).Wait(ctx); err != nil {
			t.Fatal(err)
		}
		var h rts
		if err := h.decode(hb); err != nil {
			t.Fatal(err)
		}
		xids = append(xids, h.xid)
		m := cts{status: stOK, scheme: datatype.SchemeZCopy, nwin: 1, chunk: 64 << 10, setID: set, rbytes: int64(span)}
		blob := make([]byte, 24) // names set 77, and no registration key
		binary.LittleEndian.PutUint64(blob, set)
		if seq == 1 {
			m.flags, m.keysLen = ctsKeys, int64(len(blob))
		}
		msg := make([]byte, ctsLen)
		m.encode(msg)
		if _, err := ts[1].ncSend(0, ncXferTag(dirReply, 1, h.xid, idxCTS), bufOf(msg), nil).Wait(ctx); err != nil {
			t.Fatal(err)
		}
		if seq == 1 {
			if _, err := ts[1].ncSend(0, ncXferTag(dirReply, 1, h.xid, idxKeys), bufOf(blob), nil).Wait(ctx); err != nil {
				t.Fatal(err)
			}
		}
	}
	for range 2 {
		if err := <-errs; !errors.Is(err, ErrInvalid) {
			t.Fatalf("zero-copy send with corrupt window keys: %v, want ErrInvalid", err)
		}
	}
	// Each failed send still sends its completion message, marked failed:
	// a receiver waits for it (a real one waited for ever).
	for _, xid := range xids {
		fin := make([]byte, finLen)
		if _, err := ts[1].ncRecv(0, ncXferTag(dirData, 0, xid, idxFin), bufOf(fin), nil).Wait(ctx); err != nil {
			t.Fatalf("completion of failed transfer %d: %v", xid, err)
		}
		if fin[0] != finFailed {
			t.Fatalf("completion of failed transfer %d: % x, want it marked failed", xid, fin)
		}
	}
}

// A zero-copy receive whose sender reports that it could not write the
// windows (a failed completion) fails with ErrWithdrawn instead of
// reporting the untouched layout as received.
func TestZCopyFailedCompletion(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	vec, err := datatype.Vector(64, 128, 256, datatype.Float64)
	if err != nil {
		t.Fatal(err)
	}
	sig, _ := vec.SignatureHash(1)
	const xid = 9
	tm, err := vec.Typemap(1)
	if err != nil {
		t.Fatal(err)
	}
	st := datatype.ComputeStats(tm)
	hostileRTS(t, ctx, ts, 6, 0, rts{proposal: datatype.SchemeZCopy, xid: xid, bytes: vec.Size(), sig: sig,
		chunk: 128 << 10, minBlock: st.MinBlock, segments: st.Segments})
	got := make(chan error, 1)
	go func() {
		_, err := ts[1].RecvTypedWith(ctx, 0, 6, make([]byte, vec.Extent()), vec, 1, TypedOptions{Scheme: datatype.SchemeZCopy})
		got <- err
	}()
	reply := make([]byte, ctsLen)
	if _, err := ts[0].ncRecv(1, ncXferTag(dirReply, 1, xid, idxCTS), bufOf(reply), nil).Wait(ctx); err != nil {
		t.Fatal(err)
	}
	var m cts
	if err := m.decode(reply); err != nil || m.status != stOK || m.scheme != datatype.SchemeZCopy {
		t.Fatalf("CTS %+v (%v), want zero-copy", m, err)
	}
	if m.flags&ctsKeys != 0 {
		blob := make([]byte, m.keysLen)
		if _, err := ts[0].ncRecv(1, ncXferTag(dirReply, 1, xid, idxKeys), bufOf(blob), nil).Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
	fin := make([]byte, finLen)
	fin[0] = finFailed
	if _, err := ts[0].ncSend(1, ncXferTag(dirData, 0, xid, idxFin), bufOf(fin), nil).Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-got; !errors.Is(err, ErrWithdrawn) {
		t.Fatalf("zero-copy receive after a failed completion: %v, want ErrWithdrawn", err)
	}
}

// A CTS announcing window keys far larger than any set of keys for the
// transfer could be fails the zero-copy send as invalid at once. The
// sender allocated what it announced (up to 16 GiB) and waited for it.
func TestHostileCTSHugeKeys(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	vec, err := datatype.Vector(64, 128, 256, datatype.Float64)
	if err != nil {
		t.Fatal(err)
	}
	span := int(vec.Extent())
	sent := make(chan error, 1)
	go func() {
		sent <- ts[0].SendTypedWith(ctx, 1, 9, pattern(span, 1), vec, 1, TypedOptions{Scheme: datatype.SchemeZCopy})
	}()
	hb := make([]byte, rtsHdrLen)
	if _, err := ts[1].ncRecv(0, ncRTSTag(KindTyped, 0, 9, 0), bufOf(hb), nil).Wait(ctx); err != nil {
		t.Fatal(err)
	}
	var h rts
	if err := h.decode(hb); err != nil {
		t.Fatal(err)
	}
	m := cts{status: stOK, scheme: datatype.SchemeZCopy, nwin: 1, chunk: 64 << 10, setID: 5, rbytes: int64(span),
		flags: ctsKeys, keysLen: 1 << 33}
	msg := make([]byte, ctsLen)
	m.encode(msg)
	if _, err := ts[1].ncSend(0, ncXferTag(dirReply, 1, h.xid, idxCTS), bufOf(msg), nil).Wait(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-sent:
		if !errors.Is(err, ErrInvalid) {
			t.Fatalf("zero-copy send after a CTS announcing 8 GiB of keys: %v, want ErrInvalid", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the zero-copy send still waits for 8 GiB of window keys 10 s after the CTS")
	}
	fin := make([]byte, finLen)
	if _, err := ts[1].ncRecv(0, ncXferTag(dirData, 0, h.xid, idxFin), bufOf(fin), nil).Wait(ctx); err != nil || fin[0] != finFailed {
		t.Fatalf("completion of the failed transfer: % x %v, want it marked failed", fin, err)
	}
}
