package transport

import (
	"bytes"
	"errors"
	"strconv"
	"sync"
	"testing"
)

// amArrival is one active message as its handler saw it.
type amArrival struct {
	header string
	data   []byte
	req    *Request // RecvData's request for data that had not arrived yet
	err    error
}

// TestPostAMOrderAndCopies mixes PostAM (copied, no request) and SendAM
// (eager, rendezvous and, above the CMA threshold, CMA) sends from one
// goroutine to one rank: they arrive in send order with the right bytes,
// although the buffer of every posted message is overwritten as soon as
// PostAM returns. Handlers leave most messages to the batched release and
// receive the others' data themselves.
func TestPostAMOrderAndCopies(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		t.Setenv("TROUPE_CMA_THRESHOLD", "65536")
		ts := localJob(t, 2, mode)
		ctx := testCtx(t)
		const id = 11
		var mu sync.Mutex
		var got []amArrival
		arrived := make(chan struct{}, 1)
		if err := ts[1].SetAMHandler(id, func(m *AMMessage) {
			a := amArrival{header: string(m.Header)}
			if m.Rendezvous || m.Size%2 == 1 {
				// Received by the handler (odd sizes, and data not here yet).
				a.data = make([]byte, m.Size)
				a.req, a.err = m.RecvData(a.data)
			} else {
				a.data = bytes.Clone(m.Data()) // released with its batch
			}
			mu.Lock()
			got = append(got, a)
			mu.Unlock()
			select {
			case arrived <- struct{}{}:
			default:
			}
		}); err != nil {
			t.Fatal(err)
		}
		sizes := []int{0, 8, 64, 101, 4096, MaxPostAM - 8, 20 << 10, 200 << 10}
		const n = 400
		buf := make([]byte, MaxPostAM)
		var reqs []*Request
		want := make([][]byte, n)
		for i := 0; i < n; i++ {
			size := sizes[i%len(sizes)]
			hdr := []byte(strconv.Itoa(i))
			want[i] = pattern(size, i)
			if len(hdr)+size <= MaxPostAM {
				data := buf[:size]
				copy(data, want[i])
				if err := ts[0].PostAM(1, id, hdr, data); err != nil {
					t.Fatalf("PostAM %d: %v", i, err)
				}
				for j := range data {
					data[j] = 0xee // the transport copied it: scribble
				}
				copy(hdr, "xxxxxxxx")
				continue
			}
			r, err := ts[0].SendAM(1, id, hdr, want[i], AMAuto)
			if err != nil {
				t.Fatalf("SendAM %d: %v", i, err)
			}
			reqs = append(reqs, r)
		}
		for _, r := range reqs {
			if _, err := r.Wait(ctx); err != nil {
				t.Fatal(err)
			}
		}
		for {
			mu.Lock()
			k := len(got)
			mu.Unlock()
			if k == n {
				break
			}
			select {
			case <-arrived:
			case <-ctx.Done():
				t.Fatalf("%d of %d active messages arrived", k, n)
			}
		}
		for i, a := range got {
			if a.header != strconv.Itoa(i) {
				t.Fatalf("message %d arrived as number %s", i, a.header)
			}
			if a.err == nil && a.req != nil {
				_, a.err = a.req.Wait(ctx)
			}
			if a.err != nil {
				t.Fatalf("message %d: %v", i, a.err)
			}
			if !bytes.Equal(a.data, want[i]) {
				t.Fatalf("message %d (%d bytes): data differs", i, len(want[i]))
			}
		}
		if f := ts[0].PostFailed(); f != 0 {
			t.Fatalf("%d posted sends failed", f)
		}
	})
}

// TestPostAMErrors: what PostAM cannot send fails at once, with the reason.
func TestPostAMErrors(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 3, mode)
		if err := ts[0].PostAM(3, 1, nil, nil); !errors.Is(err, ErrInvalid) {
			t.Fatalf("PostAM to rank 3 of 3: %v", err)
		}
		if err := ts[0].PostAM(1, 1, []byte("h"), make([]byte, MaxPostAM)); !errors.Is(err, ErrInvalid) {
			t.Fatalf("PostAM over MaxPostAM: %v", err)
		}
		ts[0].mu.Lock()
		if _, err := ts[0].peerLocked(2, "test"); err != nil {
			t.Fatal(err)
		}
		ts[0].peerFailed(2, "killed by the test")
		ts[0].mu.Unlock()
		if err := ts[0].PostAM(2, 1, []byte("h"), nil); !errors.Is(err, ErrPeerLost) {
			t.Fatalf("PostAM to a lost rank: %v", err)
		}
		if err := ts[1].Close(); err != nil {
			t.Fatal(err)
		}
		if err := ts[1].PostAM(0, 1, []byte("h"), []byte("data")); !errors.Is(err, ErrClosed) {
			t.Fatalf("PostAM after Close: %v", err)
		}
	})
}

// TestPostAMFullQueue: while the receiving rank is stuck in a handler, the
// sender's posts fill the peer's queue and UCX queues them; the sending
// goroutine then progresses the worker itself, while replies arrive (for
// an inline handler, which the sending goroutine may run, and for a plain
// one, which only the progress goroutine runs), and handlers post too
// (into full queues as well). Everything arrives, in order, once the
// receiver goes on.
func TestPostAMFullQueue(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	const n = 3000
	release := make(chan struct{})
	var got []int
	var mu sync.Mutex
	if err := ts[1].SetAMHandler(12, func(m *AMMessage) {
		i, _ := strconv.Atoi(string(m.Header))
		if i == 0 {
			<-release
		}
		mu.Lock()
		got = append(got, i)
		mu.Unlock()
		if err := ts[1].PostAM(0, 13+uint16(i%2)*2, m.Header, m.Data()); err != nil {
			t.Errorf("reply %d: %v", i, err)
		}
	}); err != nil {
		t.Fatal(err)
	}
	if err := ts[1].SetAMHandler(14, func(*AMMessage) {}); err != nil {
		t.Fatal(err)
	}
	replies := make(chan int, n)
	reply := func(m *AMMessage) {
		i, _ := strconv.Atoi(string(m.Header))
		// A post from inside a handler.
		if err := ts[0].PostAM(1, 14, m.Header, nil); err != nil {
			t.Errorf("echo of reply %d: %v", i, err)
		}
		replies <- i
	}
	if err := ts[0].SetInlineAMHandler(13, reply); err != nil { // even replies
		t.Fatal(err)
	}
	if err := ts[0].SetAMHandler(15, reply); err != nil { // odd ones
		t.Fatal(err)
	}
	data := make([]byte, 200)
	for i := 0; i < n; i++ {
		if err := ts[0].PostAM(1, 12, []byte(strconv.Itoa(i)), data); err != nil {
			t.Fatal(err)
		}
		if i == n/2 {
			close(release)
		}
	}
	for i := 0; i < n; i++ {
		select {
		case r := <-replies:
			if r != i {
				t.Fatalf("reply %d came as %d", i, r)
			}
		case <-ctx.Done():
			t.Fatalf("%d of %d replies", i, n)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	for i, g := range got {
		if g != i {
			t.Fatalf("message %d arrived as %d", i, g)
		}
	}
	if q := ts[0].postsQueued.Load(); q == 0 {
		t.Fatal("no post was ever queued: the full-queue path went untested")
	} else {
		t.Logf("%d posts queued by UCX, %d replies delivered inside PostAM", q, ts[0].inlineDelivered.Load())
	}
}

// TestAMHeaderLimit: headers of MaxAMHeader bytes travel with eager,
// rendezvous and same-host (CMA) data, over shared memory and TCP; one
// byte more is refused by PostAM and SendAM alike, where UCX 1.13 aborted
// the process ("RTS is too big", or an assertion in ucp_am.c).
func TestAMHeaderLimit(t *testing.T) {
	for _, tls := range []string{"self,sm", "self,tcp"} {
		t.Run(tls, func(t *testing.T) {
			t.Setenv("UCX_TLS", tls)
			t.Setenv("TROUPE_CMA_THRESHOLD", "65536")
			ts := localJob(t, 2, ProgressDirect)
			ctx := testCtx(t)
			max := ts[0].MaxAMHeader()
			if max < 1024 || max > 1<<20 {
				t.Fatalf("MaxAMHeader %d: not a plausible UCX limit", max)
			}
			const id = 12
			got := make(chan amArrival, 8)
			if err := ts[1].SetAMHandler(id, func(m *AMMessage) {
				a := amArrival{header: string(m.Header), data: make([]byte, m.Size)}
				a.req, a.err = m.RecvData(a.data)
				got <- a
			}); err != nil {
				t.Fatal(err)
			}
			hdr := pattern(max, 1)
			check := func(what string, data []byte) {
				t.Helper()
				select {
				case a := <-got:
					if a.err == nil && a.req != nil {
						_, a.err = a.req.Wait(ctx)
					}
					if a.err != nil || a.header != string(hdr) || !bytes.Equal(a.data, data) {
						t.Fatalf("%s: header of %d bytes (%d sent), data equal %v, error %v", what, len(a.header), max, bytes.Equal(a.data, data), a.err)
					}
				case <-ctx.Done():
					t.Fatalf("%s: nothing arrived", what)
				}
			}
			small := pattern(MaxPostAM-max, 2)
			if err := ts[0].PostAM(1, id, hdr, small); err != nil {
				t.Fatalf("PostAM with a %d-byte header: %v", max, err)
			}
			check("PostAM", small)
			for _, n := range []int{0, 100 << 10, 1 << 20} {
				data := pattern(n, n)
				r, err := ts[0].SendAM(1, id, hdr, data, AMAuto)
				if err != nil {
					t.Fatalf("SendAM of %d bytes with a %d-byte header: %v", n, max, err)
				}
				if _, err := r.Wait(ctx); err != nil {
					t.Fatalf("SendAM of %d bytes with a %d-byte header: %v", n, max, err)
				}
				check("SendAM "+strconv.Itoa(n), data)
			}
			long := pattern(max+1, 3)
			if err := ts[0].PostAM(1, id, long, nil); !errors.Is(err, ErrInvalid) {
				t.Fatalf("PostAM with a %d-byte header: %v, want ErrInvalid", max+1, err)
			}
			for _, n := range []int{0, 100 << 10} {
				if _, err := ts[0].SendAM(1, id, long, make([]byte, n), AMAuto); !errors.Is(err, ErrInvalid) {
					t.Fatalf("SendAM of %d bytes with a %d-byte header: %v, want ErrInvalid", n, max+1, err)
				}
			}
			select {
			case a := <-got:
				t.Fatalf("a refused message arrived (header of %d bytes)", len(a.header))
			default:
			}
		})
	}
}

// TestCloseWithAMDataFetchInFlight: Close while an active message's
// rendezvous data fetch (RecvData) waits for a sender that makes no
// progress (its worker lock held, as a rank busy computing) fails the
// fetch with ErrClosed. The fetch hangs on an endpoint UCX made itself,
// which Close cannot force, and destroying the worker under it aborted the
// process (ucp_ep.c:437, ucs_hlist_is_empty(proto_reqs)); the worker is
// left behind instead.
func TestCloseWithAMDataFetchInFlight(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		t.Setenv("TROUPE_CMA", "off") // UCX's rendezvous, not a same-host read
		ts := localJob(t, 2, mode)
		ctx := testCtx(t)
		m, data := keptRendezvousAM(t, ts)
		ts[0].mu.Lock() // rank 0 makes no progress until the end
		defer ts[0].mu.Unlock()
		rr, err := m.RecvData(make([]byte, len(data)))
		if err != nil {
			t.Fatal(err)
		}
		if err := ts[1].Close(); err != nil {
			t.Fatal(err)
		}
		if _, err := rr.Wait(ctx); !errors.Is(err, ErrClosed) {
			t.Fatalf("data fetch at Close: %v, want ErrClosed", err)
		}
	})
}

// TestRecvDataAfterClose: a kept rendezvous active message whose data is
// asked for after its transport closed fails with ErrClosed. Close leaves
// the worker nil, and RecvData released the rendezvous descriptor through
// it: a nil-pointer panic (found by review).
func TestRecvDataAfterClose(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		t.Setenv("TROUPE_CMA", "off") // UCX's rendezvous, not a same-host read
		ts := localJob(t, 2, mode)
		ctx := testCtx(t)
		m, data := keptRendezvousAM(t, ts)
		if err := ts[1].Close(); err != nil {
			t.Fatal(err)
		}
		rr, err := m.RecvData(make([]byte, len(data)))
		if err == nil {
			_, err = rr.Wait(ctx)
		}
		if !errors.Is(err, ErrClosed) {
			t.Fatalf("RecvData after Close: %v, want ErrClosed", err)
		}
	})
}

// keptRendezvousAM sends a 256 KiB rendezvous active message from ts[0] to
// ts[1], whose handler keeps it, and returns it (its data not yet fetched)
// with the data sent.
func keptRendezvousAM(t *testing.T, ts []*Transport) (*AMMessage, []byte) {
	t.Helper()
	got := make(chan *AMMessage, 1)
	if err := ts[1].SetAMHandler(0x10, func(m *AMMessage) {
		m.Keep()
		got <- m
	}); err != nil {
		t.Fatal(err)
	}
	data := pattern(256<<10, 1)
	if _, err := ts[0].SendAM(1, 0x10, []byte("h"), data, AMRndv); err != nil {
		t.Fatal(err)
	}
	m := <-got
	if !m.Rendezvous {
		t.Fatalf("a %d-byte AMRndv message arrived eager", len(data))
	}
	return m, data
}
