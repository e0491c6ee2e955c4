package transport

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/gpu"
)

// failChannelPosts makes rank tr's posts of chunk chunk of the messages of
// channel chanID fail at once with err until the returned function is
// called. also, when not nil, runs first (under the worker lock).
func failChannelPosts(tr *Transport, chanID uint32, chunk int, err error, also func()) (stop func()) {
	return setFault(tr, &tr.chanPostFault, func(id, _ uint32, k int) error {
		if id == chanID && k == chunk {
			if also != nil {
				also()
			}
			return err
		}
		return nil
	})
}

// chanSendCase is one kind of channel send: Go memory (the direct path) or
// device memory of the host backend (the staged path), of one size.
type chanSendCase struct {
	name   string
	n      int
	device bool
}

var chanSendCases = []chanSendCase{
	{"bytes-1chunk", 100, false},
	{"bytes-3chunks", 2*ChannelChunkSize + 100, false},
	{"device-eager", 100, true},
	{"device-pipelined", 2*ChannelChunkSize + 100, true},
}

// send starts sending data on c as the case's kind of memory.
func (k chanSendCase) send(t *testing.T, sys *gpu.System, c *Channel, data []byte) (*ChannelRequest, error) {
	t.Helper()
	if k.device {
		return c.Send(devBuf(t, sys, len(data), data))
	}
	return c.SendBytes(data)
}

// path is the path the case's sends take.
func (k chanSendCase) path() TransferPath {
	if k.device {
		return PathStaged
	}
	return PathDirect
}

// sendWait sends data on c and waits for the send: the error of Send or of
// the request.
func (k chanSendCase) sendWait(ctx context.Context, t *testing.T, sys *gpu.System, c *Channel, data []byte) error {
	t.Helper()
	q, err := k.send(t, sys, c, data)
	if err != nil {
		return err
	}
	return q.Wait(ctx)
}

// exchange sends data from a and receives it at b, within a deadline that
// only guards against a message that is never matched.
func (k chanSendCase) exchange(ctx context.Context, t *testing.T, sys *gpu.System, a, b *Channel, data []byte, what string) {
	t.Helper()
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	got := make([]byte, len(data))
	rr, err := b.RecvBytes(got)
	if err != nil {
		t.Fatalf("%s: recv: %v", what, err)
	}
	q, err := k.send(t, sys, a, data)
	if err == nil {
		err = q.Wait(wctx)
	}
	if err != nil {
		t.Fatalf("%s: send: %v", what, err)
	}
	if want := k.path(); q.Path() != want {
		t.Fatalf("%s: the send took path %s, want %s", what, q.Path(), want)
	}
	if err := rr.Wait(wctx); err != nil {
		t.Fatalf("%s: the peer's receive: %v", what, err)
	}
	if !bytes.Equal(got, data) {
		t.Fatalf("%s: the peer received other data", what)
	}
}

// chanFailVariants are the UCX channel set-ups the post-failure tests run
// on: progress direct and queue (where the post runs on the progress
// goroutine), the overlap engine off and on.
var chanFailVariants = []struct {
	name     string
	engine   bool
	progress ProgressMode
}{
	{"direct", false, ProgressDirect},
	{"queue", false, ProgressQueue},
	{"engine-queue", true, ProgressQueue},
}

// A channel send whose post fails at once, before any of it went out,
// gives its number back: the channel's next Send is received by the peer's
// next Recv. Before the fix the failed message kept its number, the next
// one went out under the number after it, and the peer's Recv, waiting for
// the failed message's number, never matched (or, for a staged message,
// took the failed message's later chunks, which still went out).
func TestChannelSendPostFailureKeepsCounter(t *testing.T) {
	injected := errors.New("injected post failure")
	for _, v := range chanFailVariants {
		t.Run(v.name, func(t *testing.T) {
			sys := hostSystem(t)
			ts := channelJob(t, false, v.engine, v.progress)
			ctx := testCtx(t)
			a, _ := ts[0].Channel(41, 1)
			b, _ := ts[1].Channel(41, 0)
			defer a.Close()
			defer b.Close()
			for i, k := range chanSendCases {
				// A message first, so the failed one's number is not 0.
				k.exchange(ctx, t, sys, a, b, pattern(k.n, 3*i), k.name+": first message")

				stop := failChannelPosts(ts[0], 41, 0, injected, nil)
				err := k.sendWait(ctx, t, sys, a, pattern(k.n, 3*i+1))
				stop()
				if !errors.Is(err, injected) || errors.Is(err, ErrChannelBroken) {
					t.Fatalf("%s: failed send returned %v, want the injected failure alone", k.name, err)
				}

				k.exchange(ctx, t, sys, a, b, pattern(k.n, 3*i+2), k.name+": message after the failed one")
			}
		})
	}
}

// A channel send whose post fails when its number cannot be given back
// (part of it went out, or a later send took the next number) breaks the
// channel's sends: that message fails with a *ChannelBrokenError
// (ErrChannelBroken, and the post's failure), and so does every later
// Send, at once, rather than go out under numbers the peer's receives no
// longer line up with (their requests never completed).
func TestChannelSendPostFailureBreaksChannel(t *testing.T) {
	injected := errors.New("injected post failure")
	type breakCase struct {
		chanSendCase
		chunk   int  // the chunk whose post fails
		taken   bool // a later send takes the next number before the failure
		partial bool // the ChannelBrokenError's Partial
	}
	cases := []breakCase{
		{chanSendCase: chanSendCases[1], chunk: 1, partial: true},
		{chanSendCase: chanSendCases[3], chunk: 1, partial: true},
		{chanSendCase: chanSendCases[0], chunk: 0, taken: true},
		{chanSendCase: chanSendCases[2], chunk: 0, taken: true},
	}
	for _, v := range chanFailVariants {
		for i, k := range cases {
			t.Run(fmt.Sprintf("%s/%s/chunk%d/taken=%v", v.name, k.name, k.chunk, k.taken), func(t *testing.T) {
				sys := hostSystem(t)
				ts := channelJob(t, false, v.engine, v.progress)
				ctx := testCtx(t)
				id := uint32(50 + i)
				a, _ := ts[0].Channel(id, 1)
				b, _ := ts[1].Channel(id, 0)
				defer a.Close()
				defer b.Close()
				k.exchange(ctx, t, sys, a, b, pattern(k.n, 1), "first message")

				// The peer receives the message that fails: the chunks
				// that went out are matched (a rendezvous chunk waits
				// for that), and the receive never completes.
				got := make([]byte, k.n)
				if _, err := b.RecvBytes(got); err != nil {
					t.Fatal(err)
				}
				var also func()
				if k.taken {
					// A concurrent Send takes the next number between
					// the message's number and its failed post.
					also = func() {
						if _, err := a.next(true); err != nil {
							t.Errorf("taking the next number: %v", err)
						}
					}
				}
				stop := failChannelPosts(ts[0], id, k.chunk, injected, also)
				wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				err := k.sendWait(wctx, t, sys, a, pattern(k.n, 2))
				cancel()
				stop()
				var broken *ChannelBrokenError
				if !errors.As(err, &broken) || !errors.Is(err, ErrChannelBroken) || !errors.Is(err, injected) {
					t.Fatalf("failed send returned %v, want a *ChannelBrokenError wrapping the injected failure", err)
				}
				if broken.Channel != id || broken.Peer != 1 || broken.Message != 1 || broken.Partial != k.partial {
					t.Fatalf("ChannelBrokenError %+v, want channel %d, peer 1, message 1, partial %v", broken, id, k.partial)
				}

				q, err := k.send(t, sys, a, pattern(k.n, 3))
				if q != nil || !errors.Is(err, ErrChannelBroken) {
					t.Fatalf("Send after the channel broke: request %v, error %v; want ErrChannelBroken at once", q != nil, err)
				}
				// The receive direction is not affected.
				k.exchange(ctx, t, sys, b, a, pattern(k.n, 4), "message the other way")
			})
		}
	}
}
