package actor

import (
	"context"
	"encoding/binary"
	"errors"
	"testing"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"

	"github.com/troupe-hpc/troupe/transport"
)

// hostileReply has an interface field other than any: msgpack can only
// fill it with a value that implements the interface.
type hostileReply struct {
	N   int
	Err error
}

// hostileKeys keys a map by values of any type: msgpack panics on an
// unhashable key. Both are registered with the fuzzed types (fuzz_test.go).
type hostileKeys struct {
	M map[any]int
}

// Bodies that are valid msgpack but that msgpack's reflection cannot put
// into the type (it panicked on them) are a *DecodeError.
func TestDecodeBodyMsgpackPanics(t *testing.T) {
	for _, c := range []struct {
		name string
		msg  any
		body []byte
	}{
		{"an integer for an error field", hostileReply{}, []byte{0x82, 0xa1, 'N', 0x01, 0xa3, 'E', 'r', 'r', 0x05}},
		{"an array as a map key", hostileKeys{}, []byte{0x81, 0xa1, 'M', 0x81, 0x90, 0x01}},
	} {
		ct, _, err := lookupType(c.msg)
		if err != nil {
			t.Fatal(err)
		}
		if err := validateMsgpack(c.body); err != nil {
			t.Fatalf("%s: the body is not even valid msgpack: %v", c.name, err)
		}
		_, err = decodeBody(ct, c.body, false, nil)
		var de *DecodeError
		if !errors.As(err, &de) {
			t.Errorf("%s: %v, want a *DecodeError", c.name, err)
		}
	}
}

// nestedBroadcast is the body of an arrayBroadcast whose value is an
// arrayBroadcast, depth times over, around inner (the innermost body). It
// is built from the end of one buffer backwards, in linear time.
func nestedBroadcast(t testing.TB, depth int, inner []byte) []byte {
	ct, _, err := lookupType(&arrayBroadcast{})
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 20*depth+len(inner))
	start := len(buf) - len(inner)
	copy(buf[start:], inner)
	for range depth {
		h := []byte{0x81, 0xa5, 'V', 'a', 'l', 'u', 'e', 0x93, 0xce} // {"Value": [id, ptr, bin]}
		h = binary.BigEndian.AppendUint32(h, ct.id)
		h = append(h, 0xc3)
		h = appendBinLen(h, len(buf)-start)
		start -= len(h)
		copy(buf[start:], h)
	}
	return buf[start:]
}

// Values of type any nest up to maxAnyDepth levels; a message nested
// deeper is a *DecodeError, found without walking it all: 200,000 levels
// (3.4 MB) once cost minutes of quadratic decoding, and 2,000,000 a fatal
// stack overflow. Both decoders are checked: the fast one (the innermost
// body in its forms) and msgpack's (an unknown field the fast one gives
// up on).
func TestNestedAnyDepth(t *testing.T) {
	ct, _, err := lookupType(&arrayBroadcast{})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name  string
		inner []byte
	}{
		{"fast", []byte{0x81, 0xa5, 'V', 'a', 'l', 'u', 'e', 0xc0}},
		{"msgpack", []byte{0x81, 0xa1, 'X', 0xc0}},
	} {
		// The outer body is level 0; its value is at depth 1.
		m, err := decodeBody(ct, nestedBroadcast(t, maxAnyDepth, c.inner), true, nil)
		if err != nil {
			t.Fatalf("%s: %d levels: %v", c.name, maxAnyDepth, err)
		}
		levels := 0
		for v := any(m); v != nil; levels++ {
			v = v.(*arrayBroadcast).Value.V
		}
		if levels != maxAnyDepth+1 {
			t.Fatalf("%s: decoded %d levels, want %d", c.name, levels, maxAnyDepth+1)
		}
		for _, depth := range []int{maxAnyDepth + 1, 200_000} {
			_, err := decodeBody(ct, nestedBroadcast(t, depth, c.inner), true, nil)
			var de *DecodeError
			if !errors.As(err, &de) {
				t.Fatalf("%s: %d levels: %v, want a *DecodeError", c.name, depth, err)
			}
		}
	}
}

// A Watch without a watcher, sent as a system message or as a user
// message, to an actor that exists or to one that does not, crashed the
// receiving rank inside protoactor; now each is counted as a decode error
// and the rank goes on delivering.
func TestHostileWatch(t *testing.T) {
	rts := startLocal(t, 2)
	got := make(chan any, 4)
	if _, err := rts[1].Root().SpawnNamed(rts[1].Props(func() pa.Actor {
		return pa.ReceiveFunc(func(c pa.Context) {
			if p, ok := c.Message().(*ping); ok {
				got <- p
			}
		})
	}), "target"); err != nil {
		t.Fatal(err)
	}
	ct, _, err := lookupType(&pa.Watch{})
	if err != nil {
		t.Fatal(err)
	}
	errs := rts[1].Stats().DecodeErrors.Load()
	for _, target := range []string{"target", "no-such-actor"} {
		for _, flags := range []uint32{flagSystem, 0} {
			hdr := appendEnvelope(nil, &envelope{Flags: flags | flagNoCredit | flagPointer, Source: 0,
				Target: target, Type: ct.id})
			if err := rts[0].Transport().PostAM(1, amActor, hdr, []byte{0x80}); err != nil {
				t.Fatal(err)
			}
			errs++
			waitFor(t, func() bool { return rts[1].Stats().DecodeErrors.Load() == errs })
		}
	}
	rts[0].Root().Send(rts[0].PID(1, "target"), &ping{N: 7})
	select {
	case m := <-got:
		if p := m.(*ping); p.N != 7 {
			t.Fatalf("after the hostile messages the target got %+v", p)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the target got nothing after the hostile messages")
	}
}

// A rendezvous actor message that is undeliverable before its data is
// fetched (a type the receiver does not know, a payload of another length
// than its envelope announces) is dropped unfetched: the sender's send
// completes, the receiver counts it undeliverable, and the messages after
// it arrive in order. (Its data was fetched into a buffer of the size the
// peer announced, which a faulty peer could make any size.)
func TestUndeliverableRendezvousNotFetched(t *testing.T) {
	rts := startLocal(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	got := make(chan int, 8)
	if _, err := rts[1].Root().SpawnNamed(rts[1].Props(func() pa.Actor {
		return pa.ReceiveFunc(func(c pa.Context) {
			if p, ok := c.Message().(*ping); ok {
				got <- p.N
			}
		})
	}), "target"); err != nil {
		t.Fatal(err)
	}
	ct, _, err := lookupType(&ping{})
	if err != nil {
		t.Fatal(err)
	}
	data := make([]byte, 256<<10) // rendezvous
	dead := rts[1].Stats().DeadLetters.Load()
	for i, e := range []envelope{
		{Flags: flagNoCredit, Target: "target", Type: 0xdeadbeef},                                     // unknown type
		{Flags: flagNoCredit | flagBodyHdr, Target: "target", Type: ct.id, PayloadLen: len(data) + 1}, // wrong length
	} {
		r, err := rts[0].Transport().SendAM(1, amActor, appendEnvelope(nil, &e), data, transport.AMRndv)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := r.Wait(ctx); err != nil {
			t.Fatalf("message %d: the sender's rendezvous send did not complete: %v", i, err)
		}
		if err := rts[0].Send(rts[0].PID(1, "target"), &ping{N: i}); err != nil {
			t.Fatal(err)
		}
		select {
		case n := <-got:
			if n != i {
				t.Fatalf("after undeliverable message %d the target got ping %d", i, n)
			}
		case <-ctx.Done():
			t.Fatalf("after undeliverable message %d the target got nothing", i)
		}
		if n := rts[1].Stats().DeadLetters.Load() - dead; n != uint64(i+1) {
			t.Fatalf("after undeliverable message %d: %d dead letters, want %d", i, n, i+1)
		}
	}
}
