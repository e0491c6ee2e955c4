package integration

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/troupe-hpc/troupe/transport"
)

// The scenarios each rank plays. Every scenario is written for the job size
// its test launches (2 ranks, 3 for deadpeer).
func init() {
	scenarios["integrity"] = integrity
	scenarios["iov"] = iov
	scenarios["rma"] = rma
	scenarios["order"] = order
	scenarios["truncate"] = truncate
	scenarios["deadpeer"] = deadPeer
}

// pattern is n bytes derived from seed and the position, not periodic at
// any power of two below 2^32, so shifted or misplaced data is caught.
func pattern(n int, seed uint32) []byte {
	b := make([]byte, n)
	for i := range b {
		x := (uint32(i) + seed*0x9e3779b9) * 2654435761
		x ^= x >> 15
		b[i] = byte(x >> 7)
	}
	return b
}

// diff describes how got differs from want, or returns "" if they are equal.
func diff(got, want []byte) string {
	if bytes.Equal(got, want) {
		return ""
	}
	if len(got) != len(want) {
		return fmt.Sprintf("length %d, want %d", len(got), len(want))
	}
	for i := range got {
		if got[i] != want[i] {
			return fmt.Sprintf("first difference at byte %d of %d: %#x, want %#x", i, len(got), got[i], want[i])
		}
	}
	return "?"
}

func checkStatus(st transport.Status, src, tag, size int) error {
	if st.Source != src || st.Tag != tag || st.Size != size {
		return fmt.Errorf("status %+v, want source %d tag %d size %d", st, src, tag, size)
	}
	return nil
}

// integrity: rank 0 sends patterned messages of every interesting size to
// rank 1, which checks them byte for byte (and that nothing past the
// message was written) and sends them back for rank 0 to check again.
var integritySizes = []int{0, 1, 8<<10 - 1, 8 << 10, 8<<10 + 1, 1 << 20, 16 << 20}

func integrity(ctx context.Context, r *rank) error {
	const guard = 64
	t := r.t
	for i, n := range integritySizes {
		want := pattern(n, uint32(i+1))
		switch r.id() {
		case 0:
			start := time.Now()
			if err := t.Send(ctx, 1, 1, want); err != nil {
				return fmt.Errorf("send %d B: %w", n, err)
			}
			back := make([]byte, n)
			st, err := t.Recv(ctx, 1, 2, back)
			if err != nil {
				return fmt.Errorf("recv echo of %d B: %w", n, err)
			}
			if err := checkStatus(st, 1, 2, n); err != nil {
				return fmt.Errorf("echo of %d B: %w", n, err)
			}
			if d := diff(back, want); d != "" {
				return fmt.Errorf("echo of %d B: %s", n, d)
			}
			r.logf("%d B round trip ok in %v", n, time.Since(start).Round(time.Microsecond))
		case 1:
			buf := bytes.Repeat([]byte{0xa5}, n+guard)
			var st transport.Status
			var err error
			if i%2 == 1 {
				// Wait for the message to be there (unexpected-message path).
				if st, err = t.Probe(ctx, 0, 1); err != nil {
					return fmt.Errorf("probe %d B: %w", n, err)
				}
				if err := checkStatus(st, 0, 1, n); err != nil {
					return fmt.Errorf("probe of %d B: %w", n, err)
				}
				st, err = t.Recv(ctx, 0, 1, buf[:n])
			} else {
				var req *transport.Request
				if req, err = t.Irecv(0, 1, buf[:n]); err == nil {
					st, err = req.Wait(ctx)
				}
			}
			if err != nil {
				return fmt.Errorf("recv %d B: %w", n, err)
			}
			if err := checkStatus(st, 0, 1, n); err != nil {
				return fmt.Errorf("recv of %d B: %w", n, err)
			}
			if d := diff(buf[:n], want); d != "" {
				return fmt.Errorf("recv of %d B: %s", n, d)
			}
			if d := diff(buf[n:], bytes.Repeat([]byte{0xa5}, guard)); d != "" {
				return fmt.Errorf("recv of %d B wrote past the message: %s", n, d)
			}
			if err := t.Send(ctx, 0, 2, buf[:n]); err != nil {
				return fmt.Errorf("echo %d B: %w", n, err)
			}
		}
	}
	return nil
}

// iov: an IOV list (with an empty element) sent into one contiguous
// buffer, and a contiguous message received into an IOV list.
func iov(ctx context.Context, r *rank) error {
	t := r.t
	cases := [][]int{
		{1000, 0, 3, 64<<10 + 7},
		{1 << 20, 5, 300 << 10},
	}
	for ci, sizes := range cases {
		parts := make([][]byte, len(sizes))
		for i, n := range sizes {
			parts[i] = pattern(n, uint32(100*ci+i))
		}
		joined := bytes.Join(parts, nil)
		total := len(joined)
		back := pattern(total, uint32(1000+ci))
		switch r.id() {
		case 0:
			if err := t.SendIOV(ctx, 1, 1, parts); err != nil {
				return fmt.Errorf("case %d: SendIOV %v: %w", ci, sizes, err)
			}
			outs := [][]byte{make([]byte, 5), make([]byte, 4096), make([]byte, total-5-4096)}
			st, err := t.RecvIOV(ctx, 1, 2, outs)
			if err != nil {
				return fmt.Errorf("case %d: RecvIOV of %d B: %w", ci, total, err)
			}
			if err := checkStatus(st, 1, 2, total); err != nil {
				return fmt.Errorf("case %d: RecvIOV: %w", ci, err)
			}
			if d := diff(bytes.Join(outs, nil), back); d != "" {
				return fmt.Errorf("case %d: contiguous into IOV [5 4096 %d]: %s", ci, total-5-4096, d)
			}
			r.logf("IOV case %d (%d B) ok both ways", ci, total)
		case 1:
			buf := make([]byte, total)
			st, err := t.Recv(ctx, 0, 1, buf)
			if err != nil {
				return fmt.Errorf("case %d: recv of IOV %v: %w", ci, sizes, err)
			}
			if err := checkStatus(st, 0, 1, total); err != nil {
				return fmt.Errorf("case %d: recv of IOV: %w", ci, err)
			}
			if d := diff(buf, joined); d != "" {
				return fmt.Errorf("case %d: IOV %v into contiguous: %s", ci, sizes, d)
			}
			if err := t.Send(ctx, 0, 2, back); err != nil {
				return fmt.Errorf("case %d: send contiguous: %w", ci, err)
			}
		}
	}
	return nil
}

// rma: rank 1 registers memory and ships its key; rank 0 reads it, writes
// into it, reads the write back, has out-of-bounds accesses rejected, and
// finally asks rank 1 to check its memory.
const (
	rmaLen     = 1<<20 + 123
	rmaInit    = 7
	rmaPutOff  = 100
	rmaPutLen  = 256<<10 + 3
	rmaPutSeed = 99
	rmaEndLen  = 16
	rmaEndSeed = 55

	tagKey, tagVerify, tagVerified = 10, 11, 12
)

// rmaExpected is rank 1's memory after rank 0's puts.
func rmaExpected() []byte {
	want := pattern(rmaLen, rmaInit)
	copy(want[rmaPutOff:], pattern(rmaPutLen, rmaPutSeed))
	copy(want[rmaLen-rmaEndLen:], pattern(rmaEndLen, rmaEndSeed))
	return want
}

func rma(ctx context.Context, r *rank) error {
	t := r.t
	if r.id() == 1 {
		mem := pattern(rmaLen, rmaInit)
		reg, err := t.Register(mem)
		if err != nil {
			return fmt.Errorf("register: %w", err)
		}
		wire, err := reg.Key().MarshalBinary()
		if err != nil {
			return fmt.Errorf("marshal key: %w", err)
		}
		if err := t.Send(ctx, 0, tagKey, wire); err != nil {
			return fmt.Errorf("send key: %w", err)
		}
		msg := make([]byte, 16)
		st, err := t.Recv(ctx, 0, tagVerify, msg)
		if err != nil {
			return fmt.Errorf("recv verify request: %w", err)
		}
		if string(msg[:st.Size]) != "verify" {
			return fmt.Errorf("verify request %q", msg[:st.Size])
		}
		verdict := "ok"
		if d := diff(mem, rmaExpected()); d != "" {
			verdict = "rank 1 memory after puts: " + d
		}
		if err := t.Send(ctx, 0, tagVerified, []byte(verdict)); err != nil {
			return fmt.Errorf("send verdict: %w", err)
		}
		reg.Release()
		t.Deregister(mem)
		if verdict != "ok" {
			return errors.New(verdict)
		}
		r.logf("memory holds rank 0's puts")
		return nil
	}

	st, err := t.Probe(ctx, 1, tagKey)
	if err != nil {
		return fmt.Errorf("probe key: %w", err)
	}
	wire := make([]byte, st.Size)
	if _, err := t.Recv(ctx, 1, tagKey, wire); err != nil {
		return fmt.Errorf("recv key: %w", err)
	}
	var key transport.RemoteKey
	if err := key.UnmarshalBinary(wire); err != nil {
		return fmt.Errorf("unmarshal key: %w", err)
	}
	if key.Rank != 1 || key.Len != rmaLen {
		return fmt.Errorf("key for rank %d, %d B; want rank 1, %d B", key.Rank, key.Len, rmaLen)
	}
	// The initial contents, read remotely.
	all := make([]byte, rmaLen)
	if err := t.Get(ctx, key, 0, all); err != nil {
		return fmt.Errorf("get whole region: %w", err)
	}
	if d := diff(all, pattern(rmaLen, rmaInit)); d != "" {
		return fmt.Errorf("get of the initial region: %s", d)
	}
	src := pattern(rmaPutLen, rmaPutSeed)
	if err := t.Put(ctx, key, rmaPutOff, src); err != nil {
		return fmt.Errorf("put %d B at %d: %w", rmaPutLen, rmaPutOff, err)
	}
	end := pattern(rmaEndLen, rmaEndSeed)
	if err := t.Put(ctx, key, rmaLen-rmaEndLen, end); err != nil {
		return fmt.Errorf("put at the region's last %d bytes: %w", rmaEndLen, err)
	}
	if err := t.Flush(ctx, 1); err != nil {
		return fmt.Errorf("flush: %w", err)
	}
	got := make([]byte, rmaPutLen)
	if err := t.Get(ctx, key, rmaPutOff, got); err != nil {
		return fmt.Errorf("get back: %w", err)
	}
	if d := diff(got, src); d != "" {
		return fmt.Errorf("get after put: %s", d)
	}
	// Out-of-bounds accesses are rejected before anything is sent.
	oob := []struct {
		name string
		f    func() error
	}{
		{"put across the end", func() error { return t.Put(ctx, key, rmaLen-10, make([]byte, 20)) }},
		{"put past the end", func() error { return t.Put(ctx, key, rmaLen+1, make([]byte, 1)) }},
		{"put larger than the region", func() error { return t.Put(ctx, key, 0, make([]byte, rmaLen+1)) }},
		{"get at a negative offset", func() error { return t.Get(ctx, key, -1, make([]byte, 4)) }},
		{"get across the end", func() error { return t.Get(ctx, key, rmaLen-1, make([]byte, 2)) }},
	}
	for _, c := range oob {
		err := c.f()
		var be *transport.BoundsError
		if !errors.Is(err, transport.ErrOutOfBounds) || !errors.As(err, &be) {
			return fmt.Errorf("%s: got %v, want ErrOutOfBounds", c.name, err)
		}
	}
	if err := t.Flush(ctx, 1); err != nil {
		return fmt.Errorf("flush after rejected accesses: %w", err)
	}
	if err := t.Send(ctx, 1, tagVerify, []byte("verify")); err != nil {
		return fmt.Errorf("send verify request: %w", err)
	}
	verdict := make([]byte, 256)
	st, err = t.Recv(ctx, 1, tagVerified, verdict)
	if err != nil {
		return fmt.Errorf("recv verdict: %w", err)
	}
	if v := string(verdict[:st.Size]); v != "ok" {
		return fmt.Errorf("rank 1 says: %s", v)
	}
	r.logf("put/get/flush ok, %d out-of-bounds accesses rejected, rank 1 verified its memory", len(oob))
	return nil
}

// order: 10,000 messages with one tag, mostly small with a larger one now
// and then (a different protocol), arrive in the order they were sent.
// Rank 0 keeps a window of sends in flight; rank 1 a window of receives.
const (
	orderN      = 10000
	orderWindow = 64
	orderBig    = 40000
)

func orderSize(i int) int {
	if i%97 == 0 {
		return orderBig
	}
	return 8 + i%5
}

func orderMsg(i int) []byte {
	m := pattern(orderSize(i), uint32(i))
	binary.LittleEndian.PutUint64(m, uint64(i))
	return m
}

func order(ctx context.Context, r *rank) error {
	t := r.t
	start := time.Now()
	var q []*transport.Request
	var bufs [][]byte
	if r.id() == 0 {
		for i := 0; i < orderN; i++ {
			req, err := t.Isend(1, 5, orderMsg(i))
			if err != nil {
				return fmt.Errorf("isend %d: %w", i, err)
			}
			q = append(q, req)
			if len(q) == orderWindow {
				if _, err := q[0].Wait(ctx); err != nil {
					return fmt.Errorf("send %d: %w", i-orderWindow+1, err)
				}
				q = q[1:]
			}
		}
		for _, req := range q {
			if _, err := req.Wait(ctx); err != nil {
				return fmt.Errorf("send: %w", err)
			}
		}
		r.logf("sent %d messages in %v", orderN, time.Since(start).Round(time.Millisecond))
		return nil
	}
	post := func(i int) error {
		b := make([]byte, orderBig)
		req, err := t.Irecv(0, 5, b)
		if err != nil {
			return fmt.Errorf("irecv %d: %w", i, err)
		}
		q, bufs = append(q, req), append(bufs, b)
		return nil
	}
	next := 0
	for ; next < orderWindow; next++ {
		if err := post(next); err != nil {
			return err
		}
	}
	for i := 0; i < orderN; i++ {
		var st transport.Status
		var err error
		if i%2 == 0 {
			st, err = q[0].Wait(ctx)
		} else {
			// Poll with Test for half of them.
			var done bool
			for !done && err == nil {
				done, st, err = q[0].Test()
				if !done && ctx.Err() != nil {
					err = ctx.Err()
				}
			}
		}
		if err != nil {
			return fmt.Errorf("recv %d: %w", i, err)
		}
		got := bufs[0][:st.Size]
		if st.Size >= 8 {
			if seq := binary.LittleEndian.Uint64(got); seq != uint64(i) {
				return fmt.Errorf("message %d arrived as number %d: out of order", seq, i)
			}
		}
		if d := diff(got, orderMsg(i)); d != "" {
			return fmt.Errorf("message %d: %s", i, d)
		}
		q, bufs = q[1:], bufs[1:]
		if next < orderN {
			if err := post(next); err != nil {
				return err
			}
			next++
		}
	}
	r.logf("%d same-tag messages arrived in order in %v", orderN, time.Since(start).Round(time.Millisecond))
	return nil
}

// truncate: receives smaller than the message fail with *TruncatedError
// carrying the real size, for a pre-posted receive of an eager message and
// for an unexpected rendezvous-sized one; the pair keeps working.
func truncate(ctx context.Context, r *rank) error {
	t := r.t
	const small, big = 1000, 1 << 20
	if r.id() == 0 {
		if _, err := t.Recv(ctx, 1, 9, make([]byte, 8)); err != nil { // rank 1's receive is posted
			return fmt.Errorf("recv posted notice: %w", err)
		}
		s1, err := t.Isend(1, 3, pattern(small, 1))
		if err != nil {
			return err
		}
		s2, err := t.Isend(1, 3, pattern(big, 2))
		if err != nil {
			return err
		}
		for i, s := range []*transport.Request{s1, s2} {
			wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			_, err := s.Wait(wctx)
			cancel()
			if errors.Is(err, context.DeadlineExceeded) {
				return fmt.Errorf("send %d of a message the receiver truncated never completed", i)
			}
			r.logf("sender of truncated message %d: %v", i, err)
		}
		// The pair keeps working, both ways, small and large.
		if err := t.Send(ctx, 1, 3, []byte("after")); err != nil {
			return fmt.Errorf("send after truncation: %w", err)
		}
		if err := t.Send(ctx, 1, 3, pattern(big, 3)); err != nil {
			return fmt.Errorf("send large after truncation: %w", err)
		}
		buf := make([]byte, 16)
		st, err := t.Recv(ctx, 1, 4, buf)
		if err != nil || string(buf[:st.Size]) != "back" {
			return fmt.Errorf("recv after truncation: %q %v", buf[:st.Size], err)
		}
		r.logf("truncation reported, pair still works")
		return nil
	}
	// Pre-posted receive, too small for the eager message.
	rq, err := t.Irecv(0, 3, make([]byte, small/2))
	if err != nil {
		return err
	}
	if err := t.Send(ctx, 0, 9, []byte("posted")); err != nil {
		return err
	}
	check := func(what string, st transport.Status, err error, size, bufLen int) error {
		var te *transport.TruncatedError
		if !errors.As(err, &te) || !errors.Is(err, transport.ErrTruncated) {
			return fmt.Errorf("%s: got %v, want *TruncatedError", what, err)
		}
		if te.Size != size || te.BufLen != bufLen || te.Source != 0 || te.Tag != 3 {
			return fmt.Errorf("%s: %+v, want size %d buffer %d from rank 0 tag 3", what, *te, size, bufLen)
		}
		if st.Size != size {
			return fmt.Errorf("%s: status size %d, want %d", what, st.Size, size)
		}
		return nil
	}
	st, err := rq.Wait(ctx)
	if err := check("pre-posted receive", st, err, small, small/2); err != nil {
		return err
	}
	// Unexpected message: probe until it is there, then receive too little.
	if st, err = t.Probe(ctx, 0, 3); err != nil || st.Size != big {
		return fmt.Errorf("probe of the large message: %+v %v", st, err)
	}
	st, err = t.Recv(ctx, 0, 3, make([]byte, big/2))
	if err := check("unexpected receive", st, err, big, big/2); err != nil {
		return err
	}
	buf := make([]byte, big)
	if st, err = t.Recv(ctx, 0, 3, buf); err != nil || string(buf[:st.Size]) != "after" {
		return fmt.Errorf("recv after truncation: %q %v", buf[:st.Size], err)
	}
	if st, err = t.Recv(ctx, 0, 3, buf); err != nil || st.Size != big {
		return fmt.Errorf("recv large after truncation: %+v %v", st, err)
	}
	if d := diff(buf, pattern(big, 3)); d != "" {
		return fmt.Errorf("large message after truncation: %s", d)
	}
	if err := t.Send(ctx, 0, 4, []byte("back")); err != nil {
		return err
	}
	r.logf("got *TruncatedError with the real sizes")
	return nil
}

// deadpeer (3 ranks): ranks 0 and 1 each have a receive from rank 2
// pending; rank 2, once both have talked to it, kills itself with SIGKILL.
// The pending receives must fail with ErrPeerLost within 2 s, a PeerLost
// event must arrive, and ranks 0 and 1 keep exchanging messages all along
// and for a while after the loss.
const (
	tagHello, tagReady, tagGo, tagNever, tagPP = 1, 2, 3, 4, 5

	detectLimit  = 2 * time.Second
	roundsAfter  = 200
	ppPayloadLen = 1024
)

func deadPeer(ctx context.Context, r *rank) error {
	t := r.t
	r.skipFinalBarrier = true // rank 2 will not come
	if r.id() == 2 {
		for _, p := range []int{0, 1} {
			if _, err := t.Recv(ctx, p, tagHello, make([]byte, 8)); err != nil {
				return fmt.Errorf("hello from %d: %w", p, err)
			}
		}
		for _, p := range []int{0, 1} {
			if err := t.Send(ctx, p, tagReady, []byte("ready")); err != nil {
				return fmt.Errorf("ready to %d: %w", p, err)
			}
		}
		if _, err := t.Recv(ctx, 0, tagGo, make([]byte, 8)); err != nil {
			return fmt.Errorf("go from 0: %w", err)
		}
		r.logf("KILL_AT_NS=%d", time.Now().UnixNano())
		syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	}

	// The launcher stops the survivors (SIGTERM) as soon as rank 2 dies;
	// they finish their checks first (the test gives them a long grace).
	term := make(chan os.Signal, 1)
	signal.Notify(term, syscall.SIGTERM)
	go func() {
		<-term
		r.logf("SIGTERM from the launcher; finishing the checks")
	}()

	lost := t.PeerLost()
	pending, err := t.Irecv(2, tagNever, make([]byte, 64))
	if err != nil {
		return fmt.Errorf("irecv from 2: %w", err)
	}
	if r.id() == 1 {
		return deadPeerRank1(ctx, r, pending, lost)
	}

	// Rank 0: ping-pong with rank 1 from before the kill until well after.
	var detected atomic.Bool
	type ppResult struct {
		before, after int
		err           error
	}
	pp := make(chan ppResult, 1)
	firstPong := make(chan struct{})
	go func() {
		var res ppResult
		buf := make([]byte, 8+ppPayloadLen)
		for k := 0; ; k++ {
			stop := detected.Load() && res.after >= roundsAfter
			msg := []byte{0}
			if !stop {
				msg = pattern(8+ppPayloadLen, uint32(k))
				binary.LittleEndian.PutUint64(msg, uint64(k))
			}
			if err := t.Send(ctx, 1, tagPP, msg); err != nil {
				res.err = fmt.Errorf("ping %d: %w", k, err)
				break
			}
			st, err := t.Recv(ctx, 1, tagPP, buf)
			if err != nil {
				res.err = fmt.Errorf("pong %d: %w", k, err)
				break
			}
			if d := diff(buf[:st.Size], msg); d != "" {
				res.err = fmt.Errorf("pong %d: %s", k, d)
				break
			}
			if stop {
				break
			}
			if k == 0 {
				close(firstPong)
			}
			if detected.Load() {
				res.after++
			} else {
				res.before++
			}
		}
		pp <- res
	}()

	if err := t.Send(ctx, 2, tagHello, []byte("hello")); err != nil {
		return fmt.Errorf("hello to 2: %w", err)
	}
	if _, err := t.Recv(ctx, 2, tagReady, make([]byte, 8)); err != nil {
		return fmt.Errorf("ready from 2: %w", err)
	}
	// Ranks 0 and 1 are already exchanging when rank 2 dies.
	select {
	case <-firstPong:
	case res := <-pp:
		return fmt.Errorf("exchange with rank 1 before the kill: %v", res.err)
	}
	// A rendezvous-sized send rank 2 never receives stays pending.
	pendingSend, err := t.Isend(2, tagNever, pattern(4<<20, 1))
	if err != nil {
		return fmt.Errorf("isend to 2: %w", err)
	}
	goAt := time.Now()
	if err := t.Send(ctx, 2, tagGo, []byte("go")); err != nil {
		return fmt.Errorf("go to 2: %w", err)
	}
	elapsed, err := expectLost(ctx, r, pending, lost, goAt)
	detected.Store(true)
	if err != nil {
		return err
	}
	r.logf("pending receive failed with ErrPeerLost %v after telling rank 2 to die", elapsed.Round(time.Microsecond))
	sctx, cancel := context.WithTimeout(ctx, detectLimit)
	_, err = pendingSend.Wait(sctx)
	cancel()
	if !errors.Is(err, transport.ErrPeerLost) {
		return fmt.Errorf("pending 4 MiB send to the dead rank: %v (%v after the kill), want ErrPeerLost", err, time.Since(goAt))
	}
	r.logf("pending send failed with ErrPeerLost %v after telling rank 2 to die", time.Since(goAt).Round(time.Microsecond))

	// New operations on the dead peer fail at once.
	if err := t.Send(ctx, 2, tagHello, []byte("x")); !errors.Is(err, transport.ErrPeerLost) {
		return fmt.Errorf("send to the dead rank: %v, want ErrPeerLost", err)
	}
	if _, err := t.Recv(ctx, 2, tagNever, make([]byte, 8)); !errors.Is(err, transport.ErrPeerLost) {
		return fmt.Errorf("recv from the dead rank: %v, want ErrPeerLost", err)
	}
	if _, _, err := t.Iprobe(2, tagNever); !errors.Is(err, transport.ErrPeerLost) {
		return fmt.Errorf("iprobe of the dead rank: %v, want ErrPeerLost", err)
	}
	res := <-pp
	if res.err != nil {
		return fmt.Errorf("exchange with rank 1: %w", res.err)
	}
	if res.before == 0 || res.after < roundsAfter {
		return fmt.Errorf("%d round trips with rank 1 before the loss and %d after, want > 0 and >= %d", res.before, res.after, roundsAfter)
	}
	r.logf("exchanged %d round trips with rank 1 before the loss was seen and %d after", res.before, res.after)
	return nil
}

// expectLost waits for pending to fail with ErrPeerLost for rank 2 and for
// the PeerLost event, and prints LOST_AT_NS for the test to compare with
// rank 2's KILL_AT_NS.
func expectLost(ctx context.Context, r *rank, pending *transport.Request, lost <-chan transport.PeerEvent, since time.Time) (time.Duration, error) {
	wctx, cancel := context.WithTimeout(ctx, 3*detectLimit)
	defer cancel()
	_, err := pending.Wait(wctx)
	at := time.Now()
	elapsed := at.Sub(since)
	r.logf("LOST_AT_NS=%d", at.UnixNano())
	var pl *transport.PeerLostError
	if !errors.Is(err, transport.ErrPeerLost) || !errors.As(err, &pl) || pl.Rank != 2 {
		return elapsed, fmt.Errorf("pending receive from rank 2 after its death: %v (after %v), want ErrPeerLost", err, elapsed)
	}
	if elapsed > detectLimit {
		return elapsed, fmt.Errorf("pending receive failed %v after rank 2's death, more than %v", elapsed, detectLimit)
	}
	// The event was sent before the pending operations failed.
	select {
	case ev := <-lost:
		if ev.Rank != 2 {
			return elapsed, fmt.Errorf("PeerLost event for rank %d, want 2", ev.Rank)
		}
		r.logf("PeerLost event: rank %d: %s", ev.Rank, ev.Reason)
	case <-wctx.Done():
		return elapsed, errors.New("no PeerLost event for rank 2")
	}
	return elapsed, nil
}

func deadPeerRank1(ctx context.Context, r *rank, pending *transport.Request, lost <-chan transport.PeerEvent) error {
	t := r.t
	if err := t.Send(ctx, 2, tagHello, []byte("hello")); err != nil {
		return fmt.Errorf("hello to 2: %w", err)
	}
	if _, err := t.Recv(ctx, 2, tagReady, make([]byte, 8)); err != nil {
		return fmt.Errorf("ready from 2: %w", err)
	}
	readyAt := time.Now() // rank 2 dies after this; the test checks against its own time
	lostErr := make(chan error, 1)
	go func() {
		_, err := expectLost(ctx, r, pending, lost, readyAt)
		lostErr <- err
	}()
	buf := make([]byte, 8+ppPayloadLen)
	rounds := 0
	for {
		st, err := t.Recv(ctx, 0, tagPP, buf)
		if err != nil {
			return fmt.Errorf("ping %d: %w", rounds, err)
		}
		if err := t.Send(ctx, 0, tagPP, buf[:st.Size]); err != nil {
			return fmt.Errorf("pong %d: %w", rounds, err)
		}
		if st.Size == 1 {
			break
		}
		rounds++
	}
	if err := <-lostErr; err != nil {
		return err
	}
	r.logf("echoed %d pings from rank 0", rounds)
	return nil
}
