package integration

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/transport"
)

func init() { scenarios["anysource"] = anySource }

// anySource runs anySourceParts, then windows between ranks 0 and 1 whose
// receives all name AnySource, OSU bandwidth style: rank 1 has 64 large
// receives waiting in the software matcher at once, rank 0 sends 64
// messages that each wait for rank 1 to take them (by CMA over shared
// memory), then waits for an acknowledgement, itself an any-source
// receive. Each receive has a buffer of its own (the race detector runs
// these tests).
func anySource(ctx context.Context, r *rank) error {
	if err := anySourceParts(ctx, r); err != nil {
		return err
	}
	if err := anySourceTyped(ctx, r); err != nil {
		return fmt.Errorf("typed: %w", err)
	}
	if err := typedProbes(ctx, r); err != nil {
		return fmt.Errorf("typed probes: %w", err)
	}
	if err := typedSwap(r); err != nil {
		return fmt.Errorf("typed swap: %w", err)
	}
	t := r.t
	if r.id() > 1 {
		return nil
	}
	const rounds, window, size = 5, 64, 64 << 10
	bufs := make([][]byte, window)
	for i := range bufs {
		bufs[i] = make([]byte, size)
	}
	reqs := make([]*transport.Request, window)
	ack := make([]byte, 1)
	for round := 0; round < rounds; round++ {
		for i := range reqs {
			var err error
			if r.id() == 0 {
				reqs[i], err = t.Isend(1, 8, pattern(size, uint32(round*window+i)))
			} else {
				reqs[i], err = t.Irecv(transport.AnySource, 8, bufs[i])
			}
			if err != nil {
				return err
			}
		}
		for i, q := range reqs {
			if _, err := q.Wait(ctx); err != nil {
				return fmt.Errorf("window %d, message %d: %w", round, i, err)
			}
			if r.id() == 1 {
				if d := diff(bufs[i], pattern(size, uint32(round*window+i))); d != "" {
					return fmt.Errorf("window %d, message %d: %s", round, i, d)
				}
			}
		}
		var err error
		if r.id() == 0 {
			_, err = t.Recv(ctx, transport.AnySource, 9, ack)
		} else {
			err = t.Send(ctx, 0, 9, ack)
		}
		if err != nil {
			return fmt.Errorf("window %d acknowledgement: %w", round, err)
		}
	}
	if r.id() == 1 {
		r.logf("%d windows of %d any-source receives of %d B", rounds, window, size)
	}
	return nil
}

// typedSwap: ranks 0 and 1 swap a column of 64 float64s, 8 times, each
// posting IrecvTyped then IsendTyped and waiting for the receive, then the
// send, with context.Background(): the small requests start lazily, the
// one waited for in the waiting goroutine (docs/noncontig.md, "Nonblocking
// typed calls"), and the send not waited for yet must run too for the peer
// to finish. Every request is counted once, inline or started. The rank's
// own timeout (the harness kills it) bounds a hang.
func typedSwap(r *rank) error {
	if r.id() > 1 {
		return nil
	}
	const rounds, rows = 8, 64
	col, err := datatype.Vector(rows, 1, 4, datatype.Float64) // a column of a rows x 4 matrix
	if err != nil {
		return err
	}
	t, peer := r.t, 1-r.id()
	before := t.NoncontigStats()
	for round := 0; round < rounds; round++ {
		send := pattern(int(col.Extent()), uint32(round*10+r.id()))
		got := make([]byte, col.Extent())
		rq, err := t.IrecvTyped(peer, 12, got, col, 1)
		if err != nil {
			return err
		}
		sq, err := t.IsendTyped(peer, 12, send, col, 1)
		if err != nil {
			return err
		}
		if _, err := rq.Wait(context.Background()); err != nil {
			return fmt.Errorf("round %d receive: %w", round, err)
		}
		if _, err := sq.Wait(context.Background()); err != nil {
			return fmt.Errorf("round %d send: %w", round, err)
		}
		want := pattern(int(col.Extent()), uint32(round*10+peer))
		for i := 0; i < rows; i++ {
			if d := diff(got[32*i:32*i+8], want[32*i:32*i+8]); d != "" {
				return fmt.Errorf("round %d, row %d: %s", round, i, d)
			}
			if i < rows-1 && !bytes.Equal(got[32*i+8:32*i+32], make([]byte, 24)) {
				return fmt.Errorf("round %d: the gap after row %d was written", round, i)
			}
		}
	}
	after := t.NoncontigStats()
	inline := after.NonblockingInline - before.NonblockingInline
	started := after.NonblockingStarted - before.NonblockingStarted
	if inline+started != 2*rounds {
		return fmt.Errorf("%d requests run inline and %d started, want %d in all", inline, started, 2*rounds)
	}
	r.logf("typed swap: %d of %d nonblocking typed requests ran in their Wait", inline, 2*rounds)
	return nil
}

// anySourceTyped: ranks 1 and 2 each send typedAnyN vectors (64 blocks of
// 1 KiB, 2 KiB apart) to rank 0, which receives them with any-source typed
// receives, two posted ahead, into a contiguous layout of the same
// signature, and checks each sender's messages came whole and in order.
func anySourceTyped(ctx context.Context, r *rank) error {
	const typedAnyN = 6
	vec, err := datatype.Vector(64, 128, 256, datatype.Float64)
	if err != nil {
		return err
	}
	contig, err := datatype.Contiguous(64*128, datatype.Float64)
	if err != nil {
		return err
	}
	t := r.t
	span := int(vec.Extent())
	if r.id() != 0 {
		for i := 0; i < typedAnyN; i++ {
			if err := t.SendTyped(ctx, 0, 10, pattern(span, uint32(r.id()*100+i)), vec, 1); err != nil {
				return fmt.Errorf("typed send %d: %w", i, err)
			}
		}
		return nil
	}
	const ahead = 2
	var q []*transport.Request
	var bufs [][]byte
	post := func() error {
		b := make([]byte, 64*1024)
		req, err := t.IrecvTyped(transport.AnySource, 10, b, contig, 1)
		if err != nil {
			return err
		}
		q, bufs = append(q, req), append(bufs, b)
		return nil
	}
	for i := 0; i < ahead; i++ {
		if err := post(); err != nil {
			return err
		}
	}
	next := map[int]int{}
	want := make([]byte, 64*1024)
	for got := 0; got < 2*typedAnyN; got++ {
		st, err := q[0].Wait(ctx)
		if err != nil {
			return fmt.Errorf("any-source typed receive %d: %w", got, err)
		}
		i := next[st.Source]
		if st.Source < 1 || st.Source > 2 || i >= typedAnyN {
			return fmt.Errorf("typed receive %d: status %+v: no such message", got, st)
		}
		if _, err := vec.Pack(want, pattern(span, uint32(st.Source*100+i)), 0, 1); err != nil {
			return err
		}
		if d := diff(bufs[0], want); d != "" {
			return fmt.Errorf("typed receive %d: rank %d's message %d: %s (out of order or damaged)", got, st.Source, i, d)
		}
		next[st.Source]++
		q, bufs = q[1:], bufs[1:]
		if got+ahead < 2*typedAnyN {
			if err := post(); err != nil {
				return err
			}
		}
	}
	r.logf("%d typed messages from ranks 1 and 2 through any-source typed receives", 2*typedAnyN)
	return nil
}

// typedProbes: ranks 1 and 2 each send typedProbeN typed messages of 1 to
// 3 vectors (16 blocks of 1 KiB, 2 KiB apart: 16 to 48 KiB of data, inline
// in the RTS or not) to rank 0, which does not know the counts: it probes
// each message from any rank (a blocking and a non-blocking matched typed
// probe, and a plain typed probe followed by a receive from the rank it
// names, in turn), counts its float64s, and receives it into a contiguous
// buffer of that size, checking each sender's messages came whole and in
// order.
func typedProbes(ctx context.Context, r *rank) error {
	const typedProbeN = 6
	vec, err := datatype.Vector(16, 128, 256, datatype.Float64)
	if err != nil {
		return err
	}
	t := r.t
	span := int(vec.Extent())
	count := func(i int) int { return 1 + i%3 }
	if r.id() != 0 {
		for i := 0; i < typedProbeN; i++ {
			n := count(i + r.id())
			if err := t.SendTyped(ctx, 0, 11, pattern(n*span, uint32(r.id()*100+i)), vec, n); err != nil {
				return fmt.Errorf("typed send %d: %w", i, err)
			}
		}
		return nil
	}
	next := map[int]int{}
	for got := 0; got < 2*typedProbeN; got++ {
		var m *transport.TypedMessage
		var st transport.Status
		switch got % 3 {
		case 0:
			if m, err = t.MprobeTyped(ctx, transport.AnySource, 11); err != nil {
				return fmt.Errorf("MprobeTyped %d: %w", got, err)
			}
		case 1:
			for m == nil {
				var ok bool
				if m, ok, err = t.ImprobeTyped(transport.AnySource, 11); err != nil {
					return fmt.Errorf("ImprobeTyped %d: %w", got, err)
				}
				if !ok && ctx.Err() != nil {
					return fmt.Errorf("ImprobeTyped %d found nothing: %w", got, ctx.Err())
				}
			}
		default:
			// Probe without taking, then receive from the rank it names.
			if st, err = t.ProbeTyped(ctx, transport.AnySource, 11); err != nil {
				return fmt.Errorf("ProbeTyped %d: %w", got, err)
			}
		}
		if m != nil {
			st = m.Status()
		}
		i := next[st.Source]
		if st.Source < 1 || st.Source > 2 || i >= typedProbeN {
			return fmt.Errorf("probe %d: status %+v: no such message", got, st)
		}
		n := count(i + st.Source)
		elems := st.Size / 8
		if st.Size%8 != 0 || elems != n*16*128 {
			return fmt.Errorf("probe %d: rank %d's message %d: %d bytes, want %d float64s", got, st.Source, i, st.Size, n*16*128)
		}
		if m != nil {
			if c, ok := m.Count(datatype.Float64); !ok || c != elems {
				return fmt.Errorf("probe %d: Count = %d, %v; want %d", got, c, ok, elems)
			}
		}
		buf := make([]byte, 8*elems)
		if m != nil {
			_, err = m.Recv(ctx, buf, datatype.Float64, elems)
		} else {
			_, err = t.RecvTyped(ctx, st.Source, 11, buf, datatype.Float64, elems)
		}
		if err != nil {
			return fmt.Errorf("probed message %d: %w", got, err)
		}
		want := make([]byte, len(buf))
		if _, err := vec.Pack(want, pattern(n*span, uint32(st.Source*100+i)), 0, int64(n)); err != nil {
			return err
		}
		if d := diff(buf, want); d != "" {
			return fmt.Errorf("probed message %d: rank %d's message %d: %s (out of order or damaged)", got, st.Source, i, d)
		}
		next[st.Source]++
	}
	r.logf("%d typed messages of unknown size from ranks 1 and 2 through matched typed probes and typed probes", 2*typedProbeN)
	return nil
}

// anySourceN messages go from each worker to rank 0; every third one is
// large enough to travel by rendezvous (by cross-memory attach over shared
// memory), the others are eager.
const anySourceN = 60

func anySourceSize(i int) int {
	if i%3 == 2 {
		return 1 << 20
	}
	return 8 + i%50
}

// anySource: ranks 1 and 2 send to rank 0, which receives everything with
// any-source receives (a window of them posted ahead) and checks that each
// worker's messages came intact and in the order sent. Then the order of
// posting: rank 0 posts an any-source receive and, behind it, an exact one
// from rank 1 for the same tag; rank 1's first message must go to the
// any-source receive, its second to the exact one. Then rank 2's messages
// with another tag are received through matched probes (Mprobe, then the
// Message's Recv into a buffer of the probed size). Last, a window of
// any-source receives takes a window of large sends that rank 2 has all in
// flight at once.
func anySourceParts(ctx context.Context, r *rank) error {
	t := r.t
	if r.id() != 0 {
		for i := 0; i < anySourceN; i++ {
			if err := t.Send(ctx, 0, 3, pattern(anySourceSize(i), uint32(r.id()*1000+i))); err != nil {
				return fmt.Errorf("send %d: %w", i, err)
			}
		}
		if r.id() == 1 {
			if err := r.b.Barrier(ctx, "anysource.posted"); err != nil {
				return err
			}
			for _, m := range []string{"first", "second"} {
				if err := t.Send(ctx, 0, 4, []byte(m)); err != nil {
					return err
				}
			}
			return r.b.Barrier(ctx, "anysource.window")
		}
		if err := r.b.Barrier(ctx, "anysource.posted"); err != nil {
			return err
		}
		for i := 0; i < mprobeN; i++ {
			if err := t.Send(ctx, 0, 6, pattern(anySourceSize(i), uint32(5000+i))); err != nil {
				return fmt.Errorf("send %d with tag 6: %w", i, err)
			}
		}
		// A window of large sends, all in flight before any completes
		// (over shared memory each waits for rank 0 to read it).
		if err := r.b.Barrier(ctx, "anysource.window"); err != nil {
			return err
		}
		reqs := make([]*transport.Request, windowN)
		for i := range reqs {
			var err error
			if reqs[i], err = t.Isend(0, 7, pattern(windowSize, uint32(7000+i))); err != nil {
				return err
			}
		}
		for i, q := range reqs {
			if _, err := q.Wait(ctx); err != nil {
				return fmt.Errorf("window send %d: %w", i, err)
			}
		}
		return nil
	}
	before := t.AnySourceStats()
	const window = 8
	var q []*transport.Request
	var bufs [][]byte
	post := func() error {
		b := make([]byte, 1<<20)
		req, err := t.Irecv(transport.AnySource, 3, b)
		if err != nil {
			return err
		}
		q, bufs = append(q, req), append(bufs, b)
		return nil
	}
	total := 2 * anySourceN
	for i := 0; i < window; i++ {
		if err := post(); err != nil {
			return err
		}
	}
	next := map[int]int{}
	for got := 0; got < total; got++ {
		st, err := q[0].Wait(ctx)
		if err != nil {
			return fmt.Errorf("any-source receive %d: %w", got, err)
		}
		i := next[st.Source]
		if st.Source < 1 || st.Source > 2 || i >= anySourceN {
			return fmt.Errorf("receive %d: status %+v: no such message", got, st)
		}
		if d := diff(bufs[0][:st.Size], pattern(anySourceSize(i), uint32(st.Source*1000+i))); d != "" {
			return fmt.Errorf("receive %d: rank %d's message %d: %s (out of order or damaged)", got, st.Source, i, d)
		}
		next[st.Source]++
		q, bufs = q[1:], bufs[1:]
		if got+window < total {
			if err := post(); err != nil {
				return err
			}
		}
	}
	r.logf("%d messages from ranks 1 and 2 through any-source receives, in order per sender", total)
	wb, eb := make([]byte, 8), make([]byte, 8)
	w, err := t.Irecv(transport.AnySource, 4, wb)
	if err != nil {
		return err
	}
	e, err := t.Irecv(1, 4, eb)
	if err != nil {
		return err
	}
	if err := r.b.Barrier(ctx, "anysource.posted"); err != nil {
		return err
	}
	st, err := w.Wait(ctx)
	if err != nil || st.Source != 1 || string(wb[:st.Size]) != "first" {
		return fmt.Errorf("any-source receive posted first: %+v %q %v, want rank 1's \"first\"", st, wb[:st.Size], err)
	}
	st, err = e.Wait(ctx)
	if err != nil || string(eb[:st.Size]) != "second" {
		return fmt.Errorf("exact receive posted behind it: %q %v, want \"second\"", eb[:st.Size], err)
	}
	if s := t.AnySourceStats(); s.InUCX == before.InUCX {
		return fmt.Errorf("the any-source receive posted before its message was sent was not matched in UCX: %+v", s)
	}
	r.logf("receives matched in the order posted")
	// Matched probes: each message's size is learnt first and the receive
	// buffer made to fit (large ones are CMA descriptors taken out of UCX
	// by the probe over shared memory).
	for i := 0; i < mprobeN; i++ {
		m, err := t.Mprobe(ctx, transport.AnySource, 6)
		if err != nil {
			return fmt.Errorf("matched probe %d: %w", i, err)
		}
		st := m.Status()
		buf := make([]byte, st.Size)
		if _, err := m.Recv(ctx, buf); err != nil {
			return fmt.Errorf("receiving probed message %d (%+v): %w", i, st, err)
		}
		if d := diff(buf, pattern(anySourceSize(i), uint32(5000+i))); st.Source != 2 || d != "" {
			return fmt.Errorf("probed message %d from rank %d: %s", i, st.Source, d)
		}
	}
	r.logf("%d messages received through matched probes", mprobeN)
	// A window of any-source receives, all posted before rank 2 sends.
	wreqs := make([]*transport.Request, windowN)
	wbufs := make([][]byte, windowN)
	for i := range wreqs {
		wbufs[i] = make([]byte, windowSize)
		if wreqs[i], err = t.Irecv(transport.AnySource, 7, wbufs[i]); err != nil {
			return err
		}
	}
	if err := r.b.Barrier(ctx, "anysource.window"); err != nil {
		return err
	}
	for i, q := range wreqs {
		st, err := q.Wait(ctx)
		if err != nil {
			return fmt.Errorf("window receive %d: %w", i, err)
		}
		if d := diff(wbufs[i][:st.Size], pattern(windowSize, uint32(7000+i))); st.Source != 2 || d != "" {
			return fmt.Errorf("window receive %d from rank %d: %s", i, st.Source, d)
		}
	}
	r.logf("a window of %d any-source receives of %d B", windowN, windowSize)
	s := t.AnySourceStats()
	inUCX, arrived := s.InUCX-before.InUCX, s.Arrived-before.Arrived
	if want := int64(2*anySourceN + 1 + windowN); inUCX+arrived != want {
		return fmt.Errorf("any-source receives counted %d in UCX + %d arrived first, want %d in all", inUCX, arrived, want)
	}
	r.logf("any-source receives matched in UCX: %d, after arrival: %d", inUCX, arrived)
	return nil
}

// A window of windowN messages of windowSize bytes from rank 2 to rank 0.
const (
	windowN    = 16
	windowSize = 256 << 10
)

// mprobeN messages go from rank 2 to rank 0 through matched probes.
const mprobeN = 9

// TestAnySource runs the any-source scenario between real processes over
// TCP and shared memory (large messages by cross-memory attach), in both
// progress modes, with the overlap engine off and on (on, large messages
// that arrive early wait in its prefetch slots, out of UCX's queue).
func TestAnySource(t *testing.T) {
	for _, engine := range []string{"off", "on"} {
		t.Run("engine-"+engine, func(t *testing.T) {
			t.Setenv(transport.OverlapEnv, engine)
			forTLS(t, func(t *testing.T, c cfg) {
				res := runJob(t, "anysource", 3, c)
				for _, line := range []string{"through any-source receives, in order per sender", "receives matched in the order posted", "received through matched probes", "a window of 16 any-source receives", "5 windows of 64 any-source receives", "through any-source typed receives", "through matched typed probes"} {
					if !strings.Contains(res.stdout, line) {
						t.Fatalf("rank 0 did not report %q:\n%s", line, res.dump())
					}
				}
			})
		})
	}
}
