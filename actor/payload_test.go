package actor

import (
	"bytes"
	"errors"
	"reflect"
	"runtime"
	"strings"
	"testing"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"
)

type blob struct {
	Name string
	Data Payload
}

func init() { MustRegister[blob]() }

// landing is an actor whose PostReceive hook names where payloads land.
type landing struct {
	dst  Payload
	seen chan blob
}

func (l *landing) PostReceive(in *Incoming) Payload {
	if in.Type != typeName(reflectTypeOf[blob]()) || in.Size > len(l.dst) {
		return nil
	}
	return l.dst[:in.Size]
}

func (l *landing) Receive(c pa.Context) {
	if b, ok := c.Message().(*blob); ok {
		l.seen <- *b
	}
}

func TestPayloadLandsWhereTheHookSays(t *testing.T) {
	rts := startLocal(t, 2)
	l := &landing{dst: make(Payload, 1<<20), seen: make(chan blob, 4)}
	if _, err := rts[1].Root().SpawnNamed(rts[1].Props(func() pa.Actor { return l }), "landing"); err != nil {
		t.Fatal(err)
	}
	target := rts[0].PID(1, "landing")
	for _, size := range []int{100, 300 << 10} { // eager and rendezvous
		data := bytes.Repeat([]byte{byte(size)}, size)
		if err := rts[0].Send(target, &blob{Name: "x", Data: data}); err != nil {
			t.Fatal(err)
		}
		select {
		case b := <-l.seen:
			if b.Name != "x" || !bytes.Equal(b.Data, data) {
				t.Fatalf("size %d: payload corrupted", size)
			}
			if &b.Data[0] != &l.dst[0] {
				t.Fatalf("size %d: payload did not land in the hook's buffer", size)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("size %d: no message", size)
		}
	}
	if n := rts[1].Stats().HookLanded.Load(); n != 2 {
		t.Fatalf("HookLanded = %d, want 2", n)
	}
	// Without a hook the payload lands in pooled memory, intact.
	got := make(chan blob, 1)
	if _, err := rts[1].Root().SpawnNamed(rts[1].PropsFromFunc(func(c pa.Context) {
		if b, ok := c.Message().(*blob); ok {
			got <- *b
		}
	}), "plain"); err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte{7}, 200<<10)
	if err := rts[0].Send(rts[0].PID(1, "plain"), &blob{Name: "y", Data: data}); err != nil {
		t.Fatal(err)
	}
	select {
	case b := <-got:
		if !bytes.Equal(b.Data, data) {
			t.Fatal("pooled payload corrupted")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no message")
	}
}

func reflectTypeOf[T any]() reflect.Type { return reflect.TypeFor[T]() }

// gatedDispatcher runs an actor's mailbox only once gate is closed: until
// then the actor has not processed Started.
type gatedDispatcher struct{ gate chan struct{} }

func (d gatedDispatcher) Schedule(fn func()) {
	go func() {
		<-d.gate
		fn()
	}()
}

func (d gatedDispatcher) Throughput() int { return 300 }

// A payload sent to an actor at once after its spawn lands where its hook
// says, even before the actor has processed Started.
func TestPayloadHookBeforeStarted(t *testing.T) {
	rts := startLocal(t, 2)
	l := &landing{dst: make(Payload, 4096), seen: make(chan blob, 1)}
	gate := make(chan struct{})
	if _, err := rts[1].Root().SpawnNamed(rts[1].Props(func() pa.Actor { return l }, pa.WithDispatcher(gatedDispatcher{gate})), "gated"); err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte{9}, 1000)
	if err := rts[0].Send(rts[0].PID(1, "gated"), &blob{Name: "early", Data: data}); err != nil {
		t.Fatal(err)
	}
	// The mailbox has not run: the payload must land through the hook.
	deadline := time.Now().Add(10 * time.Second)
	for rts[1].Stats().HookLanded.Load() == 0 {
		if time.Now().After(deadline) {
			close(gate)
			t.Fatalf("no payload landed through the hook before Started was processed (received %d)", rts[1].Stats().Received.Load())
		}
		runtime.Gosched()
	}
	close(gate)
	b := <-l.seen
	if !bytes.Equal(b.Data, data) || &b.Data[0] != &l.dst[0] {
		t.Fatal("payload not delivered intact in the hook's buffer")
	}
}

// TestPayloadWithLargeFields: a message's fields beside a payload travel
// in the active message's header, which UCX bounds (about 8 KiB): more is
// refused with ErrFieldsTooLarge, sending nothing and keeping the
// sender's credits, where UCX aborted the process before. Fields that fit
// arrive with their payload (eager and rendezvous), and so does a later
// message.
func TestPayloadWithLargeFields(t *testing.T) {
	rts := startLocal(t, 2)
	got := make(chan blob, 4)
	if _, err := rts[1].Root().SpawnNamed(rts[1].PropsFromFunc(func(c pa.Context) {
		if b, ok := c.Message().(*blob); ok {
			got <- *b
		}
	}), "fields"); err != nil {
		t.Fatal(err)
	}
	target := rts[0].PID(1, "fields")
	max := rts[0].Transport().MaxAMHeader()
	arrives := func(name string, data Payload) {
		t.Helper()
		if err := rts[0].Send(target, &blob{Name: name, Data: data}); err != nil {
			t.Fatalf("fields of %d bytes beside %d of payload: %v", len(name), len(data), err)
		}
		select {
		case b := <-got:
			if b.Name != name || !bytes.Equal(b.Data, data) {
				t.Fatalf("fields of %d bytes beside %d of payload: corrupted", len(name), len(data))
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("fields of %d bytes beside %d of payload: no message", len(name), len(data))
		}
	}
	fits := strings.Repeat("f", max-256)
	arrives(fits, Payload{1, 2, 3})
	arrives(fits, bytes.Repeat([]byte{9}, 300<<10))
	sent := rts[0].Stats().Sent.Load()
	for _, n := range []int{max, 40 << 10} {
		err := rts[0].Send(target, &blob{Name: strings.Repeat("x", n), Data: Payload{1, 2, 3}})
		if !errors.Is(err, ErrFieldsTooLarge) {
			t.Fatalf("fields of %d bytes beside a payload: %v, want ErrFieldsTooLarge", n, err)
		}
	}
	if s := rts[0].Stats().Sent.Load(); s != sent {
		t.Fatalf("refused messages counted as sent: %d, then %d", sent, s)
	}
	arrives("after", Payload{4, 5})
	select {
	case b := <-got:
		t.Fatalf("a refused message arrived (fields of %d bytes)", len(b.Name))
	default:
	}
}
