package integration

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"regexp"
	"runtime/debug"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"

	"github.com/troupe-hpc/troupe/actor"
	"github.com/troupe-hpc/troupe/transport"
	"github.com/troupe-hpc/troupe/transport/bootstrap"
)

// The actor runtime between real rank processes (issue 3, section 9): each
// scenario runs on 3 ranks launched by the embedded launcher, each rank an
// actor.Runtime on the transport the scenario's UCX_TLS selected.
func init() {
	scenarios["actor-order"] = actorOrder
	scenarios["actor-request"] = actorRequest
	scenarios["actor-errors"] = actorErrors
	scenarios["actor-watch"] = actorWatch
	scenarios["actor-kill"] = actorKill
	scenarios["actor-lost-silent"] = actorLostSilent
	scenarios["actor-flood"] = actorFlood
}

// actorRanks is the job size of every actor scenario.
const actorRanks = 3

// forActorTLS runs f over shared memory and TCP (direct progress).
func forActorTLS(t *testing.T, f func(t *testing.T, c cfg)) {
	for _, tls := range []string{"shm", "tcp"} {
		t.Run(tls, func(t *testing.T) { f(t, cfg{tls, "direct"}) })
	}
}

// requireLine fails t unless the job's stdout has line.
func requireLine(t *testing.T, res jobResult, line string) {
	t.Helper()
	if !strings.Contains(res.stdout, line) {
		t.Fatalf("no line %q:\n%s", line, res.dump())
	}
}

// ---------------------------------------------------------------------------
// Send order.

// orderStream is how many messages each sender sends to the sink.
const orderStream = 2000

// seqFor is message n of from's stream: mostly small, some with a 12 KiB or
// a 256 KiB text (the body goes eager or by rendezvous), some with a 1 MiB
// out-of-band payload (envelope and body in the AM header, payload as
// rendezvous data).
func seqFor(from, n int) *seqMsg {
	m := &seqMsg{From: from, N: n}
	seed := uint32(from<<24 | n)
	switch {
	case n%97 == 5:
		m.Text = string(pattern(256<<10, seed))
	case n%101 == 7:
		m.Data = pattern(1<<20, seed)
	case n%13 == 3:
		m.Text = string(pattern(12<<10, seed))
	}
	return m
}

// sink checks that each sender's stream arrives complete, intact and in
// order, and answers seqDone with its verdict on that sender.
func sink(errs *collector) pa.ReceiveFunc {
	next := map[int]int{}
	return func(c pa.Context) {
		switch m := c.Message().(type) {
		case *seqMsg:
			if m.N != next[m.From] {
				errs.add("rank %d's message %d arrived when %d was due", m.From, m.N, next[m.From])
			}
			next[m.From] = m.N + 1
			want := seqFor(m.From, m.N)
			if m.Text != want.Text {
				errs.add("rank %d's message %d: text of %d bytes differs from the %d sent", m.From, m.N, len(m.Text), len(want.Text))
			}
			if !bytes.Equal(m.Data, want.Data) {
				errs.add("rank %d's message %d: payload of %d bytes differs from the %d sent", m.From, m.N, len(m.Data), len(want.Data))
			}
			actor.ReleasePayload(m.Data)
		case *seqDone:
			v := &verdict{}
			if next[m.From] != m.Count {
				v.Err = fmt.Sprintf("sink saw %d of rank %d's %d messages", next[m.From], m.From, m.Count)
			} else if err := errs.err(); err != nil {
				v.Err = err.Error()
			}
			c.Respond(v)
		}
	}
}

// startStream tells rank 2's source actor to send its stream to the sink.
type startStream struct {
	sink  *pa.PID
	reply chan error
}

// source sends a stream from inside an actor (protoactor's Context.Send
// through the address resolver), then asks the sink for its verdict with
// Context.Request; the verdict arrives as a message (protoactor's Respond
// sends it without a sender).
func source(rank int) pa.ReceiveFunc {
	var reply chan error
	return func(c pa.Context) {
		switch m := c.Message().(type) {
		case *startStream:
			reply = m.reply
			for i := 0; i < orderStream; i++ {
				c.Send(m.sink, seqFor(rank, i))
			}
			c.Request(m.sink, &seqDone{From: rank, Count: orderStream})
		case *verdict:
			switch {
			case m.Err != "":
				reply <- errors.New(m.Err)
			default:
				reply <- nil
			}
		}
	}
}

// actorOrder: ranks 0 and 2 each send 2,000 messages (small ones mixed with
// 12 KiB and 256 KiB bodies and 1 MiB payloads) to a sink on rank 1, rank 0
// from outside actors (Runtime.Send and protoactor's RootContext.Send
// alternately), rank 2 from inside an actor. The sink checks each stream's
// order and contents.
func actorOrder(ctx context.Context, r *rank) error {
	return withActors(ctx, r, actor.Options{}, func(rt *actor.Runtime) error {
		var errs collector
		if r.id() == 1 {
			if _, err := spawn(rt, "sink", sink(&errs)); err != nil {
				return err
			}
		}
		if r.id() == 2 {
			if _, err := spawn(rt, "source", source(2)); err != nil {
				return err
			}
		}
		if err := r.b.Barrier(ctx, "actor-order.spawned"); err != nil {
			return err
		}
		sinkPID := rt.PID(1, "sink")
		start := time.Now()
		switch r.id() {
		case 0:
			for i := 0; i < orderStream; i++ {
				if i%2 == 0 {
					if err := rt.Send(sinkPID, seqFor(0, i)); err != nil {
						return fmt.Errorf("send %d: %w", i, err)
					}
				} else {
					rt.Root().Send(sinkPID, seqFor(0, i))
				}
			}
			res, err := rt.Request(sinkPID, &seqDone{From: 0, Count: orderStream}, actorTimeout)
			if err != nil {
				return fmt.Errorf("asking the sink: %w", err)
			}
			if v, ok := res.(*verdict); !ok || v.Err != "" {
				return fmt.Errorf("sink's verdict: %#v", res)
			}
		case 2:
			reply := make(chan error, 1)
			rt.Root().Send(rt.PID(2, "source"), &startStream{sink: sinkPID, reply: reply})
			select {
			case err := <-reply:
				if err != nil {
					return err
				}
			case <-time.After(actorTimeout):
				return errors.New("no verdict from the sink")
			}
		}
		if err := r.b.Barrier(ctx, "actor-order.sent"); err != nil {
			return err
		}
		if r.id() == 1 {
			if err := errs.err(); err != nil {
				return err
			}
			r.logf("both streams of %d messages arrived intact and in order", orderStream)
			if err := engineAfterOrder(r, rt); err != nil {
				return err
			}
		} else {
			r.logf("stream of %d messages in order (%v)", orderStream, time.Since(start).Round(time.Millisecond))
		}
		return nil
	})
}

func TestActorSendOrder(t *testing.T) {
	forActorTLS(t, func(t *testing.T, c cfg) {
		res := runJob(t, "actor-order", actorRanks, c)
		requireLine(t, res, fmt.Sprintf("[1] rank 1: both streams of %d messages arrived intact and in order", orderStream))
	})
}

// The same streams with the overlap engine on: the sink's large messages go
// through the engine (prefetched or onloaded, docs/overlap.md section 7)
// and still arrive intact and in order.
func TestActorSendOrderEngine(t *testing.T) {
	t.Setenv(transport.OverlapEnv, "on")
	forActorTLS(t, func(t *testing.T, c cfg) {
		res := runJob(t, "actor-order", actorRanks, c)
		requireLine(t, res, fmt.Sprintf("[1] rank 1: both streams of %d messages arrived intact and in order", orderStream))
		requireLine(t, res, "[1] rank 1: engine books clean")
	})
}

// engineAfterOrder checks, with the engine on, that the sink's rank planned
// its rendezvous messages through it and that the engine forgot every one.
func engineAfterOrder(r *rank, rt *actor.Runtime) error {
	s, on := rt.Transport().OverlapStats()
	if !on {
		return nil
	}
	st := rt.Stats()
	pre, onl := st.DataPrefetched.Load(), st.DataOnloaded.Load()
	if pre+onl == 0 {
		return fmt.Errorf("engine on, but none of %d rendezvous messages went through it", st.Rendezvous.Load())
	}
	deadline := time.Now().Add(actorTimeout)
	for s.Tracked != 0 || s.Outstanding != 0 || s.PoolInUse != 0 {
		if time.Now().After(deadline) {
			return fmt.Errorf("engine books not clean: %+v", s)
		}
		time.Sleep(time.Millisecond)
		s, _ = rt.Transport().OverlapStats()
	}
	if n := rt.Transport().OverlapTable().PolicyErrors; n != 0 {
		return fmt.Errorf("%d overlap policy errors", n)
	}
	r.logf("engine books clean: %d of %d rendezvous messages prefetched, %d onloaded", pre, st.Rendezvous.Load(), onl)
	return nil
}

// ---------------------------------------------------------------------------
// Request / Respond, RequestFuture, timeouts.

// askCmd has an asker actor request target with Context.Request.
type askCmd struct {
	target *pa.PID
	n      int
	reply  chan error
}

// asker requests from inside an actor (the echo sees the asker as sender);
// the answer comes back as a message.
func asker() pa.ReceiveFunc {
	var pending *askCmd
	return func(c pa.Context) {
		switch m := c.Message().(type) {
		case *askCmd:
			pending = m
			c.Request(m.target, &aPing{N: m.n})
		case *aPong:
			p := pending
			if p == nil {
				return
			}
			pending = nil
			p.reply <- checkPong(m, actor.RankOf(p.target), p.n)
		}
	}
}

// silentTimeout is the timeout of requests nobody answers.
const silentTimeout = 300 * time.Millisecond

// actorRequest: every rank requests every other rank's echo: sequential
// Requests, 20 RequestFutures in flight at once, protoactor's own
// RequestFuture, and Context.Request from inside an actor; requests to an
// actor that never answers time out after their timeout (not before, and
// not never).
func actorRequest(ctx context.Context, r *rank) error {
	return withActors(ctx, r, actor.Options{}, func(rt *actor.Runtime) error {
		if _, err := spawn(rt, "echo", echo(rt)); err != nil {
			return err
		}
		if _, err := spawn(rt, "silent", func(pa.Context) {}); err != nil {
			return err
		}
		ask, err := spawn(rt, "asker", asker())
		if err != nil {
			return err
		}
		if err := r.b.Barrier(ctx, "actor-request.spawned"); err != nil {
			return err
		}
		for p := 0; p < rt.Size(); p++ {
			if p == rt.Rank() {
				continue
			}
			for i := 0; i < 50; i++ {
				if err := ping(rt, p, i); err != nil {
					return err
				}
			}
			var fs []*pa.Future
			for i := 0; i < 20; i++ {
				f, err := rt.RequestFuture(rt.PID(p, "echo"), &aPing{N: 100 + i}, actorTimeout)
				if err != nil {
					return fmt.Errorf("RequestFuture %d to rank %d: %w", i, p, err)
				}
				fs = append(fs, f)
			}
			for i, f := range fs {
				res, err := actor.Result(f)
				if err != nil {
					return fmt.Errorf("future %d from rank %d: %w", i, p, err)
				}
				if err := checkPong(res, p, 100+i); err != nil {
					return err
				}
			}
			res, err := rt.Root().RequestFuture(rt.PID(p, "echo"), &aPing{N: 7}, actorTimeout).Result()
			if err != nil {
				return fmt.Errorf("protoactor RequestFuture to rank %d: %w", p, err)
			}
			if err := checkPong(res, p, 7); err != nil {
				return err
			}
			reply := make(chan error, 1)
			rt.Root().Send(ask, &askCmd{target: rt.PID(p, "echo"), n: 9, reply: reply})
			select {
			case err := <-reply:
				if err != nil {
					return fmt.Errorf("Context.Request to rank %d: %w", p, err)
				}
			case <-time.After(actorTimeout):
				return fmt.Errorf("Context.Request to rank %d: no answer", p)
			}

			// Timeouts.
			start := time.Now()
			_, err = rt.Request(rt.PID(p, "silent"), &aPing{}, silentTimeout)
			d := time.Since(start)
			if !errors.Is(err, pa.ErrTimeout) {
				return fmt.Errorf("request to rank %d's silent actor: %v, want ErrTimeout", p, err)
			}
			if d < silentTimeout || d > actorTimeout {
				return fmt.Errorf("request with a %v timeout timed out after %v", silentTimeout, d)
			}
			f, err := rt.RequestFuture(rt.PID(p, "silent"), &aPing{}, silentTimeout)
			if err != nil {
				return err
			}
			if _, err := actor.Result(f); !errors.Is(err, pa.ErrTimeout) {
				return fmt.Errorf("future on rank %d's silent actor: %v, want ErrTimeout", p, err)
			}
			// The pair still works after timeouts.
			if err := ping(rt, p, 1000); err != nil {
				return err
			}
		}
		r.logf("requests, futures and timeouts ok with every other rank")
		return nil
	})
}

func TestActorRequest(t *testing.T) {
	forActorTLS(t, func(t *testing.T, c cfg) {
		res := runJob(t, "actor-request", actorRanks, c)
		for i := 0; i < actorRanks; i++ {
			requireLine(t, res, fmt.Sprintf("[%d] rank %d: requests, futures and timeouts ok with every other rank", i, i))
		}
	})
}

// ---------------------------------------------------------------------------
// Unknown actors and unregistered types.

// noActorLimit is how soon a request to an actor that does not exist must
// fail: "at once", far below its timeout (actorTimeout), with room for a
// slow shared machine.
const noActorLimit = 5 * time.Second

// actorErrors: requests to an actor that does not exist fail at once with
// ErrNoActor (Request, RequestFuture + Result; protoactor's future gets
// ErrDeadLetter); a message of an unregistered type fails at the sender's
// Send/Request/RequestFuture with ErrUnregistered (protoactor's Send puts it
// in the sender's dead letters, its RequestFuture gets an
// *UndeliverableError at once), and nothing malformed reaches any rank.
func actorErrors(ctx context.Context, r *rank) error {
	return withActors(ctx, r, actor.Options{}, func(rt *actor.Runtime) error {
		if _, err := spawn(rt, "echo", echo(rt)); err != nil {
			return err
		}
		if err := r.b.Barrier(ctx, "actor-errors.spawned"); err != nil {
			return err
		}
		for p := 0; p < rt.Size(); p++ {
			if p == rt.Rank() {
				continue
			}
			nobody := rt.PID(p, "nobody")
			start := time.Now()
			_, err := rt.Request(nobody, &aPing{}, actorTimeout)
			if d := time.Since(start); !errors.Is(err, actor.ErrNoActor) || d > noActorLimit {
				return fmt.Errorf("request to rank %d's missing actor: %v after %v, want ErrNoActor within %v", p, err, d, noActorLimit)
			}
			start = time.Now()
			f, err := rt.RequestFuture(nobody, &aPing{}, actorTimeout)
			if err != nil {
				return err
			}
			if _, err := actor.Result(f); !errors.Is(err, actor.ErrNoActor) || time.Since(start) > noActorLimit {
				return fmt.Errorf("future on rank %d's missing actor: %v after %v, want ErrNoActor", p, err, time.Since(start))
			}
			start = time.Now()
			if _, err := rt.Root().RequestFuture(nobody, &aPing{}, actorTimeout).Result(); !errors.Is(err, pa.ErrDeadLetter) || time.Since(start) > noActorLimit {
				return fmt.Errorf("protoactor future on rank %d's missing actor: %v after %v, want ErrDeadLetter", p, err, time.Since(start))
			}

			echoPID := rt.PID(p, "echo")
			for name, f := range map[string]func() error{
				"Send":       func() error { return rt.Send(echoPID, &notRegistered{X: 1}) },
				"Send value": func() error { return rt.Send(echoPID, notRegistered{X: 1}) },
				"Request":    func() error { _, err := rt.Request(echoPID, &notRegistered{}, actorTimeout); return err },
				"Check":      func() error { return actor.Check(&notRegistered{}) },
				"SendFrom":   func() error { return rt.SendFrom(rt.PID(rt.Rank(), "echo"), echoPID, &notRegistered{}) },
				"RequestFuture": func() error {
					_, err := rt.RequestFuture(echoPID, &notRegistered{}, actorTimeout)
					return err
				},
			} {
				start := time.Now()
				if err := f(); !errors.Is(err, actor.ErrUnregistered) || time.Since(start) > noActorLimit {
					return fmt.Errorf("%s of an unregistered type to rank %d: %v after %v, want ErrUnregistered", name, p, err, time.Since(start))
				}
			}
			dead := make(chan *pa.DeadLetterEvent, 16)
			sub := rt.System().EventStream.Subscribe(func(ev any) {
				if dl, ok := ev.(*pa.DeadLetterEvent); ok && samePID(dl.PID, echoPID) {
					dead <- dl
				}
			})
			rt.Root().Send(echoPID, &notRegistered{X: 2})
			rt.System().EventStream.Unsubscribe(sub)
			select {
			case dl := <-dead:
				if ue, ok := dl.Message.(*actor.UndeliverableError); !ok || !strings.Contains(ue.Reason, "not registered") {
					return fmt.Errorf("dead letter for protoactor's Send of an unregistered type: %#v", dl.Message)
				}
			default:
				return errors.New("protoactor's Send of an unregistered type left no dead letter")
			}
			res, err := actor.Result(rt.Root().RequestFuture(echoPID, &notRegistered{X: 3}, actorTimeout))
			var ue *actor.UndeliverableError
			if !errors.As(err, &ue) || !strings.Contains(ue.Reason, "not registered") {
				return fmt.Errorf("protoactor RequestFuture of an unregistered type: %v %v, want *UndeliverableError", res, err)
			}
			if err := ping(rt, p, 5); err != nil {
				return fmt.Errorf("after the failures: %w", err)
			}
		}
		if err := r.b.Barrier(ctx, "actor-errors.done"); err != nil {
			return err
		}
		if n := rt.Stats().DecodeErrors.Load(); n != 0 {
			return fmt.Errorf("%d malformed messages reached rank %d", n, rt.Rank())
		}
		r.logf("missing actors and unregistered types fail at once")
		return nil
	})
}

func TestActorNoActorAndUnregistered(t *testing.T) {
	forActorTLS(t, func(t *testing.T, c cfg) {
		res := runJob(t, "actor-errors", actorRanks, c)
		for i := 0; i < actorRanks; i++ {
			requireLine(t, res, fmt.Sprintf("[%d] rank %d: missing actors and unregistered types fail at once", i, i))
		}
	})
}

// ---------------------------------------------------------------------------
// Watch, Unwatch, Stop, Poison of remote actors.

// actorWatch: ranks 0 and 2 each watch actors on rank 1. A remote Stop and
// a remote Poison give the watcher Terminated(Stopped); an unwatched actor's
// stop (by StopFuture across ranks) gives it nothing; watching an actor that
// does not exist gives Terminated(NotFound).
func actorWatch(ctx context.Context, r *rank) error {
	return withActors(ctx, r, actor.Options{}, func(rt *actor.Runtime) error {
		name := func(what string, q int) string { return fmt.Sprintf("%s-%d", what, q) }
		if r.id() == 1 {
			for _, q := range []int{0, 2} {
				for _, what := range []string{"a", "b", "c", "d"} {
					if _, err := spawn(rt, name(what, q), echo(rt)); err != nil {
						return err
					}
				}
			}
		}
		if err := r.b.Barrier(ctx, "actor-watch.spawned"); err != nil {
			return err
		}
		if r.id() != 1 {
			q := r.id()
			a, b, c, d := rt.PID(1, name("a", q)), rt.PID(1, name("b", q)), rt.PID(1, name("c", q)), rt.PID(1, name("d", q))
			w, term, err := newWatcher(rt, "watcher")
			if err != nil {
				return err
			}
			// Stop.
			if err := command(rt, w, a, false); err != nil {
				return err
			}
			rt.Root().Stop(a)
			if _, err := expectTerminated(term, a, pa.TerminatedReason_Stopped, actorTimeout); err != nil {
				return fmt.Errorf("after a remote Stop: %w", err)
			}
			// Poison.
			if err := command(rt, w, b, false); err != nil {
				return err
			}
			rt.Root().Poison(b)
			if _, err := expectTerminated(term, b, pa.TerminatedReason_Stopped, actorTimeout); err != nil {
				return fmt.Errorf("after a remote Poison: %w", err)
			}
			// Unwatch: c stops (StopFuture across ranks returns once it
			// has) and the watcher hears nothing; then d's stop is the
			// next Terminated it gets.
			if err := command(rt, w, c, false); err != nil {
				return err
			}
			if err := command(rt, w, c, true); err != nil {
				return err
			}
			if err := rt.Root().StopFuture(c).Wait(); err != nil {
				return fmt.Errorf("StopFuture of a remote actor: %w", err)
			}
			if err := command(rt, w, d, false); err != nil {
				return err
			}
			rt.Root().Stop(d)
			if _, err := expectTerminated(term, d, pa.TerminatedReason_Stopped, actorTimeout); err != nil {
				return fmt.Errorf("after Unwatch of c and a Stop of d: %w", err)
			}
			// A stopped actor is gone: requests to it fail at once.
			if _, err := rt.Request(a, &aPing{}, actorTimeout); !errors.Is(err, actor.ErrNoActor) {
				return fmt.Errorf("request to a stopped remote actor: %v, want ErrNoActor", err)
			}
			// Watching an actor that does not exist.
			ghost := rt.PID(1, name("ghost", q))
			if err := command(rt, w, ghost, false); err != nil {
				return err
			}
			if _, err := expectTerminated(term, ghost, pa.TerminatedReason_NotFound, actorTimeout); err != nil {
				return fmt.Errorf("watching a missing remote actor: %w", err)
			}
			select {
			case m := <-term:
				return fmt.Errorf("unexpected Terminated{Who: %s, Why: %s}", m.Who, m.Why)
			default:
			}
			r.logf("remote Stop, Poison, Unwatch and missing watchee ok")
		}
		return r.b.Barrier(ctx, "actor-watch.done")
	})
}

func TestActorWatch(t *testing.T) {
	forActorTLS(t, func(t *testing.T, c cfg) {
		res := runJob(t, "actor-watch", actorRanks, c)
		requireLine(t, res, "[0] rank 0: remote Stop, Poison, Unwatch and missing watchee ok")
		requireLine(t, res, "[2] rank 2: remote Stop, Poison, Unwatch and missing watchee ok")
	})
}

// ---------------------------------------------------------------------------
// A whole rank killed.

// killLimit bounds how long after the victim rank's SIGKILL its watchers
// must get Terminated(AddressTerminated) and requests pending on it must
// fail. The transport detects a lost peer within 2 s (TestDeadPeer); the
// rest is slack for the race detector on a loaded 2-core machine. Pending
// requests have a 60 s timeout, so failing within this is not a timeout.
const killLimit = 5 * time.Second

const (
	tagKillReady = 40 + iota
	tagKillGo
	tagKillFin
	tagKillFin2
)

// resultWithin waits up to limit for a future's result.
func resultWithin(f *pa.Future, limit time.Duration) (any, error, bool) {
	type result struct {
		res any
		err error
	}
	ch := make(chan result, 1)
	go func() {
		res, err := f.Result()
		ch <- result{res, err}
	}()
	select {
	case x := <-ch:
		return x.res, x.err, true
	case <-time.After(limit):
		return nil, nil, false
	}
}

// exchange is a two-rank barrier over transport tags.
func exchange(ctx context.Context, r *rank, peer, tag int) error {
	if err := r.t.Send(ctx, peer, tag, []byte{1}); err != nil {
		return fmt.Errorf("tag %d to rank %d: %w", tag, peer, err)
	}
	if _, err := r.t.Recv(ctx, peer, tag, make([]byte, 1)); err != nil {
		return fmt.Errorf("tag %d from rank %d: %w", tag, peer, err)
	}
	return nil
}

// actorKill (3 ranks): ranks 0 and 1 watch an actor on rank 2 and have
// requests pending on it (Runtime.RequestFuture, protoactor's
// RequestFuture and a blocking Runtime.Request, 60 s timeouts) when rank 2 SIGKILLs itself. Both watchers
// get Terminated(AddressTerminated) and both requests fail within
// killLimit; afterwards sends and requests to rank 2 fail at once, a new
// watch of one of its actors is answered at once, and ranks 0 and 1 keep
// exchanging requests.
func actorKill(ctx context.Context, r *rank) error {
	r.skipFinalBarrier = true // rank 2 will not come
	rt, err := actor.Init(ctx, actor.Options{Transport: r.t})
	if err != nil {
		return fmt.Errorf("actor.Init: %w", err)
	}
	if _, err := spawn(rt, "echo", echo(rt)); err != nil {
		return err
	}
	if r.id() == 2 {
		if _, err := spawn(rt, "victim2", echo(rt)); err != nil {
			return err
		}
	}
	// The launcher stops the survivors (SIGTERM) once rank 2 dies; they
	// finish their checks, and rankMain its close, first. The handler is in
	// place before rank 2 can die, and stays after this function returns
	// (since the launcher's loss notice the checks take milliseconds, and
	// the SIGTERM may come later).
	signal.Notify(make(chan os.Signal, 1), syscall.SIGTERM)
	if err := r.b.Barrier(ctx, "actor-kill.spawned"); err != nil {
		return err
	}
	if r.id() == 2 {
		if _, err := r.t.Recv(ctx, 0, tagKillGo, make([]byte, 1)); err != nil {
			return fmt.Errorf("go from rank 0: %w", err)
		}
		r.logf("KILL_AT_NS=%d", time.Now().UnixNano())
		syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	}

	peer := 1 - r.id()
	victim := rt.PID(2, "echo")
	w, terms, err := newWatcher(rt, "watcher")
	if err != nil {
		return err
	}
	if err := command(rt, w, victim, false); err != nil {
		return err
	}
	if err := ping(rt, 2, 1); err != nil { // rank 2 is alive and has the watch
		return err
	}
	f1, err := rt.RequestFuture(victim, &hold{N: 1}, 60*time.Second)
	if err != nil {
		return err
	}
	f2 := rt.Root().RequestFuture(victim, &hold{N: 2}, 60*time.Second)
	f3 := pa.NewFuture(rt.System(), 60*time.Second) // a blocking Request's result
	go func() {
		res, err := rt.Request(victim, &hold{N: 3}, 60*time.Second)
		if err != nil {
			res = err
		}
		rt.Root().Send(f3.PID(), res)
	}()
	var since time.Time
	if r.id() == 1 {
		since = time.Now()
		if err := r.t.Send(ctx, 0, tagKillReady, []byte{1}); err != nil {
			return err
		}
	} else {
		if _, err := r.t.Recv(ctx, 1, tagKillReady, make([]byte, 1)); err != nil {
			return err
		}
		since = time.Now()
		if err := r.t.Send(ctx, 2, tagKillGo, []byte{1}); err != nil {
			return err
		}
	}
	if _, err := expectTerminated(terms, victim, pa.TerminatedReason_AddressTerminated, killLimit); err != nil {
		return fmt.Errorf("watcher of an actor on the killed rank: %w", err)
	}
	r.logf("TERMINATED_AT_NS=%d", time.Now().UnixNano())
	for i, f := range []*pa.Future{f1, f2, f3} {
		res, err, ok := resultWithin(f, killLimit)
		if !ok {
			return fmt.Errorf("request %d pending on the killed rank: no answer %v after its death", i+1, time.Since(since))
		}
		if err == nil {
			err, _ = res.(error)
		}
		var ue *actor.UndeliverableError
		if !errors.As(err, &ue) || !errors.Is(err, transport.ErrPeerLost) {
			return fmt.Errorf("request %d pending on the killed rank: %v %v, want an *UndeliverableError wrapping ErrPeerLost", i+1, res, err)
		}
		r.logf("pending request %d failed %v after the kill was triggered: %v", i+1, time.Since(since).Round(time.Millisecond), err)
	}
	// Now everything aimed at rank 2 fails at once.
	start := time.Now()
	if err := rt.Send(victim, &aPing{}); !errors.Is(err, transport.ErrPeerLost) {
		return fmt.Errorf("send to the killed rank: %v, want ErrPeerLost", err)
	}
	if _, err := rt.Request(victim, &aPing{}, 60*time.Second); !errors.Is(err, transport.ErrPeerLost) {
		return fmt.Errorf("request to the killed rank: %v, want ErrPeerLost", err)
	}
	victim2 := rt.PID(2, "victim2")
	if err := command(rt, w, victim2, false); err != nil {
		return err
	}
	if _, err := expectTerminated(terms, victim2, pa.TerminatedReason_AddressTerminated, killLimit); err != nil {
		return fmt.Errorf("new watch on the killed rank: %w", err)
	}
	if d := time.Since(start); d > killLimit {
		return fmt.Errorf("operations on the killed rank took %v", d)
	}
	// The survivors keep talking.
	for i := 0; i < 50; i++ {
		if err := ping(rt, peer, i); err != nil {
			return fmt.Errorf("after rank 2's death: %w", err)
		}
	}
	if n := rt.Stats().WatchesByLoss.Load(); n < 1 {
		return fmt.Errorf("Stats.WatchesByLoss = %d", n)
	}
	// Shut down together: nobody flushes to a rank that already left.
	if err := exchange(ctx, r, peer, tagKillFin); err != nil {
		return err
	}
	sctx, cancel := context.WithTimeout(ctx, actorTimeout)
	defer cancel()
	if err := rt.Shutdown(sctx); err != nil {
		return fmt.Errorf("Shutdown: %w", err)
	}
	if err := exchange(ctx, r, peer, tagKillFin2); err != nil {
		return err
	}
	r.logf("watch, pending requests and new operations on the killed rank ok")
	return nil
}

var killNS = regexp.MustCompile(`(?m)^\[(\d)\] rank \d: (KILL|TERMINATED)_AT_NS=(\d+)$`)

func TestActorKillRank(t *testing.T) {
	forActorTLS(t, func(t *testing.T, c cfg) {
		res := launch(t, "actor-kill", actorRanks, c)
		requireRank2Killed(t, res)
		if strings.Contains(res.stderr, "FAILED") {
			t.Fatalf("a rank reported a failure:\n%s", res.dump())
		}
		for i := 0; i < 2; i++ {
			requireLine(t, res, okLine("actor-kill", i))
			requireLine(t, res, fmt.Sprintf("[%d] rank %d: watch, pending requests and new operations on the killed rank ok", i, i))
		}
		checkTLS(t, res, actorRanks, c)
		for rk, d := range sinceKill(t, res, killNS) {
			t.Logf("%s: rank %d's watcher got Terminated(AddressTerminated) %v after rank 2's SIGKILL", c.tls, rk, d.Round(time.Microsecond))
			if d > killLimit {
				t.Errorf("rank %d: Terminated %v after the kill, more than %v", rk, d, killLimit)
			}
		}
		if testing.Verbose() {
			t.Logf("output:\n%s\nstderr:\n%s", res.stdout, res.stderr)
		}
	})
}

// actorLostSilent (3 ranks): rank 2 SIGKILLs itself before any rank sent
// it anything, so neither survivor has a UCX endpoint to it that could
// fail. Ranks 0 and 1, which send nothing to it, must still see Lost()
// close within killLimit, naming rank 2 (the launcher's rendezvous tells
// them: docs/launcher.md, "Lost ranks"), and a send to rank 2 must then
// fail with ErrPeerLost at once. Before 2026-11-25 Lost() closed only when
// an endpoint failed, and the survivors waited for ever.
func actorLostSilent(ctx context.Context, r *rank) error {
	r.skipFinalBarrier = true // rank 2 will not come
	rt, err := actor.Init(ctx, actor.Options{Transport: r.t})
	if err != nil {
		return fmt.Errorf("actor.Init: %w", err)
	}
	if _, err := spawn(rt, "echo", echo(rt)); err != nil {
		return err
	}
	// The survivors talk to each other first (never to rank 2): their
	// last exchange then runs between connected endpoints. A first
	// message on a new TCP endpoint could fail with "Endpoint timeout"
	// when its receiver shut down right after taking it (1 job in 30).
	if r.id() < 2 {
		if err := exchange(ctx, r, 1-r.id(), tagKillReady); err != nil {
			return err
		}
	}
	// The launcher stops the survivors (SIGTERM) once rank 2 dies; they
	// finish their checks, and rankMain its close, first. The handler is
	// in place before rank 2 can die (it killed a survivor that had not
	// installed it yet), and stays after this function returns.
	signal.Notify(make(chan os.Signal, 1), syscall.SIGTERM)
	if err := r.b.Barrier(ctx, "actor-lost-silent.spawned"); err != nil {
		return err
	}
	if r.id() == 2 {
		r.logf("KILL_AT_NS=%d", time.Now().UnixNano())
		syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	}

	select {
	case <-rt.Lost():
	case <-time.After(killLimit):
		return fmt.Errorf("rt.Lost() not closed %v after rank 2 killed itself (LostErr %v)", killLimit, rt.LostErr())
	}
	r.logf("LOST_AT_NS=%d", time.Now().UnixNano())
	var pl *transport.PeerLostError
	if err := rt.LostErr(); !errors.As(err, &pl) || pl.Rank != 2 {
		return fmt.Errorf("LostErr = %v, want rank 2 lost", err)
	}
	r.logf("LostErr: %v", rt.LostErr())
	if err := rt.Send(rt.PID(2, "echo"), &aPing{}); !errors.Is(err, transport.ErrPeerLost) {
		return fmt.Errorf("send to the killed rank: %v, want ErrPeerLost", err)
	}
	// Shut down together: nobody flushes to a rank that already left.
	if err := exchange(ctx, r, 1-r.id(), tagKillFin); err != nil {
		return err
	}
	sctx, cancel := context.WithTimeout(ctx, actorTimeout)
	defer cancel()
	if err := rt.Shutdown(sctx); err != nil {
		return fmt.Errorf("Shutdown: %w", err)
	}
	r.logf("Lost without traffic to the killed rank ok")
	return nil
}

var lostNS = regexp.MustCompile(`(?m)^\[(\d)\] rank \d: (KILL|LOST)_AT_NS=(\d+)$`)

// TestActorLostSilentRank: every survivor learns of a dead rank it never
// talked to (actorLostSilent).
func TestActorLostSilentRank(t *testing.T) {
	forActorTLS(t, func(t *testing.T, c cfg) {
		res := launch(t, "actor-lost-silent", actorRanks, c)
		requireRank2Killed(t, res)
		for i := 0; i < 2; i++ {
			requireLine(t, res, okLine("actor-lost-silent", i))
			requireLine(t, res, fmt.Sprintf("[%d] rank %d: Lost without traffic to the killed rank ok", i, i))
		}
		checkTLS(t, res, actorRanks, c)
		for rk, d := range sinceKill(t, res, lostNS) {
			t.Logf("%s: rank %d's Lost() closed %v after rank 2's SIGKILL", c.tls, rk, d.Round(time.Microsecond))
		}
	})
}

// requireRank2Killed checks that the job ended with rank 2 killed by
// SIGKILL.
func requireRank2Killed(t *testing.T, res jobResult) {
	t.Helper()
	var rf *bootstrap.RankFailure
	if !errors.As(res.err, &rf) || rf.Rank != 2 || rf.Signal != syscall.SIGKILL {
		t.Fatalf("Launch returned %v, want rank 2 killed by SIGKILL:\n%s", res.err, res.dump())
	}
}

// sinceKill reads, from lines re matches ("[r] rank r: KILL_AT_NS=..." and
// one other kind per survivor), how long after rank 2's kill each of ranks
// 0 and 1 saw it.
func sinceKill(t *testing.T, res jobResult, re *regexp.Regexp) []time.Duration {
	t.Helper()
	var kill int64
	seen := map[int]int64{}
	for _, m := range re.FindAllStringSubmatch(res.stdout, -1) {
		rk, _ := strconv.Atoi(m[1])
		ns, _ := strconv.ParseInt(m[3], 10, 64)
		if m[2] == "KILL" {
			kill = ns
		} else {
			seen[rk] = ns
		}
	}
	if kill == 0 || len(seen) != 2 {
		t.Fatalf("missing KILL_AT_NS lines or a survivor's (%v):\n%s", re, res.dump())
	}
	return []time.Duration{time.Duration(seen[0] - kill), time.Duration(seen[1] - kill)}
}

// ---------------------------------------------------------------------------
// Flood: bounded memory under 1,000,000 messages to a slow actor.

const (
	// floodSenders: ranks 0 and 2 send, rank 1's slow actor receives.
	floodSenders = 2
	// floodSlowEvery: the slow actor sleeps floodSlowFor every this many
	// messages, so that it, not the senders, sets the pace.
	floodSlowEvery = 100
	floodSlowFor   = time.Millisecond
	// floodStallFill: at the stall points the slow actor stops until this
	// many messages wait for it, proving the senders ran into their credit
	// windows (a blocked sender has at least Credits - Credits/4 messages
	// outstanding: credits come back in batches of a quarter window).
	floodStallFill = actor.DefaultCredits * 3 / 4
	// floodLife bounds each rank's life in the flood job (a liveness limit;
	// the flood takes about 10 s).
	floodLife = 120 * time.Second
)

// floodPerSender is how many ticks each sender sends: 1,000,000 in all.
// Under the race detector, which makes every message about six times
// dearer, 200,000 in all: the flow-control code still runs under the
// detector, and `make test` runs the full flood without it.
func floodPerSender() int {
	if raceEnabled {
		return 100_000
	}
	return 500_000
}

// floodStalls are the totals processed at which the slow actor stalls.
func floodStalls() map[int]bool {
	n := floodSenders * floodPerSender()
	return map[int]bool{n / 10: true, n * 4 / 10: true, n * 7 / 10: true}
}

// floodRSSBound bounds how much the receiving rank's resident memory may
// grow (VmHWM during the flood minus VmRSS before it) while 1,000,000
// ticks pass through it.
//
// With per-peer credits a sender has at most actor.DefaultCredits (16384)
// units outstanding to a rank, one unit per message plus one per
// actor.CreditBytes (512 B) of body, and a unit comes back only once the
// actor has processed its message. A unit stands for 512 bytes of the
// receiver's memory: a small message's bookkeeping (decoded value,
// protoactor envelope, mailbox slot; about 320 B measured) or 512 B of its
// bytes. So rank 1 never holds more than floodSenders x DefaultCredits x
// CreditBytes = 16 MiB for any mix of sizes (the bound); here that is at
// most floodSenders x 16384 = 32,768 unprocessed ticks.
// Measured: about 10 MiB (backlog peaking at 32,763 ticks). Without flow
// control (TROUPE_ITEST_FLOOD_CREDITS=100000000) the same flood queues some
// 400,000 ticks and grows RSS by about 60 MiB: the bound tells them apart.
const floodRSSBound = floodSenders * actor.DefaultCredits * actor.CreditBytes

// floodState is the slow actor's, read by its rank once the actor is done.
type floodState struct {
	processed  int
	maxBacklog int64
	stalls     int
	errs       collector
	done       chan struct{}
}

// slowActor processes ticks slowly, checks each sender's order, and
// stalls at floodStalls until floodStallFill messages wait for it. The
// backlog is what rank 1 received (Stats.Received, counted on arrival)
// minus what the actor processed.
func slowActor(rt *actor.Runtime, st *floodState, received0 uint64) pa.ReceiveFunc {
	next := map[int]int{}
	stalls := floodStalls()
	dones := 0
	backlog := func() int64 {
		return int64(rt.Stats().Received.Load()-received0) - int64(st.processed)
	}
	return func(c pa.Context) {
		switch m := c.Message().(type) {
		case *tick:
			st.maxBacklog = max(st.maxBacklog, backlog())
			if m.N != next[m.From] {
				st.errs.add("rank %d's tick %d arrived when %d was due", m.From, m.N, next[m.From])
			}
			next[m.From] = m.N + 1
			if stalls[st.processed] {
				// Wait (polling) for the senders to fill their windows.
				deadline := time.Now().Add(actorTimeout)
				for backlog() < floodStallFill && time.Now().Before(deadline) {
					time.Sleep(time.Millisecond)
				}
				if b := backlog(); b < floodStallFill {
					st.errs.add("stalled at %d: only %d messages queued after %v", st.processed, b, actorTimeout)
				}
				st.maxBacklog = max(st.maxBacklog, backlog())
				st.stalls++
			}
			if st.processed%floodSlowEvery == 0 {
				time.Sleep(floodSlowFor)
			}
			st.processed++
		case *seqDone:
			v := &verdict{}
			if next[m.From] != m.Count {
				v.Err = fmt.Sprintf("slow actor saw %d of rank %d's %d ticks", next[m.From], m.From, m.Count)
			} else if err := st.errs.err(); err != nil {
				v.Err = err.Error()
			}
			c.Respond(v)
			if dones++; dones == floodSenders {
				close(st.done)
			}
		}
	}
}

// actorFlood: ranks 0 and 2 each send floodPerSender ticks to a slow actor
// on rank 1 as fast as their credits let them. Rank 1 checks each sender's
// order, that the senders really were throttled (the backlog reached most
// of a window at every stall and never exceeded the two windows), and,
// without the race detector, that its RSS grew by less than floodRSSBound.
func actorFlood(ctx context.Context, r *rank) error {
	opts := actor.Options{}
	if v, err := strconv.Atoi(os.Getenv("TROUPE_ITEST_FLOOD_CREDITS")); err == nil {
		opts.Credits = v // for trying the bound without flow control; never in CI
	}
	perSender := floodPerSender()
	return withActors(ctx, r, opts, func(rt *actor.Runtime) error {
		slow := rt.PID(1, "slow")
		if r.id() != 1 {
			if err := r.b.Barrier(ctx, "actor-flood.ready"); err != nil {
				return err
			}
			start := time.Now()
			for i := 0; i < perSender; i++ {
				if err := rt.Send(slow, &tick{From: r.id(), N: i}); err != nil {
					return fmt.Errorf("tick %d: %w", i, err)
				}
			}
			sent := time.Since(start)
			res, err := rt.Request(slow, &seqDone{From: r.id(), Count: perSender}, floodLife)
			if err != nil {
				return fmt.Errorf("asking the slow actor: %w", err)
			}
			if v, ok := res.(*verdict); !ok || v.Err != "" {
				return fmt.Errorf("slow actor's verdict: %#v", res)
			}
			waits := rt.Stats().CreditWaits.Load()
			if waits == 0 && opts.Credits == 0 {
				return errors.New("the sender never waited for credits: the actor was not slow, the test proves nothing")
			}
			r.logf("sent %d ticks in %v, in order; %d sends waited for credits", perSender, sent.Round(time.Millisecond), waits)
			return nil
		}

		// Rank 1.
		st := &floodState{done: make(chan struct{})}
		if _, err := spawn(rt, "slow", slowActor(rt, st, rt.Stats().Received.Load())); err != nil {
			return err
		}
		debug.FreeOSMemory()
		base, err := procStatus("VmRSS")
		if err != nil {
			return err
		}
		reset := resetHWM()
		var peak atomic.Int64 // sampled RSS, in case VmHWM could not be reset
		stopSampling := make(chan struct{})
		sampled := make(chan struct{})
		go func() {
			defer close(sampled)
			for {
				if v, err := procStatus("VmRSS"); err == nil && v > peak.Load() {
					peak.Store(v)
				}
				select {
				case <-stopSampling:
					return
				case <-time.After(20 * time.Millisecond):
				}
			}
		}()
		if err := r.b.Barrier(ctx, "actor-flood.ready"); err != nil {
			return err
		}
		start := time.Now()
		select {
		case <-st.done:
		case <-ctx.Done():
			return fmt.Errorf("flood unfinished after %v: the slow actor is stuck", time.Since(start))
		}
		elapsed := time.Since(start)
		close(stopSampling)
		<-sampled
		hwm, err := procStatus("VmHWM")
		if err != nil {
			return err
		}
		if !reset {
			hwm = peak.Load() // VmHWM still holds the peak before the flood
		}
		growth := hwm - base
		r.logf("FLOOD %d ticks in %v (%.0f/s, race detector %v): RSS %s before, peak %s (VmHWM reset: %v, sampled peak %s), growth %s, bound %s; backlog peaked at %d messages (windows: %d x %d), %d stalls",
			st.processed, elapsed.Round(time.Millisecond), float64(st.processed)/elapsed.Seconds(), raceEnabled,
			mib(base), mib(hwm), reset, mib(peak.Load()), mib(growth), mib(floodRSSBound),
			st.maxBacklog, floodSenders, actor.DefaultCredits, st.stalls)
		if err := st.errs.err(); err != nil {
			return err
		}
		if st.processed != floodSenders*perSender {
			return fmt.Errorf("the slow actor processed %d ticks, want %d", st.processed, floodSenders*perSender)
		}
		if st.stalls != len(floodStalls()) {
			return fmt.Errorf("%d stalls, want %d", st.stalls, len(floodStalls()))
		}
		if opts.Credits == 0 && st.maxBacklog > floodSenders*actor.DefaultCredits {
			return fmt.Errorf("backlog of %d messages exceeds the %d x %d credit windows", st.maxBacklog, floodSenders, actor.DefaultCredits)
		}
		if !raceEnabled && growth > floodRSSBound {
			return fmt.Errorf("RSS grew by %s during the flood, more than the bound %s", mib(growth), mib(floodRSSBound))
		}
		r.logf("flood within bounds")
		return nil
	})
}

// TestActorFlood floods a slow actor with 1,000,000 messages from two
// ranks (200,000 under the race detector, where RSS is not judged: the
// detector shadows every heap byte; `make test` also runs this test
// without it).
func TestActorFlood(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: the 1,000,000-message flood runs without -short (CI runs it in its own non-race step)")
	}
	c := cfg{"shm", "direct"}
	res := runJobFor(t, "actor-flood", actorRanks, c, floodLife)
	requireLine(t, res, "[1] rank 1: flood within bounds")
	for _, line := range strings.Split(res.stdout, "\n") {
		if strings.Contains(line, "FLOOD") || strings.Contains(line, "ticks in") {
			t.Log(line)
		}
	}
}
