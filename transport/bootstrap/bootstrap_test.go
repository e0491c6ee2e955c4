package bootstrap

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// testTimeout bounds every test's collectives so a bug fails instead of hanging.
const testTimeout = 20 * time.Second

func newTestServer(t *testing.T, size int) (*Server, Token, *observer.ObservedLogs) {
	t.Helper()
	tok, err := NewToken()
	require.NoError(t, err)
	core, logs := observer.New(zapcore.DebugLevel)
	s, err := NewServer(size, tok, zap.New(core))
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s, tok, logs
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	t.Cleanup(cancel)
	return ctx
}

// joinAll dials ranks 0..size-1 concurrently.
func joinAll(t *testing.T, ctx context.Context, s *Server, tok Token, size int) []Bootstrapper {
	t.Helper()
	bs := make([]Bootstrapper, size)
	errs := make([]error, size)
	var wg sync.WaitGroup
	for r := range size {
		wg.Go(func() { bs[r], errs[r] = Dial(ctx, s.Addr(), tok, r, size) })
	}
	wg.Wait()
	for r := range size {
		require.NoError(t, errs[r], "rank %d", r)
		t.Cleanup(func() { bs[r].Close() })
	}
	return bs
}

func TestTokenRoundTrip(t *testing.T) {
	a, err := NewToken()
	require.NoError(t, err)
	b, err := NewToken()
	require.NoError(t, err)
	assert.NotEqual(t, a, b)
	assert.False(t, a.IsZero())
	s := a.String()
	assert.Len(t, s, 32)
	got, err := ParseToken(s)
	require.NoError(t, err)
	assert.Equal(t, a, got)
	got, err = ParseToken(strings.ToUpper(s))
	require.NoError(t, err)
	assert.Equal(t, a, got)

	for _, bad := range []string{"", "abc", s[:31], s + "0", "zz" + s[2:]} {
		_, err := ParseToken(bad)
		assert.Error(t, err, "%q", bad)
	}
}

// rawExchange connects to the rendezvous at addr, writes b as it is and
// returns the server's answer.
func rawExchange(t *testing.T, addr string, b []byte) *frame {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	_, err = c.Write(b)
	require.NoError(t, err)
	f, err := readFrame(c)
	require.NoError(t, err)
	return f
}

func TestJoinRejected(t *testing.T) {
	const size = 3
	s, tok, logs := newTestServer(t, size)
	ctx := testCtx(t)
	other, err := NewToken()
	require.NoError(t, err)

	_, err = Dial(ctx, s.Addr(), other, 0, size)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "wrong job token")

	_, err = Dial(ctx, s.Addr(), Token{}, 0, size)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "wrong job token")

	_, err = Dial(ctx, s.Addr(), tok, size, size)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "rank 3 out of range [0,3)")

	_, err = Dial(ctx, s.Addr(), tok, -1, size)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "out of range")

	_, err = Dial(ctx, s.Addr(), tok, 0, size+1)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "job size mismatch")

	b1, err := Dial(ctx, s.Addr(), tok, 1, size)
	require.NoError(t, err)
	defer b1.Close()
	_, err = Dial(ctx, s.Addr(), tok, 1, size)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "rank 1 already joined")

	// A join frame without any token (not producible through Dial).
	b, err := encodeFrame(&frame{Op: opJoin, Version: protocolVersion, Rank: 0, Size: size})
	require.NoError(t, err)
	f := rawExchange(t, s.Addr(), b)
	assert.Equal(t, opError, f.Op)
	assert.Contains(t, f.Error, "missing job token")

	// An oversize frame is refused without reading it.
	f = rawExchange(t, s.Addr(), []byte{0x7f, 0xff, 0xff, 0xff})
	assert.Contains(t, f.Error, "frame too large")

	// A first frame longer than a join is refused before the token is
	// checked, without allocating its announced length (16 MiB would be
	// within MaxFrameSize).
	f = rawExchange(t, s.Addr(), []byte{0x01, 0x00, 0x00, 0x00, '{'})
	assert.Contains(t, f.Error, "frame too large")

	// A join whose field has the wrong type is rejected with a reason, not
	// dropped in silence.
	bad := fmt.Sprintf(`{"op":"join","version":1,"token":%q,"rank":"0","size":3}`, tok)
	f = rawExchange(t, s.Addr(), append([]byte{0, 0, 0, byte(len(bad))}, bad...))
	assert.Equal(t, opError, f.Op)
	assert.Contains(t, f.Error, "malformed frame")

	rejected := logs.FilterMessage("rendezvous join rejected")
	reasons := []string{}
	for _, e := range rejected.All() {
		assert.Equal(t, zapcore.WarnLevel, e.Level)
		reasons = append(reasons, e.ContextMap()["reason"].(string))
	}
	joined := strings.Join(reasons, "\n")
	for _, want := range []string{"wrong job token", "out of range", "job size mismatch", "already joined", "missing job token", "frame too large", "malformed frame"} {
		assert.Contains(t, joined, want)
	}
	assert.Len(t, reasons, 10)

	// The rejected attempts did not consume ranks: 0 and 2 can still join.
	var wg sync.WaitGroup
	for _, r := range []int{0, 2} {
		wg.Go(func() {
			b, err := Dial(ctx, s.Addr(), tok, r, size)
			if assert.NoError(t, err) {
				assert.NoError(t, b.Barrier(ctx, "all"))
				b.Close()
			}
		})
	}
	assert.NoError(t, b1.Barrier(ctx, "all"))
	wg.Wait()
}

func TestCollectives(t *testing.T) {
	const size = 5
	s, tok, _ := newTestServer(t, size)
	ctx := testCtx(t)
	bs := joinAll(t, ctx, s, tok, size)

	var wg sync.WaitGroup
	for r, b := range bs {
		wg.Go(func() {
			assert.Equal(t, r, b.Rank())
			assert.Equal(t, size, b.Size())
			for iter := range 20 {
				vals, err := b.AllGather(ctx, "addr", fmt.Appendf(nil, "rank%d-iter%d", r, iter))
				if !assert.NoError(t, err) {
					return
				}
				require.Len(t, vals, size)
				for i, v := range vals {
					assert.Equal(t, fmt.Sprintf("rank%d-iter%d", i, iter), string(v))
				}
				// Same name, reused: a barrier per iteration.
				if !assert.NoError(t, b.Barrier(ctx, "step")) {
					return
				}
			}
			// An empty value comes back as nil.
			vals, err := b.AllGather(ctx, "empty", nil)
			assert.NoError(t, err)
			assert.Equal(t, make([][]byte, size), vals)
		})
	}
	wg.Wait()
}

func TestConcurrentCollectivesDifferentKeys(t *testing.T) {
	const size = 3
	s, tok, _ := newTestServer(t, size)
	ctx := testCtx(t)
	bs := joinAll(t, ctx, s, tok, size)
	var wg sync.WaitGroup
	for r, b := range bs {
		for k := range 4 {
			wg.Go(func() {
				key := fmt.Sprintf("k%d", k)
				vals, err := b.AllGather(ctx, key, fmt.Appendf(nil, "%d/%d", r, k))
				if assert.NoError(t, err) {
					for i, v := range vals {
						assert.Equal(t, fmt.Sprintf("%d/%d", i, k), string(v))
					}
				}
			})
		}
	}
	wg.Wait()
}

// waitFor polls the observed logs until n messages contain msg (an event
// the server logs, so this synchronises on that event, not on time).
func waitFor(t *testing.T, logs *observer.ObservedLogs, msg string, n int) {
	t.Helper()
	deadline := time.Now().Add(testTimeout)
	for logs.FilterMessageSnippet(msg).Len() < n {
		if time.Now().After(deadline) {
			t.Fatalf("log %q never appeared", msg)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestRankLostMidCollective(t *testing.T) {
	const size = 4
	s, tok, logs := newTestServer(t, size)
	ctx := testCtx(t)
	bs := joinAll(t, ctx, s, tok, size)

	// Ranks 0, 1 and 3 enter the barrier; rank 2 never does and, once the
	// server holds the three contributions, its connection dies (a raw
	// close, like a crash).
	errs := make([]error, size)
	var wg sync.WaitGroup
	for _, r := range []int{0, 1, 3} {
		wg.Go(func() { errs[r] = bs[r].Barrier(ctx, "never") })
	}
	waitFor(t, logs, "collective contribution", 3)
	bs[2].(*client).conn.Close()
	wg.Wait()
	waitFor(t, logs, "rank lost", 1)
	lostLog := logs.FilterMessage("rank lost").All()[0].ContextMap()
	assert.Equal(t, int64(2), lostLog["rank"])
	assert.Equal(t, int64(1), lostLog["failed_collectives"], "the barrier was pending when rank 2 died")
	for _, r := range []int{0, 1, 3} {
		var lost *RankLostError
		require.ErrorAs(t, errs[r], &lost, "rank %d", r)
		assert.Equal(t, 2, lost.Rank)
		assert.Equal(t, "never", lost.Collective)
		assert.Contains(t, errs[r].Error(), "rank 2 disconnected")
	}
	// Later collectives fail at once, naming the same rank.
	_, err := bs[0].AllGather(ctx, "later", []byte("x"))
	var lost *RankLostError
	require.ErrorAs(t, err, &lost)
	assert.Equal(t, 2, lost.Rank)
}

func TestOrderlyCloseMidCollective(t *testing.T) {
	const size = 3
	s, tok, logs := newTestServer(t, size)
	ctx := testCtx(t)
	bs := joinAll(t, ctx, s, tok, size)
	errs := make([]error, size)
	var wg sync.WaitGroup
	for _, r := range []int{0, 2} {
		wg.Go(func() { _, errs[r] = bs[r].AllGather(ctx, "addr", []byte{byte(r)}) })
	}
	require.NoError(t, bs[1].Close())
	wg.Wait()
	waitFor(t, logs, "rank left", 1)
	for _, r := range []int{0, 2} {
		var lost *RankLostError
		require.ErrorAs(t, errs[r], &lost, "rank %d", r)
		assert.Equal(t, 1, lost.Rank)
	}
	// Collectives on a closed client fail cleanly.
	_, err := bs[1].AllGather(ctx, "x", nil)
	assert.ErrorIs(t, err, ErrClosed)
}

// lostNotices subscribes to b's lost-rank notices.
func lostNotices(b Bootstrapper) <-chan lostNotice {
	ch := make(chan lostNotice, 8)
	b.(LossNotifier).NotifyLost(func(rank int, reason string) { ch <- lostNotice{rank, reason} })
	return ch
}

// nextNotice waits for a notice on ch.
func nextNotice(t *testing.T, ch <-chan lostNotice) lostNotice {
	t.Helper()
	select {
	case n := <-ch:
		return n
	case <-time.After(testTimeout):
		t.Fatal("no lost-rank notice")
		return lostNotice{}
	}
}

// Every connected rank is told of a rank whose connection ends without a
// goodbye, with no collective pending; a subscriber that comes later is
// told too.
func TestLostNoticeWithoutCollective(t *testing.T) {
	const size = 3
	s, tok, logs := newTestServer(t, size)
	ctx := testCtx(t)
	bs := joinAll(t, ctx, s, tok, size)
	chs := []<-chan lostNotice{lostNotices(bs[0]), lostNotices(bs[1])}
	bs[2].(*client).conn.Close() // a crash: no goodbye
	for r, ch := range chs {
		n := nextNotice(t, ch)
		assert.Equal(t, 2, n.rank, "rank %d", r)
		assert.Contains(t, n.reason, "without goodbye", "rank %d", r)
	}
	waitFor(t, logs, "rank lost", 1)
	late := nextNotice(t, lostNotices(bs[0]))
	assert.Equal(t, 2, late.rank)
}

// A rank that leaves in order (Close) is not reported lost.
func TestNoLostNoticeOnOrderlyClose(t *testing.T) {
	const size = 3
	s, tok, logs := newTestServer(t, size)
	ctx := testCtx(t)
	bs := joinAll(t, ctx, s, tok, size)
	ch := lostNotices(bs[0])
	require.NoError(t, bs[2].Close())
	waitFor(t, logs, "rank left", 1)
	bs[1].(*client).conn.Close()
	// Frames from the server arrive in order: a notice of rank 2 would
	// have come first.
	assert.Equal(t, 1, nextNotice(t, ch).rank)
}

// rankExited (the launcher saw the process exit) reports a rank whose
// connection stays open (a descendant holding the socket) within
// exitGoodbye, and returns once the notices are out; one that said
// goodbye is not reported, and one that never joined is.
func TestRankExitedNotices(t *testing.T) {
	const size = 4
	s, tok, _ := newTestServer(t, size)
	ctx := testCtx(t)
	bs := make([]Bootstrapper, 3)
	var wg sync.WaitGroup
	for r := range 3 {
		wg.Go(func() {
			var err error
			bs[r], err = Dial(ctx, s.Addr(), tok, r, size)
			assert.NoError(t, err)
		})
	}
	wg.Wait()
	for _, b := range bs {
		require.NotNil(t, b)
		t.Cleanup(func() { b.Close() })
	}
	ch := lostNotices(bs[0])

	require.NoError(t, bs[1].Close()) // said goodbye, then exited
	s.rankExited(1)
	s.rankExited(3) // never joined
	n := nextNotice(t, ch)
	assert.Equal(t, 3, n.rank)
	assert.Contains(t, n.reason, "before it joined")

	start := time.Now()
	s.rankExited(2) // "exited", its connection still open
	assert.GreaterOrEqual(t, time.Since(start), exitGoodbye)
	select {
	case n := <-ch: // written before rankExited returned
		assert.Equal(t, 2, n.rank)
	case <-time.After(testTimeout):
		t.Fatal("rank 2 not reported lost")
	}
	select {
	case n := <-ch:
		t.Fatalf("unexpected notice %+v", n)
	default:
	}
}

func TestContextDeadlineHonoured(t *testing.T) {
	const size = 2
	s, tok, _ := newTestServer(t, size)
	ctx := testCtx(t)
	b0, err := Dial(ctx, s.Addr(), tok, 0, size)
	require.NoError(t, err)
	defer b0.Close()
	// Rank 1 never joins: the barrier must end with the context.
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	err = b0.Barrier(short, "b")
	assert.ErrorIs(t, err, context.DeadlineExceeded)

	// Dial to a listener that never answers also honours the context.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	short2, cancel2 := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel2()
	_, err = Dial(short2, ln.Addr().String(), tok, 0, size)
	assert.ErrorIs(t, err, context.DeadlineExceeded)
}

func TestServerCloseFailsClients(t *testing.T) {
	const size = 2
	s, tok, _ := newTestServer(t, size)
	ctx := testCtx(t)
	b0, err := Dial(ctx, s.Addr(), tok, 0, size)
	require.NoError(t, err)
	defer b0.Close()
	done := make(chan error, 1)
	go func() { done <- b0.Barrier(ctx, "b") }()
	require.NoError(t, s.Close())
	err = <-done
	require.Error(t, err)
	assert.Contains(t, err.Error(), "lost connection to rendezvous")
}

func TestFromEnv(t *testing.T) {
	const size = 2
	s, tok, _ := newTestServer(t, size)
	ctx := testCtx(t)
	for _, v := range []string{EnvRank, EnvSize, EnvRdv, EnvToken, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
		"PMI_RANK", "PMI_SIZE", "PMIX_RANK", "PMIX_SIZE", "SLURM_PROCID", "SLURM_NTASKS"} {
		t.Setenv(v, "")
	}
	_, err := FromEnv(ctx)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "not started by troupe run?")

	t.Setenv("PMIX_RANK", "0")
	old := PMIx
	PMIx = nil // a build without the PMIx backend
	_, err = FromEnv(ctx)
	PMIx = old
	require.Error(t, err)
	assert.Contains(t, err.Error(), "no PMIx support")
	t.Setenv("PMIX_RANK", "")

	t.Setenv(EnvRdv, s.Addr())
	_, err = FromEnv(ctx)
	assert.ErrorContains(t, err, EnvToken)
	t.Setenv(EnvToken, "nothex")
	_, err = FromEnv(ctx)
	assert.ErrorContains(t, err, EnvToken)
	t.Setenv(EnvToken, tok.String())
	_, err = FromEnv(ctx)
	assert.ErrorContains(t, err, "not started by troupe run?")
	t.Setenv(EnvRank, "2")
	t.Setenv(EnvSize, "2")
	_, err = FromEnv(ctx)
	assert.ErrorContains(t, err, "out of range")

	// TROUPE_RANK/SIZE.
	t.Setenv(EnvRank, "0")
	b0, err := FromEnv(ctx)
	require.NoError(t, err)
	defer b0.Close()
	assert.Equal(t, 0, b0.Rank())
	assert.Equal(t, 2, b0.Size())

	// Fallback to another launcher's variables.
	t.Setenv(EnvRank, "")
	t.Setenv(EnvSize, "")
	t.Setenv("SLURM_PROCID", "1")
	t.Setenv("SLURM_NTASKS", "2")
	// srun --mpi=pmix also sets PMIX_RANK, without the non-standard
	// PMIX_SIZE: the SLURM pair is used.
	t.Setenv("PMIX_RANK", "1")
	b1, err := FromEnv(ctx)
	require.NoError(t, err)
	defer b1.Close()
	assert.Equal(t, 1, b1.Rank())

	errc := make(chan error, 1)
	go func() { errc <- b0.Barrier(ctx, "x") }()
	assert.NoError(t, b1.Barrier(ctx, "x"))
	assert.NoError(t, <-errc)
}

func TestPMIxSeam(t *testing.T) {
	for _, v := range []string{EnvRdv, EnvToken, EnvRank, EnvSize} {
		t.Setenv(v, "")
	}
	t.Setenv("PMIX_RANK", "3")
	sentinel := errors.New("pmix backend called")
	old := PMIx
	PMIx = func(context.Context) (Bootstrapper, error) { return nil, sentinel }
	defer func() { PMIx = old }()
	_, err := FromEnv(context.Background())
	assert.ErrorIs(t, err, sentinel)
}

func TestFrameLimits(t *testing.T) {
	const size = 2
	s, tok, _ := newTestServer(t, size)
	ctx := testCtx(t)
	bs := joinAll(t, ctx, s, tok, size)

	// A value that cannot fit in a frame is refused locally.
	_, err := bs[0].AllGather(ctx, "huge", make([]byte, MaxFrameSize))
	assert.ErrorContains(t, err, "frame too large")

	if testing.Short() {
		return
	}
	// Values that fit but whose combined result does not: every rank gets
	// an error, and the connection stays usable.
	errs := make([]error, size)
	var wg sync.WaitGroup
	for r, b := range bs {
		wg.Go(func() { _, errs[r] = b.AllGather(ctx, "big", make([]byte, 7<<20)) })
	}
	wg.Wait()
	for r := range size {
		assert.ErrorContains(t, errs[r], "result exceeds", "rank %d", r)
	}
	for r, b := range bs {
		wg.Go(func() {
			vals, err := b.AllGather(ctx, "small", []byte{byte(r)})
			if assert.NoError(t, err) {
				assert.Equal(t, [][]byte{{0}, {1}}, vals)
			}
		})
	}
	wg.Wait()
}
