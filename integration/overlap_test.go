package integration

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/overlap"
	"github.com/troupe-hpc/troupe/transport"
	"github.com/troupe-hpc/troupe/transport/bootstrap"
)

// Scenarios of the overlap engine (issue 7). Each runs with the engine off
// and on (TROUPE_OVERLAP), over TCP and shared memory.
func init() {
	scenarios["ovl-late-receiver"] = ovlLateReceiver
	scenarios["ovl-late-sender"] = ovlLateSender
	scenarios["ovl-pool-full"] = ovlPoolFull
	scenarios["ovl-channel"] = ovlChannel
	scenarios["ovl-chan-mismatch"] = ovlChanMismatch
}

// ovlSizes mixes eager and rendezvous messages of one tag, so the order of
// one (source, tag) stream is checked across the engine's paths.
var ovlSizes = []int{64 << 10, 1 << 20, 4 << 20, 9 << 10, 100, 5<<20 + 3, 0, 256 << 10}

const (
	ovlTagData  = 1
	ovlTagCtl   = 2
	ovlTagData2 = 3
)

func engineOn() bool { return os.Getenv(transport.OverlapEnv) == "on" }

// ovlCheck compares a received message with the one sent as number i.
func ovlCheck(st transport.Status, buf []byte, src, tag, i, n int) error {
	if err := checkStatus(st, src, tag, n); err != nil {
		return fmt.Errorf("message %d: %w", i, err)
	}
	if d := diff(buf[:n], pattern(n, uint32(100+i))); d != "" {
		return fmt.Errorf("message %d (%d B): %s", i, n, d)
	}
	return nil
}

// waitTaken waits (progressing the transport, no sleeping) until the engine
// has taken n messages off UCX's unexpected queue, or, with the engine
// off, until the first message from src is there.
func waitTaken(ctx context.Context, r *rank, src, tag, n int) error {
	for {
		if engineOn() {
			if r.t.OverlapTable().Unexpected >= n {
				return nil
			}
			if _, _, err := r.t.Iprobe(src, tag); err != nil {
				return err
			}
		} else if _, ok, err := r.t.Iprobe(src, tag); err != nil || ok {
			return err
		}
		if ctx.Err() != nil {
			return fmt.Errorf("waiting for %d messages to arrive: %w (table %+v)", n, ctx.Err(), r.t.OverlapTable())
		}
		runtime.Gosched()
	}
}

// waitDecided waits (progressing the transport, no sleeping) until the
// engine has decided on n message headers, for scenarios where none of
// them had its receive posted first. waitTaken alone is not enough: a CMA
// message is in the unexpected table while its descriptor is still being
// received, before the engine sees its header (transport/overlap_cma.go).
func waitDecided(ctx context.Context, r *rank, src, tag, n int) error {
	for {
		st, ok := r.t.OverlapStats()
		if !ok || st.Prefetched+st.Onloaded+st.Eager >= uint64(n) {
			return nil
		}
		if _, _, err := r.t.Iprobe(src, tag); err != nil {
			return err
		}
		if ctx.Err() != nil {
			return fmt.Errorf("waiting for the engine to decide on %d messages: %w (%+v)", n, ctx.Err(), st)
		}
		runtime.Gosched()
	}
}

// busy computes for d without calling the transport: the rank is late.
func busy(d time.Duration) {
	x := 1.0
	for start := time.Now(); time.Since(start) < d; {
		for i := 0; i < 1000; i++ {
			x = x*1.0000001 + 1e-9
		}
	}
	_ = x
}

// ovlStats returns the engine's counters, ok false with the engine off; it
// fails if the engine is on (TROUPE_OVERLAP) but the transport has none.
func ovlStats(r *rank) (st overlap.Stats, ok bool, err error) {
	st, ok = r.t.OverlapStats()
	if engineOn() && !ok {
		return st, false, fmt.Errorf("%s=on but the transport has no overlap engine", transport.OverlapEnv)
	}
	return st, ok, nil
}

// ovlEngineDone checks the engine's books are balanced once everything was
// received (ovlEngineBooks) and that CMA, when on, carried the large
// tagged messages through the engine.
func ovlEngineDone(r *rank) error {
	if err := ovlEngineBooks(r); err != nil {
		return err
	}
	// Over shared memory the large messages come by CMA, through the
	// engine (transport/overlap_cma.go).
	if c := r.t.CMAStats(); c.Enabled && c.Received == 0 {
		return fmt.Errorf("CMA is on but carried no message: %+v", c)
	}
	return nil
}

// ovlEngineBooks checks that the engine holds nothing once everything was
// received: no transfer record, slot or table entry left behind.
func ovlEngineBooks(r *rank) error {
	st, ok := r.t.OverlapStats()
	if !ok {
		return nil
	}
	r.logf("engine: offloaded %d onloaded %d prefetched %d eager %d useful %d useless %d dropped (prefetched/onloaded) %d/%d pool high water %d/%d table %+v",
		st.Offloaded, st.Onloaded, st.Prefetched, st.Eager, st.PrefetchUseful, st.PrefetchUseless, st.PrefetchDropped, st.OnloadDropped,
		st.PoolHighWater, st.PoolSlots, r.t.OverlapTable())
	return ovlEngineBooksQuiet(r)
}

// ovlEngineBooksQuiet is ovlEngineBooks without the log line.
func ovlEngineBooksQuiet(r *rank) error {
	st, ok := r.t.OverlapStats()
	if !ok {
		return nil
	}
	tab := r.t.OverlapTable()
	tab.Discarded = 0 // cumulative: leftover chunks of failed channel receives
	switch {
	case st.PoolInUse != 0:
		return fmt.Errorf("%d pool slots still held", st.PoolInUse)
	case st.Tracked != 0:
		return fmt.Errorf("the engine still tracks %d transfers", st.Tracked)
	case st.PoolHighWater > st.PoolSlots:
		return fmt.Errorf("pool high water %d above its %d slots", st.PoolHighWater, st.PoolSlots)
	case tab != transport.OverlapTable{}:
		return fmt.Errorf("engine tables not empty: %+v", tab)
	}
	return nil
}

// ovlLateReceiver: rank 0 sends every size on one tag; rank 1 posts its
// receives only once all messages have arrived (unexpected messages: with
// the engine on they are prefetched or held), then checks order and data.
func ovlLateReceiver(ctx context.Context, r *rank) error {
	t := r.t
	switch r.id() {
	case 0:
		var reqs []*transport.Request
		for i, n := range ovlSizes {
			q, err := t.Isend(1, ovlTagData, pattern(n, uint32(100+i)))
			if err != nil {
				return err
			}
			reqs = append(reqs, q)
		}
		for i, q := range reqs {
			if _, err := q.Wait(ctx); err != nil {
				return fmt.Errorf("send %d: %w", i, err)
			}
		}
		r.logf("all sends complete")
	case 1:
		if err := waitTaken(ctx, r, 0, ovlTagData, len(ovlSizes)); err != nil {
			return err
		}
		busy(2 * time.Millisecond)
		for i, n := range ovlSizes {
			buf := make([]byte, n+64)
			st, err := t.Recv(ctx, 0, ovlTagData, buf)
			if err != nil {
				return fmt.Errorf("recv %d (%d B): %w", i, n, err)
			}
			if err := ovlCheck(st, buf, 0, ovlTagData, i, n); err != nil {
				return err
			}
		}
		if _, ok, err := t.Iprobe(0, ovlTagData); err != nil || ok {
			return fmt.Errorf("a message too many after the last one: ok=%v err=%v", ok, err)
		}
		r.logf("late receiver got %d messages in order", len(ovlSizes))
		// With the engine on, the unexpected rendezvous messages were
		// prefetched while this rank computed, and every prefetch was
		// consumed by its receive (at least one after it completed).
		if st, ok, err := ovlStats(r); err != nil {
			return err
		} else if ok {
			switch {
			case st.Prefetched == 0:
				return fmt.Errorf("the engine prefetched no message: %+v", st)
			case st.PrefetchUseful == 0:
				return fmt.Errorf("no prefetch was useful: %+v", st)
			case st.PrefetchUseful+st.PrefetchUseless != st.Prefetched || st.PrefetchDropped != 0:
				return fmt.Errorf("%d prefetched, %d useful + %d useless (%d dropped): every prefetch should have been received once", st.Prefetched, st.PrefetchUseful, st.PrefetchUseless, st.PrefetchDropped)
			}
		}
		return ovlEngineDone(r)
	}
	return nil
}

// ovlLateSender: rank 1 posts every receive first (expected messages),
// tells rank 0, and computes without calling the transport; rank 0 is late,
// then sends. With the engine on the progress goroutine moves the data
// while rank 1 computes.
func ovlLateSender(ctx context.Context, r *rank) error {
	t := r.t
	ctl := make([]byte, 1)
	switch r.id() {
	case 0:
		if _, err := t.Recv(ctx, 1, ovlTagCtl, ctl); err != nil {
			return err
		}
		busy(5 * time.Millisecond)
		for i, n := range ovlSizes {
			if err := t.Send(ctx, 1, ovlTagData, pattern(n, uint32(100+i))); err != nil {
				return fmt.Errorf("send %d: %w", i, err)
			}
		}
	case 1:
		bufs := make([][]byte, len(ovlSizes))
		reqs := make([]*transport.Request, len(ovlSizes))
		for i, n := range ovlSizes {
			bufs[i] = make([]byte, n+64)
			q, err := t.Irecv(0, ovlTagData, bufs[i])
			if err != nil {
				return err
			}
			reqs[i] = q
		}
		if err := t.Send(ctx, 0, ovlTagCtl, ctl); err != nil {
			return err
		}
		busy(20 * time.Millisecond)
		// A receive cancelled while the engine holds it gives its
		// sequence number back; the next receive gets the message.
		extra, err := t.Irecv(0, ovlTagData2, make([]byte, 1<<20))
		if err != nil {
			return err
		}
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		if _, err := extra.Wait(cctx); err == nil {
			return fmt.Errorf("cancelled receive completed without a message")
		}
		for i, q := range reqs {
			st, err := q.Wait(ctx)
			if err != nil {
				return fmt.Errorf("recv %d (%d B): %w", i, ovlSizes[i], err)
			}
			if err := ovlCheck(st, bufs[i], 0, ovlTagData, i, ovlSizes[i]); err != nil {
				return err
			}
		}
		r.logf("late sender's %d messages arrived in order", len(ovlSizes))
		// With the engine on, rendezvous messages whose header came while
		// this rank computed were offloaded.
		if st, ok, err := ovlStats(r); err != nil {
			return err
		} else if ok && st.Offloaded == 0 {
			return fmt.Errorf("the engine offloaded no transfer: %+v", st)
		}
		return ovlEngineDone(r)
	}
	return nil
}

// ovlPoolN messages per tag overflow a pool of ovlPoolSlots slots many
// times over.
const (
	ovlPoolN     = 12
	ovlPoolSlots = 2
)

// ovlPoolFull: with a 2-slot pool, rank 0 sends ovlPoolN rendezvous
// messages on each of two tags, interleaved; rank 1 waits until all have
// arrived, then receives tag 3 first and tag 1 second. Every message must
// arrive once, in order, intact, and every slot must come back.
func ovlPoolFull(ctx context.Context, r *rank) error {
	t := r.t
	size := func(i int) int { return 64<<10 + i*4099 }
	switch r.id() {
	case 0:
		var reqs []*transport.Request
		for i := 0; i < ovlPoolN; i++ {
			for _, tag := range []int{ovlTagData, ovlTagData2} {
				q, err := t.Isend(1, tag, pattern(size(i), uint32(100+i+tag*1000)))
				if err != nil {
					return err
				}
				reqs = append(reqs, q)
			}
		}
		for i, q := range reqs {
			if _, err := q.Wait(ctx); err != nil {
				return fmt.Errorf("send %d: %w", i, err)
			}
		}
	case 1:
		if err := waitTaken(ctx, r, 0, ovlTagData, 2*ovlPoolN); err != nil {
			return err
		}
		if err := waitDecided(ctx, r, 0, ovlTagData, 2*ovlPoolN); err != nil {
			return err
		}
		// With the engine on, every message has been taken and none
		// received: the first ones filled the 2 slots, the others fell
		// back on the full pool.
		if st, ok, err := ovlStats(r); err != nil {
			return err
		} else if ok {
			switch {
			case st.PoolSlots != ovlPoolSlots:
				return fmt.Errorf("pool of %d slots, want %d (%s): %+v", st.PoolSlots, ovlPoolSlots, transport.OverlapSlotsEnv, st)
			case st.Prefetched == 0:
				return fmt.Errorf("no message was prefetched: %+v", st)
			case st.PoolHighWater != st.PoolSlots || st.PoolInUse != st.PoolSlots:
				return fmt.Errorf("pool high water %d, %d slots in use, want all %d: %+v", st.PoolHighWater, st.PoolInUse, st.PoolSlots, st)
			case st.OnloadPoolFull == 0:
				return fmt.Errorf("no message fell back on the full pool: %+v", st)
			case st.Prefetched+st.OnloadPoolFull != 2*ovlPoolN:
				return fmt.Errorf("%d prefetched + %d onloaded on a full pool, want all %d messages: %+v", st.Prefetched, st.OnloadPoolFull, 2*ovlPoolN, st)
			}
		}
		for _, tag := range []int{ovlTagData2, ovlTagData} {
			for i := 0; i < ovlPoolN; i++ {
				buf := make([]byte, size(i))
				st, err := t.Recv(ctx, 0, tag, buf)
				if err != nil {
					return fmt.Errorf("recv tag %d #%d: %w", tag, i, err)
				}
				if err := checkStatus(st, 0, tag, size(i)); err != nil {
					return fmt.Errorf("tag %d #%d: %w", tag, i, err)
				}
				if d := diff(buf, pattern(size(i), uint32(100+i+tag*1000))); d != "" {
					return fmt.Errorf("tag %d #%d: %s", tag, i, d)
				}
			}
			if _, ok, err := t.Iprobe(0, tag); err != nil || ok {
				return fmt.Errorf("tag %d: a message too many: ok=%v err=%v", tag, ok, err)
			}
		}
		r.logf("pool-full: %d messages each received once, in order", 2*ovlPoolN)
		return ovlEngineDone(r)
	}
	return nil
}

// ovlChanSizes are channel message sizes: one chunk, chunks with a tail,
// an exact chunk multiple (empty tail), eager and empty messages.
var ovlChanSizes = []int{64 << 10, 2*transport.ChannelChunkSize + 777, 100, 0, 3 * transport.ChannelChunkSize, 9 << 10, 1 << 20}

// ovlChannel: channel traffic through the engine. Phase 1 (late receiver):
// rank 0 sends every size on channel 7, then a tagged note; rank 1 opens
// its end of channel 7 only once the note is in (with the engine on, once
// the engine has taken every chunk: they arrive before the channel exists
// on rank 1, which has channel 8 open), then receives. Phase 2 (late
// sender): rank 1 posts every receive on channel 8, tells rank 0 and
// computes without calling the transport; rank 0 then sends.
func ovlChannel(ctx context.Context, r *rank) error {
	t := r.t
	ctl := make([]byte, 1)
	peer := 1 - r.id()
	c8, err := t.Channel(8, peer)
	if err != nil {
		return err
	}
	defer c8.Close()
	switch r.id() {
	case 0:
		c7, err := t.Channel(7, 1)
		if err != nil {
			return err
		}
		defer c7.Close()
		var sends []*transport.ChannelRequest
		for i, n := range ovlChanSizes {
			q, err := c7.SendBytes(pattern(n, uint32(100+i)))
			if err != nil {
				return err
			}
			sends = append(sends, q)
		}
		if err := t.Send(ctx, 1, ovlTagCtl, ctl); err != nil {
			return err
		}
		for i, q := range sends {
			if err := q.Wait(ctx); err != nil {
				return fmt.Errorf("channel 7 send %d: %w", i, err)
			}
		}
		if _, err := t.Recv(ctx, 1, ovlTagCtl, ctl); err != nil {
			return err
		}
		busy(5 * time.Millisecond)
		for i, n := range ovlChanSizes {
			q, err := c8.SendBytes(pattern(n, uint32(200+i)))
			if err != nil {
				return err
			}
			if err := q.Wait(ctx); err != nil {
				return fmt.Errorf("channel 8 send %d: %w", i, err)
			}
		}
	case 1:
		if _, err := t.Recv(ctx, 0, ovlTagCtl, ctl); err != nil {
			return err
		}
		chunks := 0
		for _, n := range ovlChanSizes {
			chunks += n/transport.ChannelChunkSize + 1
		}
		for engineOn() && t.OverlapTable().Unexpected < chunks {
			if ctx.Err() != nil {
				return fmt.Errorf("waiting for %d chunks: %w (table %+v)", chunks, ctx.Err(), t.OverlapTable())
			}
			if _, _, err := t.Iprobe(0, ovlTagCtl); err != nil {
				return err
			}
			runtime.Gosched()
		}
		busy(2 * time.Millisecond)
		c7, err := t.Channel(7, 0)
		if err != nil {
			return err
		}
		defer c7.Close()
		if err := ovlChanRecv(ctx, t, c7, 100, false); err != nil {
			return err
		}
		if err := ovlChanRecv(ctx, t, c8, 200, true); err != nil {
			return err
		}
		r.logf("channel messages arrived in order, late receiver and late sender")
		return ovlEngineBooks(r)
	}
	return nil
}

// ovlChanRecv receives ovlChanSizes on c, message i holding pattern seed+i.
// With late, it posts every receive first, tells the peer (tag
// ovlTagCtl), and computes before waiting.
func ovlChanRecv(ctx context.Context, t *transport.Transport, c *transport.Channel, seed int, late bool) error {
	bufs := make([][]byte, len(ovlChanSizes))
	reqs := make([]*transport.ChannelRequest, len(ovlChanSizes))
	for i, n := range ovlChanSizes {
		bufs[i] = make([]byte, n)
		q, err := c.RecvBytes(bufs[i])
		if err != nil {
			return err
		}
		reqs[i] = q
		if !late {
			if err := q.Wait(ctx); err != nil {
				return fmt.Errorf("channel %d recv %d (%d B): %w", c.ID(), i, n, err)
			}
		}
	}
	if late {
		if err := t.Send(ctx, c.Peer(), ovlTagCtl, []byte{1}); err != nil {
			return err
		}
		busy(20 * time.Millisecond)
	}
	for i, q := range reqs {
		if err := q.Wait(ctx); err != nil {
			return fmt.Errorf("channel %d recv %d (%d B): %w", c.ID(), i, ovlChanSizes[i], err)
		}
		if d := diff(bufs[i], pattern(ovlChanSizes[i], uint32(seed+i))); d != "" {
			return fmt.Errorf("channel %d message %d (%d B): %s", c.ID(), i, ovlChanSizes[i], d)
		}
	}
	return nil
}

// ovlMismatchSent is what the sender sends in every mismatched round of
// ovlChanMismatch: three full chunks and a short tail, so that a receive
// that fails early leaves up to three chunks (two of them rendezvous)
// behind.
const ovlMismatchSent = 3*transport.ChannelChunkSize + 100

// ovlMismatchRounds are the receives of ovlChanMismatch, each of a size
// other than ovlMismatchSent: more than the engine's 8 pool slots, so that
// leftover chunks that kept their slots would exhaust the pool.
var ovlMismatchRounds = func() []struct {
	size int
	late bool // posted once the engine has taken every chunk of the message
} {
	type round = struct {
		size int
		late bool
	}
	var rs []round
	for i := 0; i < 10; i++ {
		// Chunk 0 fails; chunks 1-3 come later (or were taken already).
		rs = append(rs, round{100, false})
	}
	for i := 0; i < 2; i++ {
		// Chunks 0 and 1 fit, chunk 2 fails; the tail waits in the table.
		rs = append(rs, round{2 * transport.ChannelChunkSize, true})
		// Chunk 0 fails; chunks 1-3 wait in the table.
		rs = append(rs, round{100, true})
	}
	return rs
}()

// ovlChanMismatch: rank 1 receives every message of ovlMismatchRounds on
// channel 9 into a buffer of the wrong size, then one message of the right
// size; rank 0 sends them one at a time, each when told. Every send must
// complete, every receive must fail with a size mismatch, the last message
// must arrive intact, and the engine must hold nothing at the end.
func ovlChanMismatch(ctx context.Context, r *rank) error {
	t := r.t
	c, err := t.Channel(9, 1-r.id())
	if err != nil {
		return err
	}
	defer c.Close()
	ctl := make([]byte, 1)
	// A transfer that hangs fails the rank with a message, not at its
	// time limit.
	wait := func(q *transport.ChannelRequest) error {
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		return q.Wait(wctx)
	}
	const final = 2*transport.ChannelChunkSize + 777
	switch r.id() {
	case 0:
		for i := 0; i <= len(ovlMismatchRounds); i++ {
			if _, err := t.Recv(ctx, 1, ovlTagCtl, ctl); err != nil {
				return err
			}
			n := ovlMismatchSent
			if i == len(ovlMismatchRounds) {
				n = final
			}
			q, err := c.SendBytes(pattern(n, uint32(300+i)))
			if err != nil {
				return err
			}
			if err := wait(q); err != nil {
				return fmt.Errorf("send %d (%d B): %w", i, n, err)
			}
		}
		r.logf("all %d sends completed", len(ovlMismatchRounds)+1)
	case 1:
		for i, rd := range ovlMismatchRounds {
			buf := make([]byte, rd.size)
			var q *transport.ChannelRequest
			if rd.late {
				// Earlier rounds' leftovers are gone (or this round's
				// chunks could not be counted).
				if err := ovlSettled(ctx, r, false); err != nil {
					return fmt.Errorf("before round %d: %w", i, err)
				}
			} else if q, err = c.RecvBytes(buf); err != nil {
				return err
			}
			if err := t.Send(ctx, 0, ovlTagCtl, ctl); err != nil {
				return err
			}
			if rd.late {
				if err := waitTaken(ctx, r, 0, ovlTagCtl, 4); err != nil {
					return fmt.Errorf("round %d: %w", i, err)
				}
				if q, err = c.RecvBytes(buf); err != nil {
					return err
				}
			}
			err := wait(q)
			var sm *transport.SizeMismatchError
			if !errors.As(err, &sm) {
				return fmt.Errorf("round %d: %d B sent, received into %d B: %v, want a size mismatch", i, ovlMismatchSent, rd.size, err)
			}
		}
		buf := make([]byte, final)
		q, err := c.RecvBytes(buf)
		if err != nil {
			return err
		}
		if err := t.Send(ctx, 0, ovlTagCtl, ctl); err != nil {
			return err
		}
		if err := wait(q); err != nil {
			return fmt.Errorf("message after %d mismatches: %w", len(ovlMismatchRounds), err)
		}
		if d := diff(buf, pattern(final, uint32(300+len(ovlMismatchRounds)))); d != "" {
			return fmt.Errorf("message after %d mismatches: %s", len(ovlMismatchRounds), d)
		}
		if err := ovlSettled(ctx, r, true); err != nil {
			return fmt.Errorf("after %d mismatches: %w", len(ovlMismatchRounds), err)
		}
		// Every round leaves at least the sender's short last chunk.
		if n := t.OverlapTable().Discarded; n < uint64(len(ovlMismatchRounds)) {
			return fmt.Errorf("%d leftover chunks discarded after %d mismatches, want at least one per mismatch", n, len(ovlMismatchRounds))
		}
		r.logf("%d size mismatches left nothing behind; the next message arrived intact", len(ovlMismatchRounds))
	}
	return nil
}

// ovlSettled waits (entering the transport, for up to 10 s) until the
// engine's tables and books are empty: with final, every check of
// ovlEngineBooks; otherwise the unexpected table only.
func ovlSettled(ctx context.Context, r *rank, final bool) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		var err error
		if final {
			err = ovlEngineBooksQuiet(r)
		} else if n := r.t.OverlapTable().Unexpected; n != 0 {
			err = fmt.Errorf("%d messages still in the engine's unexpected table", n)
		}
		if err == nil || time.Now().After(deadline) || ctx.Err() != nil {
			if final && err == nil {
				return ovlEngineBooks(r) // logs the counters
			}
			return err
		}
		if _, _, err := r.t.Iprobe(0, ovlTagCtl); err != nil {
			return err
		}
		time.Sleep(time.Millisecond)
	}
}

// ovlConfig is one way of running an overlap scenario: the engine on or
// off, and the transport's progress mode ("direct" or "queue").
type ovlConfig struct {
	engine   bool
	progress string
}

func (c ovlConfig) name() string {
	s := "engine-off"
	if c.engine {
		s = "engine-on"
	}
	if c.progress != "direct" {
		s += "-" + c.progress
	}
	return s
}

// ovlConfigs are the configurations every overlap scenario runs in: the
// engine off and on in direct progress mode, and the engine on in queue
// mode, where every worker call goes through the progress goroutine.
var ovlConfigs = []ovlConfig{{false, "direct"}, {true, "direct"}, {true, "queue"}}

// launchOvl runs role over tls in configuration c; slots >= 0 sets the
// engine's prefetch pool size.
func launchOvl(t *testing.T, role, tls string, c ovlConfig, slots int) {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	engine := "off"
	if c.engine {
		engine = "on"
	}
	ctx, cancel := context.WithTimeout(context.Background(), rankTimeout+10*time.Second)
	defer cancel()
	var stdout, stderr syncBuffer
	env := []string{roleEnv + "=" + role, progressEnv + "=" + c.progress, transport.OverlapEnv + "=" + engine}
	if slots >= 0 {
		env = append(env, fmt.Sprintf("%s=%d", transport.OverlapSlotsEnv, slots))
	}
	err = bootstrap.Launch(ctx, bootstrap.LaunchConfig{N: 2, Program: exe, Env: env, TLS: tls,
		Stdout: &stdout, Stderr: &stderr, Grace: 15 * time.Second})
	res := jobResult{err: err, stdout: stdout.String(), stderr: stderr.String()}
	if err != nil {
		t.Fatalf("job failed:\n%s", res.dump())
	}
	for r := 0; r < 2; r++ {
		if !strings.Contains(res.stdout, okLine(role, r)) {
			t.Fatalf("rank %d did not report success:\n%s", r, res.dump())
		}
	}
	checkTLS(t, res, 2, cfg{tls, c.progress})
	if testing.Verbose() {
		t.Logf("output:\n%s", res.stdout)
	}
}

// forOverlap runs f over TCP and shared memory in every configuration of
// ovlConfigs whose engine setting engineOnly allows (engineOnly: only the
// configurations with the engine on).
func forOverlap(t *testing.T, engineOnly bool, f func(t *testing.T, tls string, c ovlConfig)) {
	for _, tls := range []string{"tcp", "shm"} {
		for _, c := range ovlConfigs {
			if engineOnly && !c.engine {
				continue
			}
			t.Run(tls+"/"+c.name(), func(t *testing.T) { f(t, tls, c) })
		}
	}
}

func TestOverlapLateReceiver(t *testing.T) {
	forOverlap(t, false, func(t *testing.T, tls string, c ovlConfig) { launchOvl(t, "ovl-late-receiver", tls, c, -1) })
}

func TestOverlapLateSender(t *testing.T) {
	forOverlap(t, false, func(t *testing.T, tls string, c ovlConfig) { launchOvl(t, "ovl-late-sender", tls, c, -1) })
}

// TestOverlapChannel: channel messages, late receiver and late sender, go
// through the engine and arrive intact and in order.
func TestOverlapChannel(t *testing.T) {
	forOverlap(t, false, func(t *testing.T, tls string, c ovlConfig) { launchOvl(t, "ovl-channel", tls, c, -1) })
}

// TestOverlapPoolFull: a 2-slot prefetch pool never loses or duplicates a
// message when more unexpected messages arrive than it holds.
func TestOverlapPoolFull(t *testing.T) {
	forOverlap(t, false, func(t *testing.T, tls string, c ovlConfig) { launchOvl(t, "ovl-pool-full", tls, c, ovlPoolSlots) })
}

// TestOverlapChannelMismatch: repeated channel size mismatches with the
// engine on leave nothing behind. The sender's leftover chunks of each
// failed receive are discarded (prefetched ones give their slot back), the
// sender's transfers complete, and a following message of the right size
// arrives intact.
func TestOverlapChannelMismatch(t *testing.T) {
	forOverlap(t, true, func(t *testing.T, tls string, c ovlConfig) { launchOvl(t, "ovl-chan-mismatch", tls, c, -1) })
}
