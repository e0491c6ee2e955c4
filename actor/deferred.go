package actor

import (
	"bytes"
	"context"
	"runtime"
	"strconv"
	"sync/atomic"

	pa "github.com/asynkron/protoactor-go/actor"

	"github.com/troupe-hpc/troupe/transport"
)

// Large messages and the overlap engine (docs/overlap.md, section 7).
//
// With the engine on, a rendezvous message to an actor that runs on its own
// goroutine is reported to the engine as an unexpected message: its header
// is here, its actor has not taken it yet. The engine prefetches it (the
// data moves now, into the landing buffer) or onloads it (the data stays at
// the sender until the actor takes the message, then the actor's goroutine
// moves it). Either way the message enters the actor's mailbox at once, in
// send order, as a *deferredData; the runtime's receiver middleware turns it
// into the decoded message before the actor sees it.

// deferredData is a message whose data the receiving actor's goroutine
// completes.
type deferredData struct {
	rt    *Runtime
	it    *inItem
	ct    *codecType
	m     *transport.AMMessage
	dst   []byte             // where the data lands
	req   *transport.Request // the prefetch in flight; nil when onloaded
	taken atomic.Bool        // the actor took it, or it was dropped
}

// planData asks the overlap engine what to do with the data of rendezvous
// message m. It reports false when the runtime should receive the data at
// once as without the engine; else the message is queued for delivery.
func (rt *Runtime) planData(m *transport.AMMessage, in *inPeer, it *inItem, ct *codecType, dst []byte) bool {
	if it.err != "" || it.e.Flags&flagSystem != 0 || !rt.ownGoroutine(it.e.Target) {
		return false
	}
	d := &deferredData{rt: rt, it: it, ct: ct, m: m, dst: dst}
	switch m.Plan(it.e.Source) {
	case transport.AMOnload:
		m.Keep()
		rt.stats.DataOnloaded.Add(1)
	case transport.AMPrefetch:
		req, err := m.RecvData(dst)
		if err != nil {
			it.err = "receiving data: " + err.Error()
			d = nil
			break
		}
		d.req = req
		rt.stats.DataPrefetched.Add(1)
	default:
		return false
	}
	it.deferred, it.ready = d, true
	in.mu.Lock()
	in.push(it)
	in.mu.Unlock()
	return true
}

// complete moves the data (onload) or waits for it (prefetch) and decodes
// the message; it runs on the receiving actor's goroutine. It reports false
// when the message turned out undeliverable (reported as such to sender).
func (d *deferredData) complete(sender *pa.PID) (any, bool) {
	if d.taken.Swap(true) {
		return nil, false
	}
	rt, it := d.rt, d.it
	d.m.Claim()
	req := d.req
	if req == nil {
		var err error
		if req, err = d.m.RecvData(d.dst); err != nil {
			it.err = "receiving data: " + err.Error()
		}
	}
	var werr error
	if req != nil {
		_, werr = req.Wait(context.Background())
	}
	if it.err == "" {
		rt.landed(it, d.ct, d.dst, werr)
	}
	if it.err != "" {
		target := rt.PID(rt.rank, it.e.Target)
		rt.undeliverable(target, nil, sender, it.err)
		if sender == nil && it.landFailed {
			// As deliver does: a sender that named no PID learns of it
			// through its rank's dead letters.
			rt.rejectDevice(it.e.Source, target, it.err)
		}
		return nil, false
	}
	return it.msg, true
}

// drop discards the data of a message its actor never took (it stopped
// first); it reports false if the actor had taken it.
func (d *deferredData) drop() bool {
	if d.taken.Swap(true) {
		return false
	}
	if d.req == nil {
		d.m.Release() // the data stays at the sender, which is told
	} else {
		d.m.Claim()
		_, _ = d.req.Wait(context.Background()) // nothing may still write into dst
	}
	if !d.it.hooked {
		putBuf(d.dst)
	}
	return true
}

// ownGoroutine reports whether the actor with id runs on a goroutine of its
// own, so that it can wait there for a message's data. An actor on
// protoactor's synchronized dispatcher runs on the goroutine that delivers
// its messages (possibly the transport's progress goroutine), where waiting
// for data would stall progress; it gets its messages complete.
func (rt *Runtime) ownGoroutine(id string) bool {
	la, ok := rt.local.Load(id)
	return ok && la.(*localActor).run.own.Load()
}

// actorRun is what the runtime learns about an actor's dispatch, shared by
// its incarnations (restarts).
type actorRun struct {
	spawnG  uint64      // the goroutine that spawned it
	learned atomic.Bool // Started was processed once
	own     atomic.Bool // Started ran on another goroutine than the spawn
	// mbox is its mailbox, once registered, when it is the runtime's
	// (the user's Props may set another).
	mbox atomic.Pointer[mailbox]
}

// started learns, at the actor's first Started, whether the dispatcher runs
// it on a goroutine of its own: a synchronized dispatcher processes Started
// inside the spawn call, on the spawning goroutine.
func (r *actorRun) started() {
	if r.learned.Swap(true) {
		return
	}
	g := goroutineID()
	r.own.Store(g != 0 && r.spawnG != 0 && g != r.spawnG)
}

// goroutineID returns the calling goroutine's id, read from the first line
// of its stack trace ("goroutine 18 [running]:"), or 0 if that fails. It is
// used only twice per actor, to learn how its dispatcher runs it.
func goroutineID() uint64 {
	var buf [64]byte
	b := buf[:runtime.Stack(buf[:], false)]
	b, ok := bytes.CutPrefix(b, []byte("goroutine "))
	if !ok {
		return 0
	}
	i := bytes.IndexByte(b, ' ')
	if i <= 0 {
		return 0
	}
	id, err := strconv.ParseUint(string(b[:i]), 10, 64)
	if err != nil {
		return 0
	}
	return id
}

// deferredMiddleware completes deferred messages, and takes device
// messages out of their landedDevice, before the actor's receive (and any
// middleware of the user's) sees them.
func deferredMiddleware(next pa.ReceiverFunc) pa.ReceiverFunc {
	return func(c pa.ReceiverContext, env *pa.MessageEnvelope) {
		var msg any
		var ok bool
		switch m := env.Message.(type) {
		case *deferredData:
			msg, ok = m.complete(env.Sender)
		case *landedDevice:
			msg, ok = m.take()
		default:
			next(c, env)
			return
		}
		if !ok {
			return
		}
		next(c, &pa.MessageEnvelope{Header: env.Header, Message: msg, Sender: env.Sender})
	}
}
