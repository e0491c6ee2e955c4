package actor

import (
	"fmt"
	"reflect"
	"sync"
	"testing"

	pa "github.com/asynkron/protoactor-go/actor"
)

// stepDispatcher runs a scheduled mailbox only when the test says so.
type stepDispatcher struct{ fns []func() }

func (d *stepDispatcher) Schedule(fn func()) { d.fns = append(d.fns, fn) }
func (d *stepDispatcher) Throughput() int    { return 300 }

func (d *stepDispatcher) runAll() {
	for len(d.fns) > 0 {
		fn := d.fns[0]
		d.fns = d.fns[1:]
		fn()
	}
}

// recordInvoker records what the mailbox hands it; it panics on "boom".
type recordInvoker struct {
	got       []string
	escalated []string
}

func (r *recordInvoker) InvokeSystemMessage(m any) { r.got = append(r.got, fmt.Sprint("sys:", m)) }
func (r *recordInvoker) InvokeUserMessage(m any) {
	if m == "boom" {
		panic("boom!")
	}
	r.got = append(r.got, fmt.Sprint(m))
}
func (r *recordInvoker) EscalateFailure(reason, m any) {
	r.escalated = append(r.escalated, fmt.Sprint(reason, " on ", m))
}

// countMiddleware counts the mailbox's middleware calls.
type countMiddleware struct{ posted, received, empty int }

func (c *countMiddleware) MailboxStarted()     {}
func (c *countMiddleware) MessagePosted(any)   { c.posted++ }
func (c *countMiddleware) MessageReceived(any) { c.received++ }
func (c *countMiddleware) MailboxEmpty()       { c.empty++ }
func (c *countMiddleware) String() string      { return fmt.Sprintf("%+v", *c) }
func newTestMailbox() (*mailbox, *recordInvoker, *stepDispatcher, *countMiddleware) {
	mw := &countMiddleware{}
	m := newMailbox(nil, mw)().(*mailbox)
	inv, d := &recordInvoker{}, &stepDispatcher{}
	m.RegisterHandlers(inv, d)
	m.Start()
	return m, inv, d, mw
}

func TestMailboxSystemFirstSuspendResume(t *testing.T) {
	m, inv, d, mw := newTestMailbox()
	m.PostUserMessage("u1")
	m.PostUserMessage("u2")
	m.PostSystemMessage("s1")
	if len(d.fns) != 1 {
		t.Fatalf("scheduled %d times, want once while running is pending", len(d.fns))
	}
	d.runAll()
	if want := []string{"sys:s1", "u1", "u2"}; !reflect.DeepEqual(inv.got, want) {
		t.Fatalf("invoked %v, want %v", inv.got, want)
	}
	if mw.empty != 1 || mw.posted != 3 || mw.received != 3 {
		t.Fatalf("middleware calls %v", mw)
	}
	inv.got = nil
	m.PostSystemMessage(&pa.SuspendMailbox{})
	m.PostUserMessage("u3")
	d.runAll()
	if len(inv.got) != 0 || m.UserMessageCount() != 1 {
		t.Fatalf("suspended mailbox invoked %v, holds %d", inv.got, m.UserMessageCount())
	}
	m.PostSystemMessage(&pa.ResumeMailbox{})
	d.runAll()
	if want := []string{"u3"}; !reflect.DeepEqual(inv.got, want) || m.UserMessageCount() != 0 {
		t.Fatalf("after resume invoked %v, holds %d", inv.got, m.UserMessageCount())
	}
}

func TestMailboxPanicKeepsTheRest(t *testing.T) {
	m, inv, d, _ := newTestMailbox()
	for _, s := range []string{"u1", "boom", "u2", "u3"} {
		m.PostUserMessage(s)
	}
	d.runAll()
	if want := []string{"boom! on boom"}; !reflect.DeepEqual(inv.escalated, want) {
		t.Fatalf("escalated %v, want %v", inv.escalated, want)
	}
	// Messages after the failing one are still there for the next run.
	m.PostUserMessage("u4")
	d.runAll()
	if want := []string{"u1", "u2", "u3", "u4"}; !reflect.DeepEqual(inv.got, want) || m.UserMessageCount() != 0 {
		t.Fatalf("invoked %v, want %v; %d left", inv.got, want, m.UserMessageCount())
	}
}

// batchMsg is a protoactor MessageBatch.
type batchMsg []any

func (b batchMsg) GetMessages() []any { return b }

func TestMailboxBatchLikeProtoactor(t *testing.T) {
	m, inv, d, _ := newTestMailbox()
	m.PostUserMessage(batchMsg{"a", "b"})
	d.runAll()
	// protoactor's default mailbox posts a batch's messages, then the batch.
	if want := []string{"a", "b", "[a b]"}; !reflect.DeepEqual(inv.got, want) {
		t.Fatalf("invoked %v, want %v", inv.got, want)
	}
}

// orderInvoker checks that each producer's messages arrive in order.
type orderInvoker struct {
	next []int
	n    int
	err  error
}

type seqMsg struct{ from, seq int }

func (o *orderInvoker) InvokeSystemMessage(any) {}
func (o *orderInvoker) InvokeUserMessage(m any) {
	s := m.(seqMsg)
	if o.err == nil && s.seq != o.next[s.from] {
		o.err = fmt.Errorf("producer %d: message %d arrived as %d", s.from, o.next[s.from], s.seq)
	}
	o.next[s.from] = s.seq + 1
	o.n++
}
func (o *orderInvoker) EscalateFailure(reason, _ any) { o.err = fmt.Errorf("failure: %v", reason) }

// goDispatcher runs the mailbox on a goroutine, as the runtime's does.
type goDispatcher struct{ wg *sync.WaitGroup }

func (d goDispatcher) Schedule(fn func()) {
	d.wg.Add(1)
	go func() { defer d.wg.Done(); fn() }()
}
func (d goDispatcher) Throughput() int { return 300 }

// TestMailboxConcurrentProducers: producers posting concurrently with the
// consumer lose nothing and keep each producer's order (run with -race).
func TestMailboxConcurrentProducers(t *testing.T) {
	const producers, each = 4, 20000
	m := newMailbox(nil)().(*mailbox)
	inv := &orderInvoker{next: make([]int, producers)}
	var running sync.WaitGroup
	m.RegisterHandlers(inv, goDispatcher{&running})
	var wg sync.WaitGroup
	for p := 0; p < producers; p++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < each; i++ {
				m.PostUserMessage(seqMsg{p, i})
			}
		}()
	}
	wg.Wait()
	running.Wait() // every run the posts scheduled has ended
	if inv.err != nil {
		t.Fatal(inv.err)
	}
	if inv.n != producers*each || m.UserMessageCount() != 0 {
		t.Fatalf("invoked %d of %d; %d left", inv.n, producers*each, m.UserMessageCount())
	}
}
