package actor

import (
	"reflect"
	"strconv"

	pa "github.com/asynkron/protoactor-go/actor"
)

// PostReceiver is implemented by actors that choose where the Payload of an
// incoming message lands (the post-receive hook; DESIGN 5.1, paper 002). The
// runtime calls PostReceive when the message's header has arrived and before
// its data moves; the data then lands directly in the returned slice, which
// must be exactly in.Size bytes long, and Receive runs with the message once
// it has landed. Returning nil lets the runtime allocate from its pool.
// PostReceive runs on the runtime's progress goroutine, concurrently with
// the actor's Receive: it must be quick and safe for that.
type PostReceiver interface {
	PostReceive(in *Incoming) Payload
}

// Incoming describes a message whose payload is about to arrive.
type Incoming struct {
	Target *pa.PID // the receiving actor
	Sender *pa.PID // the sender, or nil
	Type   string  // the message's registered type name
	Size   int     // payload bytes
}

// localActor is an actor spawned through the runtime's Props.
type localActor struct {
	pid   *pa.PID
	hook  PostReceiver
	actor pa.Actor
	run   *actorRun // how it is dispatched (deferred.go)
}

// Props returns protoactor Props for an actor that other ranks can message
// with bounded memory: its mailbox returns eager credits to the sending
// rank once the actor has processed each message, and its PostReceive hook
// (if it has one) is honoured. Spawn actors that receive remote messages
// with these Props; actors spawned otherwise still receive them, but their
// senders' credits come back on arrival rather than after processing.
func (rt *Runtime) Props(producer pa.Producer, opts ...pa.PropsOption) *pa.Props {
	mw := &creditMiddleware{rt: rt}
	opts = append([]pa.PropsOption{
		pa.WithDispatcher(rt.dispatcher),
		pa.WithReceiverMiddleware(rt.trackMiddleware, deferredMiddleware),
		// Known from the spawn on, before Started is processed: a message
		// arriving at once must find the actor's hooks.
		pa.WithOnInit(func(c pa.Context) {
			rt.trackLocal(c.Self(), c.Actor(), &actorRun{spawnG: goroutineID()})
		}),
	}, opts...)
	// Last, so that a mailbox among opts does not replace it: the
	// runtime's mailbox is what returns the senders' credits.
	opts = append(opts, pa.WithMailbox(newMailbox(rt, mw)))
	return pa.PropsFromProducer(producer, opts...)
}

// PropsFromFunc is Props for a receive function.
func (rt *Runtime) PropsFromFunc(f pa.ReceiveFunc, opts ...pa.PropsOption) *pa.Props {
	return rt.Props(func() pa.Actor { return f }, opts...)
}

// trackMiddleware records the runtime's actors while they live.
func (rt *Runtime) trackMiddleware(next pa.ReceiverFunc) pa.ReceiverFunc {
	return func(c pa.ReceiverContext, env *pa.MessageEnvelope) {
		switch env.Message.(type) {
		case *pa.Started: // again after a restart: a new actor instance
			run := &actorRun{}
			if la, ok := rt.local.Load(c.Self().Id); ok && la.(*localActor).pid == c.Self() {
				run = la.(*localActor).run
			}
			run.started()
			rt.trackLocal(c.Self(), c.Actor(), run)
		case *pa.Stopping:
			// Its process leaves the registry before Stopped: from now on
			// deliveries look it up again.
			rt.localEpoch.Add(1)
		case *pa.Stopped:
			if h := rt.stoppedHook; h != nil {
				h(c.Self())
			}
			// Its own mailbox, found by its PID: protoactor frees the name
			// just before Stopped, and a new actor of the same name may
			// already hold the name's record (before 2026-12-08 the
			// mailbox was looked up through that record, and one a
			// failure suspended stayed suspended with its remote messages
			// and their senders' credits,
			// TestCreditsComeBackFromStoppedFailedActorRespawned).
			if m, ok := rt.mailboxes.LoadAndDelete(c.Self()); ok {
				m.(*mailbox).actorStopped()
			}
			if v, ok := rt.local.Load(c.Self().Id); ok && v.(*localActor).pid == c.Self() {
				// Not a new actor of the same name: this one's record.
				rt.local.CompareAndDelete(c.Self().Id, v)
			}
			rt.localEpoch.Add(1)
		}
		next(c, env)
	}
}

// trackLocal records a as the runtime's actor at pid, with its hooks.
func (rt *Runtime) trackLocal(pid *pa.PID, a pa.Actor, run *actorRun) {
	la := &localActor{pid: pid, actor: a, run: run}
	la.hook, _ = a.(PostReceiver)
	rt.local.Store(pid.Id, la)
	rt.localEpoch.Add(1) // a new instance, maybe with other hooks
}

// creditMiddleware returns credits after an actor processes a remote
// message. Only mailbox.deliver posts an envelope with a credit header:
// a forwarded copy has none (mailbox.PostUserMessage), so a message's
// credits come back once.
type creditMiddleware struct{ rt *Runtime }

func (m *creditMiddleware) MailboxStarted()   {}
func (m *creditMiddleware) MessagePosted(any) {}
func (m *creditMiddleware) MailboxEmpty()     {}
func (m *creditMiddleware) MessageReceived(msg any) {
	env, ok := msg.(*pa.MessageEnvelope)
	if !ok {
		// A message posted without an envelope (no credits, no sender).
		m.dropUntaken(msg)
		return
	}
	m.dropUntaken(env.Message)
	if env.Header == nil {
		return
	}
	// A one-unit message carries its peer's own header map: known by its
	// identity, without two lookups and two conversions per message.
	if in := m.rt.unitHdrs[reflect.ValueOf(env.Header).UnsafePointer()]; in != nil {
		in.credit(1)
		return
	}
	src, ok := env.Header[HeaderSourceRank]
	if !ok {
		return
	}
	cost, ok := env.Header[headerCost]
	if !ok {
		return
	}
	r, err1 := strconv.Atoi(src)
	n, err2 := strconv.Atoi(cost)
	if err1 != nil || err2 != nil || r < 0 || r >= m.rt.size {
		return
	}
	m.rt.in[r].credit(n)
}

// dropUntaken drops what the runtime holds for a message its actor stopped
// before taking: the data of a deferred message, the device memory of a
// landed device message.
func (m *creditMiddleware) dropUntaken(msg any) {
	switch d := msg.(type) {
	case *deferredData:
		if d.drop() {
			m.rt.stats.DeadLetters.Add(1)
		}
	case *landedDevice:
		if d.drop() {
			m.rt.stats.DeadLetters.Add(1)
		}
	}
}

// uncredited returns header h without its credits, and whether it had
// any: the header of a copy of a delivered message, which must not return
// the sender's credits a second time. A credit header from a rank becomes
// that rank's srcHdr; any other header with a cost is copied without it.
func (rt *Runtime) uncredited(h map[string]string) (map[string]string, bool) {
	if in := rt.unitHdrs[reflect.ValueOf(h).UnsafePointer()]; in != nil {
		return in.srcHdr, true
	}
	if _, ok := h[headerCost]; !ok {
		return h, false
	}
	if r, err := strconv.Atoi(h[HeaderSourceRank]); err == nil && r >= 0 && r < rt.size && len(h) == 2 {
		return rt.in[r].srcHdr, true
	}
	c := make(map[string]string, len(h))
	for k, v := range h {
		if k != headerCost {
			c[k] = v
		}
	}
	return c, true
}
