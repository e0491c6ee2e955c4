package transport

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/gpu"
)

// hostSystem opens the GPU host backend, closed when the test ends. Call it
// before the test starts its ranks: cleanups run last in first out, so the
// transports then close, failing what is still in flight, before the System
// frees the device memory those transfers read and write. Freeing it first
// is cudaFree under a running transfer: a receive finishing later writes
// into unmapped memory.
func hostSystem(t testing.TB) *gpu.System {
	t.Helper()
	sys, err := gpu.OpenBackend(gpu.BackendHost)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sys.Close() })
	return sys
}

// devBuf allocates n bytes of device memory holding data (or zeros).
func devBuf(t testing.TB, sys *gpu.System, n int, data []byte) gpu.Buffer {
	t.Helper()
	a, err := sys.Devices()[0].Alloc(max(n, 1))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := a.Slice(0, n)
	if data != nil {
		if err := gpu.CopyFromHost(b, data); err != nil {
			t.Fatal(err)
		}
	} else if err := gpu.Memset(b, 0); err != nil {
		t.Fatal(err)
	}
	return b
}

func readDev(t *testing.T, b gpu.Buffer) []byte {
	t.Helper()
	out := make([]byte, b.Len())
	if err := gpu.CopyToHost(out, b); err != nil {
		t.Fatal(err)
	}
	return out
}

// channelSizes cover one message, exact chunk multiples (empty tail) and
// chunks plus a tail.
var channelSizes = []int{0, 1, 4096, ChannelChunkSize - 1, ChannelChunkSize, 2*ChannelChunkSize + 12345, 5 * ChannelChunkSize}

// channelVariants are the ways two in-process ranks' channels connect: the
// same-process path, UCX, and UCX with the overlap engine on (channel
// receives then go through it), in direct and in queue progress mode.
var channelVariants = []struct {
	name          string
	local, engine bool
	progress      ProgressMode
}{
	{"local", true, false, ProgressDirect},
	{"ucx", false, false, ProgressDirect},
	{"ucx-engine", false, true, ProgressDirect},
	{"ucx-engine-queue", false, true, ProgressQueue},
}

// channelJob starts two in-process ranks in progress mode mode, their
// channels connected by the same-process path (local) or UCX, with the
// overlap engine on or off.
func channelJob(t *testing.T, local, engine bool, mode ProgressMode) []*Transport {
	noLocalPath = !local
	t.Cleanup(func() { noLocalPath = false })
	if engine {
		t.Setenv(OverlapEnv, "on")
	}
	ts := localJob(t, 2, mode)
	if _, on := ts[1].OverlapStats(); on != engine {
		t.Fatalf("overlap engine on=%v, want %v", on, engine)
	}
	return ts
}

// waitUnexpected waits, entering tr (no sleeping), until its engine has
// taken n messages off UCX's queue that no receive has matched yet.
func waitUnexpected(ctx context.Context, t *testing.T, tr *Transport, n int) {
	t.Helper()
	for tr.OverlapTable().Unexpected < n {
		if ctx.Err() != nil {
			t.Fatalf("%d messages not taken: table %+v", n, tr.OverlapTable())
		}
		if _, _, err := tr.Iprobe(0, 1); err != nil { // enters the transport
			t.Fatal(err)
		}
		runtime.Gosched()
	}
}

// checkEngineBooks fails t when the engine of tr still holds anything
// after a few seconds (what was dropped may still be completing).
func checkEngineBooks(t *testing.T, tr *Transport) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; {
		st, on := tr.OverlapStats()
		if !on {
			return
		}
		tab := tr.OverlapTable()
		tab.Discarded = 0 // cumulative
		if tab == (OverlapTable{}) && st.Tracked == 0 && st.PoolInUse == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("engine books not balanced: table %+v, tracked %d, slots in use %d", tab, st.Tracked, st.PoolInUse)
		}
		if _, _, err := tr.Iprobe(0, 1); err != nil { // enters the transport
			t.Fatal(err)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestChannelPaths(t *testing.T) {
	for _, v := range channelVariants {
		local := v.local
		t.Run(v.name, func(t *testing.T) {
			sys := hostSystem(t)
			ts := channelJob(t, v.local, v.engine, v.progress)
			ctx := testCtx(t)
			a, err := ts[0].Channel(5, 1)
			if err != nil {
				t.Fatal(err)
			}
			b, err := ts[1].Channel(5, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer a.Close()
			defer b.Close()
			for _, n := range channelSizes {
				want := pattern(n, n)
				// device -> device
				src, dst := devBuf(t, sys, n, want), devBuf(t, sys, n, nil)
				rr, err := b.Recv(dst)
				if err != nil {
					t.Fatal(err)
				}
				sr, err := a.Send(src)
				if err != nil {
					t.Fatal(err)
				}
				if err := sr.Wait(ctx); err != nil {
					t.Fatalf("%d B device send (%s): %v", n, sr.Path(), err)
				}
				if err := rr.Wait(ctx); err != nil {
					t.Fatalf("%d B device recv (%s): %v", n, rr.Path(), err)
				}
				wantPath := PathStaged
				if local {
					wantPath = PathLocal
				}
				if sr.Path() != wantPath || rr.Path() != wantPath {
					t.Fatalf("paths %s/%s, want %s", sr.Path(), rr.Path(), wantPath)
				}
				if got := readDev(t, dst); !bytes.Equal(got, want) {
					t.Fatalf("%d B device->device: data differs", n)
				}
				// host bytes -> device, then device -> host bytes (mixed ends)
				hb := make([]byte, n)
				r1, _ := a.Recv(src)
				s1, _ := b.SendBytes(want)
				r2, _ := b.RecvBytes(hb)
				s2, _ := a.Send(src)
				for _, r := range []*ChannelRequest{r1, s1, r2, s2} {
					if err := r.Wait(ctx); err != nil {
						t.Fatalf("%d B mixed %s (%s): %v", n, r.op, r.Path(), err)
					}
				}
				if !bytes.Equal(hb, want) {
					t.Fatalf("%d B bytes->device->bytes: data differs", n)
				}
			}
			checkEngineBooks(t, ts[0])
			checkEngineBooks(t, ts[1])
		})
	}
}

// TestChannelLateReceiver: with the overlap engine on, channel messages that
// arrive before their receives (even before the receiving end of the
// channel exists) are taken off UCX's queue by the engine, chunk by chunk,
// prefetched or held, and still land in order in the right receives.
func TestChannelLateReceiver(t *testing.T) {
	for _, mode := range []ProgressMode{ProgressDirect, ProgressQueue} {
		t.Run(mode.String(), func(t *testing.T) { testChannelLateReceiver(t, mode) })
	}
}

func testChannelLateReceiver(t *testing.T, mode ProgressMode) {
	ts := channelJob(t, false, true, mode)
	ctx := testCtx(t)
	// Another open channel makes rank 1 take channel messages, so channel
	// 5's arrive in the engine's table before its end is opened.
	other, err := ts[1].Channel(6, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	a, err := ts[0].Channel(5, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	var sends []*ChannelRequest
	chunks := 0
	for i, n := range channelSizes {
		sr, err := a.SendBytes(pattern(n, i))
		if err != nil {
			t.Fatal(err)
		}
		sends = append(sends, sr)
		chunks += chunkCount(n)
	}
	waitUnexpected(ctx, t, ts[1], chunks)
	b, err := ts[1].Channel(5, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	for i, n := range channelSizes {
		got := make([]byte, n)
		rr, err := b.RecvBytes(got)
		if err != nil {
			t.Fatal(err)
		}
		if err := rr.Wait(ctx); err != nil {
			t.Fatalf("message %d (%d B): %v", i, n, err)
		}
		if !bytes.Equal(got, pattern(n, i)) {
			t.Fatalf("message %d (%d B): data differs", i, n)
		}
	}
	for i, sr := range sends {
		if err := sr.Wait(ctx); err != nil {
			t.Fatalf("send %d: %v", i, err)
		}
	}
	st, _ := ts[1].OverlapStats()
	t.Logf("engine: prefetched %d onloaded %d eager %d, pool high water %d/%d", st.Prefetched, st.Onloaded, st.Eager, st.PoolHighWater, st.PoolSlots)
	if st.Prefetched+st.Onloaded+st.Eager < uint64(chunks) {
		t.Fatalf("engine decided for %d unexpected messages, want >= %d: %+v", st.Prefetched+st.Onloaded+st.Eager, chunks, st)
	}
	checkEngineBooks(t, ts[1])
}

func TestChannelSizeMismatch(t *testing.T) {
	for _, v := range channelVariants {
		local := v.local
		t.Run(v.name, func(t *testing.T) {
			sys := hostSystem(t)
			ts := channelJob(t, v.local, v.engine, v.progress)
			ctx := testCtx(t)
			a, _ := ts[0].Channel(9, 1)
			b, _ := ts[1].Channel(9, 0)
			// (sent, received) sizes: shorter and longer, one message and chunked,
			// chunk multiple against one more chunk.
			cases := [][2]int{{100, 200}, {200, 100}, {3 * ChannelChunkSize, 2 * ChannelChunkSize}, {ChannelChunkSize + 10, ChannelChunkSize + 20}, {ChannelChunkSize, 10}}
			if !v.local {
				// Two rendezvous chunks and the tail left over: they are
				// discarded (by the engine, or received into scratch memory
				// without it), and only then does the sender complete.
				cases = append(cases, [2]int{3 * ChannelChunkSize, 10})
			}
			for _, c := range cases {
				for _, dev := range []bool{false, true} {
					var rr *ChannelRequest
					if dev {
						rr, _ = b.Recv(devBuf(t, sys, c[1], nil))
					} else {
						rr, _ = b.RecvBytes(make([]byte, c[1]))
					}
					sr, _ := a.SendBytes(pattern(c[0], 1))
					err := rr.Wait(ctx)
					var sm *SizeMismatchError
					if !errors.As(err, &sm) || !errors.Is(err, ErrSizeMismatch) {
						t.Fatalf("sent %d received into %d (device %v, %s): err %v, want *SizeMismatchError", c[0], c[1], dev, rr.Path(), err)
					}
					if sm.Want != c[1] {
						t.Fatalf("mismatch error %+v", sm)
					}
					serr := sr.Wait(ctx)
					if local && !errors.Is(serr, ErrSizeMismatch) {
						// The same-process path tells the sender too.
						t.Fatalf("sender: %v, want ErrSizeMismatch", serr)
					}
					if !local && serr != nil {
						// Over UCX the sender is not told; its transfer completes.
						t.Fatalf("sender: %v", serr)
					}
					t.Logf("%v", err)
				}
			}
			// The channel still works after mismatches.
			want := pattern(64, 3)
			got := make([]byte, 64)
			rr, _ := b.RecvBytes(got)
			sr, _ := a.SendBytes(want)
			if err := rr.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			if err := sr.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Fatal("data after mismatches differs")
			}
			switch {
			case v.engine:
				// Leftover chunks were dropped, with their slots.
				checkEngineBooks(t, ts[1])
				checkEngineBooks(t, ts[0])
				if n := ts[1].OverlapTable().Discarded; n == 0 {
					t.Fatal("no leftover chunk discarded")
				} else {
					t.Logf("%d leftover chunks discarded", n)
				}
			case !v.local:
				// Every sender completed, so every leftover chunk was taken;
				// each mismatch that left one left at least the short tail.
				// The count follows the drain's last receive: wait for it.
				deadline := time.Now().Add(10 * time.Second)
				for ts[1].ChannelStats().Discarded == 0 && time.Now().Before(deadline) {
					runtime.Gosched()
				}
				if n := ts[1].ChannelStats().Discarded; n == 0 {
					t.Fatal("no leftover chunk drained")
				} else {
					t.Logf("%d leftover chunks drained", n)
				}
			}
		})
	}
}

func TestChannelErrors(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	if _, err := ts[0].Channel(1<<ChannelBits, 1); !errors.Is(err, ErrInvalid) {
		t.Fatalf("oversize id: %v", err)
	}
	if _, err := ts[0].Channel(1, 2); !errors.Is(err, ErrInvalid) {
		t.Fatalf("bad peer: %v", err)
	}
	c, err := ts[0].Channel(1, 1)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ts[0].Channel(1, 1); !errors.Is(err, ErrChannelInUse) {
		t.Fatalf("duplicate id: %v", err)
	}
	if _, err := c.Send(gpu.Buffer{}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("zero buffer: %v", err)
	}
	_ = c.Close()
	if _, err := c.SendBytes([]byte{1}); !errors.Is(err, ErrClosed) {
		t.Fatalf("after close: %v", err)
	}
	if _, err := ts[0].Channel(1, 1); err != nil {
		t.Fatalf("id reuse after close: %v", err)
	}
}

// TestChannelSelf: a channel from a rank to itself, and counters in call
// order with several transfers in flight.
func TestChannelSelf(t *testing.T) {
	ts := localJob(t, 1, ProgressDirect)
	ctx := testCtx(t)
	c, err := ts[0].Channel(3, 0)
	if err != nil {
		t.Fatal(err)
	}
	var rs, ss []*ChannelRequest
	bufs := make([][]byte, 8)
	for i := range bufs {
		bufs[i] = make([]byte, 100+i)
		r, _ := c.RecvBytes(bufs[i])
		rs = append(rs, r)
	}
	for i := range bufs {
		s, _ := c.SendBytes(pattern(100+i, i))
		ss = append(ss, s)
	}
	for i := range rs {
		if err := rs[i].Wait(ctx); err != nil {
			t.Fatal(err)
		}
		if err := ss[i].Wait(ctx); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(bufs[i], pattern(100+i, i)) {
			t.Fatalf("message %d differs", i)
		}
	}
}

// TestPairChannel: both ends of a pair derive the same id, from the range
// Channel refuses, and the channel carries messages; each pair has its own
// id, and a second end on one rank is refused.
func TestPairChannel(t *testing.T) {
	ts := localJob(t, 3, ProgressDirect)
	if _, err := ts[0].Channel(PairChannelBase, 1); !errors.Is(err, ErrInvalid) {
		t.Fatalf("reserved id: %v", err)
	}
	if _, err := ts[0].PairChannel(3); !errors.Is(err, ErrInvalid) {
		t.Fatalf("bad peer: %v", err)
	}
	ids := map[uint32]bool{}
	for _, p := range [][2]int{{0, 1}, {2, 0}, {1, 2}} {
		a, err := ts[p[0]].PairChannel(p[1])
		if err != nil {
			t.Fatal(err)
		}
		b, err := ts[p[1]].PairChannel(p[0])
		if err != nil {
			t.Fatal(err)
		}
		if a.ID() != b.ID() || a.ID() < PairChannelBase || ids[a.ID()] {
			t.Fatalf("pair %v: ids %d and %d (seen before: %v)", p, a.ID(), b.ID(), ids[a.ID()])
		}
		ids[a.ID()] = true
		if _, err := ts[p[0]].PairChannel(p[1]); !errors.Is(err, ErrChannelInUse) {
			t.Fatalf("pair %v opened twice: %v", p, err)
		}
		want := []byte(fmt.Sprintf("pair %v", p))
		got := make([]byte, len(want))
		rr, err := b.RecvBytes(got)
		if err != nil {
			t.Fatal(err)
		}
		sr, err := a.SendBytes(want)
		if err != nil {
			t.Fatal(err)
		}
		if err := sr.Wait(context.Background()); err != nil {
			t.Fatal(err)
		}
		if err := rr.Wait(context.Background()); err != nil || !bytes.Equal(got, want) {
			t.Fatalf("pair %v: got %q, %v", p, got, err)
		}
		_ = a.Close()
		_ = b.Close()
	}
}
