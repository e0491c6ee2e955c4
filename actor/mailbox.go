package actor

import (
	"runtime"
	"sync"
	"sync/atomic"

	pa "github.com/asynkron/protoactor-go/actor"
)

// mailbox is the mailbox of actors spawned with Runtime.Props: protoactor's
// default unbounded mailbox in behaviour (system messages first, suspension,
// throughput yields, failures escalated, the same middleware calls), with a
// queue built for one busy producer, the goroutine that delivers remote
// messages. protoactor's queue takes a lock per message on both sides, so
// the actor's goroutine spent much of a 64 B flood spinning on the lock the
// delivering goroutine held (docs/actor.md, Measurements). Here the actor's
// goroutine takes everything queued under one lock and works through it
// without the lock.
//
// The fields each side writes per message sit on cache lines of their own:
// the producer counts posts, the consumer counts invocations, and status is
// written only when the mailbox goes idle or is scheduled. Had both sides
// updated one counter per message, its cache line would move between their
// cores on every message (about a tenth of the delivering goroutine's time
// in a 64 B flood).
type mailbox struct {
	mu   sync.Mutex
	user []any // posted user messages, oldest first (mu)
	sys  []any // posted system messages, oldest first (mu)

	rt          *Runtime // nil outside a runtime (tests)
	invoker     pa.MessageInvoker
	dispatcher  pa.Dispatcher
	middlewares []pa.MailboxMiddleware

	_        [cacheLine]byte
	status   atomic.Int32 // mailboxIdle or mailboxRunning
	sysCount atomic.Int32 // system messages posted and not yet invoked

	_      [cacheLine]byte
	posted atomic.Int64 // user messages posted (producers)

	_ [cacheLine]byte
	// The consumer's side (only the goroutine running the mailbox writes
	// it): the batch of user messages taken from user, next is the first
	// not yet invoked; invoked counts user messages invoked.
	batch     []any
	next      int
	invoked   atomic.Int64
	suspended atomic.Bool
	_         [cacheLine]byte
}

// cacheLine is the padding that keeps a mailbox's producer and consumer
// fields apart (64 B lines; the adjacent-line prefetcher fetches pairs).
const cacheLine = 128

const (
	mailboxIdle int32 = iota
	mailboxRunning
)

// newMailbox returns a producer of mailboxes with the given middlewares.
// With rt set, each mailbox makes itself known to the runtime's record of
// its actor (RegisterHandlers), so that deliveries post to it directly.
func newMailbox(rt *Runtime, middlewares ...pa.MailboxMiddleware) pa.MailboxProducer {
	return func() pa.Mailbox { return &mailbox{rt: rt, middlewares: middlewares} }
}

// PostUserMessage queues a user message and schedules the mailbox. As in
// protoactor's mailbox, the messages of a MessageBatch are posted one by
// one before the batch itself.
//
// Messages from other ranks come through deliver: an envelope posted here
// that carries a credit header is a copy of one already delivered
// (Context.Forward to an actor of this rank passes the envelope itself),
// and is queued as a new envelope whose header keeps the source rank but
// not the credits, which the delivered message's mailbox returns (before,
// both mailboxes returned them, and the sender's window grew).
func (m *mailbox) PostUserMessage(message any) {
	if b, ok := message.(pa.MessageBatch); ok {
		for _, msg := range b.GetMessages() {
			m.PostUserMessage(msg)
		}
	}
	if env, ok := message.(*pa.MessageEnvelope); ok && env != nil {
		if b, ok := env.Message.(pa.MessageBatch); ok {
			for _, msg := range b.GetMessages() {
				m.PostUserMessage(msg)
			}
		}
		if env.Header != nil && m.rt != nil {
			if h, ok := m.rt.uncredited(env.Header); ok {
				message = &pa.MessageEnvelope{Header: h, Message: env.Message, Sender: env.Sender}
			}
		}
	}
	if message == nil {
		// Nothing to deliver (protoactor's Root.Send(pid, nil), say): a
		// dead letter, not a message the actor would have to survive.
		if m.rt != nil {
			m.rt.stats.DeadLetters.Add(1)
		}
		return
	}
	m.post(message, false)
}

// deliver queues env, a message the runtime received from another rank
// (Runtime.deliver): the only way in for a credit header, whose credits
// creditMiddleware returns once the actor has processed the message.
func (m *mailbox) deliver(env *pa.MessageEnvelope) {
	if b, ok := env.Message.(pa.MessageBatch); ok {
		for _, msg := range b.GetMessages() {
			m.PostUserMessage(msg)
		}
	}
	m.post(env, false)
}

// PostSystemMessage queues a system message and schedules the mailbox.
func (m *mailbox) PostSystemMessage(message any) { m.post(message, true) }

// post queues a user or system message, counts it and schedules the
// mailbox.
func (m *mailbox) post(message any, system bool) {
	for _, mw := range m.middlewares {
		mw.MessagePosted(message)
	}
	m.mu.Lock()
	if system {
		m.sys = append(m.sys, message)
	} else {
		m.user = append(m.user, message)
	}
	m.mu.Unlock()
	if system {
		m.sysCount.Add(1)
	} else {
		m.posted.Add(1)
	}
	m.schedule()
}

// RegisterHandlers sets who processes the messages and who runs the mailbox.
// protoactor registers them after the actor's OnInit, where Props records
// the actor in the runtime: the record learns its mailbox here.
func (m *mailbox) RegisterHandlers(invoker pa.MessageInvoker, dispatcher pa.Dispatcher) {
	m.invoker, m.dispatcher = invoker, dispatcher
	c, ok := invoker.(interface{ Self() *pa.PID })
	if m.rt == nil || !ok || c.Self() == nil {
		return
	}
	// Found again by its actor's PID when the actor stops (trackMiddleware),
	// whatever then holds the name's record.
	m.rt.mailboxes.Store(c.Self(), m)
	// Only its own actor's record: never that of another actor of the same
	// name.
	if v, ok := m.rt.local.Load(c.Self().Id); ok && v.(*localActor).pid == c.Self() {
		v.(*localActor).run.mbox.Store(m)
		// A delivery may have cached the record without its mailbox
		// (localTarget): it looks again, and posts here (deliver).
		m.rt.localEpoch.Add(1)
	}
}

// Start tells the middlewares the mailbox started.
func (m *mailbox) Start() {
	for _, mw := range m.middlewares {
		mw.MailboxStarted()
	}
}

// UserMessageCount is the number of user messages not yet processed.
func (m *mailbox) UserMessageCount() int { return int(m.userPending()) }

// userPending is the number of user messages posted and not yet invoked.
// The consumer's count is read first: read second, it could include
// messages posted after the producers' count was read.
func (m *mailbox) userPending() int64 {
	inv := m.invoked.Load()
	return m.posted.Load() - inv
}

func (m *mailbox) schedule() {
	// While the mailbox runs, status is not written: reading it first keeps
	// its cache line shared instead of taking it for a failing swap.
	if m.status.Load() == mailboxIdle && m.status.CompareAndSwap(mailboxIdle, mailboxRunning) {
		m.dispatcher.Schedule(m.process)
	}
}

// process runs the mailbox until it is empty or suspended, then goes idle,
// unless messages came meanwhile.
func (m *mailbox) process() {
	for {
		m.run()
		m.status.Store(mailboxIdle)
		sys, user := m.sysCount.Load(), m.userPending()
		if (sys > 0 || (!m.suspended.Load() && user > 0)) && m.status.CompareAndSwap(mailboxIdle, mailboxRunning) {
			continue
		}
		if user == 0 && !m.suspended.Load() {
			for _, mw := range m.middlewares {
				mw.MailboxEmpty()
			}
		}
		return
	}
}

// run invokes messages, system ones first, until none is left or the
// mailbox is suspended; a panic is escalated as the actor's failure, and
// the message that panicked still counts as received (its sender's
// credits come back: a sender would otherwise block for good after a few
// failing large messages).
func (m *mailbox) run() {
	var msg, invoking any
	defer func() {
		if r := recover(); r != nil {
			m.invoker.EscalateFailure(r, msg)
			if invoking != nil {
				for _, mw := range m.middlewares {
					mw.MessageReceived(invoking)
				}
			}
		}
	}()
	i, t := 0, m.dispatcher.Throughput()
	for {
		if i > t {
			i = 0
			runtime.Gosched()
		}
		i++
		if m.sysCount.Load() > 0 {
			msg = m.popSystem()
			m.sysCount.Add(-1)
			switch msg.(type) {
			case *pa.SuspendMailbox:
				m.suspended.Store(true)
			case *pa.ResumeMailbox:
				m.suspended.Store(false)
			default:
				invoking = msg
				m.invoker.InvokeSystemMessage(msg)
				invoking = nil
			}
			for _, mw := range m.middlewares {
				mw.MessageReceived(msg)
			}
			continue
		}
		if m.suspended.Load() {
			return
		}
		var ok bool
		if msg, ok = m.popUser(); !ok {
			return
		}
		m.invoked.Add(1)
		invoking = msg
		m.invoker.InvokeUserMessage(msg)
		invoking = nil
		for _, mw := range m.middlewares {
			mw.MessageReceived(msg)
		}
	}
}

// actorStopped is called, on the mailbox's goroutine, once its actor has
// stopped. An actor its supervisor stops after a failure stops with its
// mailbox suspended: the mailbox resumes, so that the user messages left
// in it are taken (the stopped actor drops them) and the middlewares see
// them received, which gives their senders' credits back (held for good
// before, they blocked every later message from those ranks to this one).
func (m *mailbox) actorStopped() { m.suspended.Store(false) }

func (m *mailbox) popSystem() any {
	m.mu.Lock()
	msg := m.sys[0]
	m.sys[0] = nil
	m.sys = m.sys[1:]
	m.mu.Unlock()
	return msg
}

// popUser returns the next user message, or false if there is none: from
// the batch, else after swapping the posted messages into the batch.
func (m *mailbox) popUser() (any, bool) {
	if m.next == len(m.batch) {
		m.mu.Lock()
		// The emptied batch becomes the producer's queue: the two slices
		// take turns, so steady traffic allocates nothing.
		m.batch, m.user = m.user, m.batch[:0]
		m.mu.Unlock()
		m.next = 0
		if len(m.batch) == 0 {
			return nil, false
		}
	}
	msg := m.batch[m.next]
	m.batch[m.next] = nil
	m.next++
	return msg, true
}
