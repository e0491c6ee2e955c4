package actor

import (
	"bytes"
	"errors"
	"fmt"
	"testing"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"

	"github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/transport"
)

// face is a column of a row-major grid: a noncontiguous message field.
type face struct {
	Step int
	Col  Typed
}

func init() { MustRegister[face]() }

// faceSink unpacks faces where its hook says (dst), or keeps them packed
// when dst has no type.
type faceSink struct {
	dst  Typed
	seen chan face
}

func (s *faceSink) PostReceiveTyped(in *Incoming) Typed { return s.dst }

func (s *faceSink) Receive(c pa.Context) {
	if f, ok := c.Message().(*face); ok {
		if c.Sender() != nil {
			c.Respond(&pong{N: f.Step})
		}
		s.seen <- *f
	}
}

// typedPaths are the two ways a Typed field travels: packed into the active
// message, and by the transport's typed-transfer protocol.
var typedPaths = []struct {
	name   string
	min    int  // Options.TypedDirectMin
	direct bool // the field goes by the protocol
}{
	{"packed", -1, false},
	{"protocol", 1, true},
}

// A column of a 512x300 float64 grid (a vector of 512 blocks) is sent as a
// Typed field, along both paths: unpacked into a column of another grid of
// a different width by the hook (same signature, different layout), kept
// packed without a type, refused with a reason when the signatures differ
// (by the sender's Send too when the field goes by the protocol, which
// checks signatures before moving data).
func TestTypedFields(t *testing.T) {
	for _, path := range typedPaths {
		t.Run(path.name, func(t *testing.T) {
			testTypedFields(t, path.min, path.direct)
		})
	}
}

func testTypedFields(t *testing.T, min int, direct bool) {
	rts := startLocalWith(t, 2, Options{TypedDirectMin: min})
	const rows = 512
	colOf := func(width int64) *datatype.Type { return gridColumn(t, rows, width) }
	src := patterned(rows*300*8, 7, 1)
	// Column 5 of the 300-wide grid, in order.
	var want []byte
	for r := 0; r < rows; r++ {
		o := (r*300 + 5) * 8
		want = append(want, src[o:o+8]...)
	}
	dstGrid := make([]byte, rows*100*8)
	sink := &faceSink{dst: Typed{Buf: dstGrid, Type: colOf(100), Base: 7 * 8, Count: 1}, seen: make(chan face, 3)}
	if _, err := rts[1].Root().SpawnNamed(rts[1].Props(func() pa.Actor { return sink }), "faces"); err != nil {
		t.Fatal(err)
	}
	target := rts[0].PID(1, "faces")
	msg := &face{Step: 1, Col: Typed{Buf: src, Type: colOf(300), Base: 5 * 8, Count: 1}}
	if _, err := rts[0].Request(target, msg, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	f := <-sink.seen
	if f.Step != 1 || &f.Col.Buf[0] != &dstGrid[0] {
		t.Fatalf("hook landing: step %d, field not the hook's buffer", f.Step)
	}
	for r := 0; r < rows; r++ {
		o := (r*100 + 7) * 8
		if !bytes.Equal(dstGrid[o:o+8], want[r*8:r*8+8]) {
			t.Fatalf("row %d of the unpacked column differs", r)
		}
		if r == 0 && dstGrid[o-1] != 0 {
			t.Fatal("unpack wrote outside the column")
		}
	}
	// No hook type: the packed bytes.
	sink.dst = Typed{}
	if _, err := rts[0].Request(target, msg, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	f = <-sink.seen
	if f.Col.Type != datatype.Byte || !bytes.Equal(f.Col.Buf, want) {
		t.Fatalf("packed landing: type %v, %d bytes, equal %v", f.Col.Type, len(f.Col.Buf), bytes.Equal(f.Col.Buf, want))
	}
	// A hook whose type signature differs (as many bytes, but float32
	// elements): the requester hears why, and the message is not delivered.
	f32, err := datatype.Vector(rows, 2, 200, datatype.Float32)
	if err != nil {
		t.Fatal(err)
	}
	sink.dst = Typed{Buf: dstGrid, Type: f32, Count: 1}
	dead := rts[1].Stats().DeadLetters.Load()
	_, err = rts[0].Request(target, msg, 10*time.Second)
	if direct {
		if !errors.Is(err, transport.ErrTypeMismatch) {
			t.Fatalf("signature mismatch: got %v, want the sender's Send to fail with ErrTypeMismatch", err)
		}
	} else {
		var ue *UndeliverableError
		if !errors.As(err, &ue) || !bytes.Contains([]byte(ue.Reason), []byte("signature")) {
			t.Fatalf("signature mismatch: got %v, want an UndeliverableError about the signature", err)
		}
	}
	if n := rts[1].Stats().TypedUnpacked.Load(); n != 1 {
		t.Fatalf("TypedUnpacked = %d, want 1", n)
	}
	sent, recvd := rts[0].Stats().TypedSent.Load(), rts[1].Stats().TypedReceived.Load()
	if want := map[bool]uint64{false: 0, true: 2}[direct]; sent != want || recvd != want {
		t.Fatalf("TypedSent %d, TypedReceived %d, want %d by the protocol", sent, recvd, want)
	}
	// The message after a refused one still arrives (the transfers' sequence
	// stays in step).
	sink.dst = Typed{}
	if _, err := rts[0].Request(target, msg, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	f = <-sink.seen
	if !bytes.Equal(f.Col.Buf, want) {
		t.Fatal("the message after a refused one arrived damaged")
	}
	// Delivered in order, so the refused message was handled before it.
	if n := rts[1].Stats().DeadLetters.Load(); n != dead+1 {
		t.Fatalf("dead letters %d, want %d (the refused message)", n, dead+1)
	}
	select {
	case f := <-sink.seen:
		t.Fatalf("a message with a mismatched signature was delivered: step %d", f.Step)
	default:
	}
}

type twoSpecial struct {
	P Payload
	T Typed
}

// Bad Typed fields fail at the sender's Send, on both paths, and a type may
// not carry two out-of-body fields.
func TestTypedFieldErrors(t *testing.T) {
	for _, path := range typedPaths {
		t.Run(path.name, func(t *testing.T) {
			rts := startLocalWith(t, 2, Options{TypedDirectMin: path.min})
			target := rts[0].PID(1, "nobody")
			if err := rts[0].Send(target, &face{Col: Typed{Buf: make([]byte, 8), Count: 1}}); err == nil {
				t.Fatal("a Typed field with data and no type was sent")
			}
			col, err := datatype.Vector(512, 1, 300, datatype.Float64)
			if err != nil {
				t.Fatal(err)
			}
			if err := rts[0].Send(target, &face{Col: Typed{Buf: make([]byte, 100), Type: col, Count: 1}}); err == nil {
				t.Fatal("a Typed field whose buffer is too small for its type was sent")
			}
			if err := rts[0].Send(target, &face{Col: Typed{Buf: make([]byte, 512*300*8), Type: col, Base: -8, Count: 1}}); err == nil {
				t.Fatal("a Typed field with a negative base was sent")
			}
			if n := rts[0].Stats().Sent.Load(); n != 0 {
				t.Fatalf("%d messages went out for refused sends", n)
			}
		})
	}
	if err := Register[twoSpecial](); err == nil {
		t.Fatal("a type with a Payload and a Typed field was registered")
	}
}

// stripe is a message with a Typed field, numbered per sender.
type stripe struct {
	From, Step int
	Data       Typed
}

func init() { MustRegister[stripe]() }

// stripeOf fills ty, a 64 x 2 KiB block vector of stride 4 KiB (128 KiB
// packed, large blocks), with a pattern of (from, step) and returns it with
// its packed form.
func stripeOf(ty *datatype.Type, from, step int) (Typed, []byte) {
	buf := make([]byte, 64*4096)
	var packed []byte
	for i := range buf {
		buf[i] = byte(i*31 + from*7 + step*13)
		if i%4096 < 2048 {
			packed = append(packed, buf[i])
		}
	}
	return Typed{Buf: buf, Type: ty, Count: 1}, packed
}

// Typed fields by the protocol under every scheme: two goroutines of one
// rank each send 12 stripes to one actor, interleaved with small messages;
// each sender's messages arrive in order with their bytes intact, and the
// receiving transport counts every transfer under the scheme forced on both
// sides (the adaptive default may use any).
func TestTypedFieldSchemes(t *testing.T) {
	schemes := []datatype.Scheme{datatype.SchemePack, datatype.SchemeSGL, datatype.SchemeZCopy, datatype.SchemeAuto}
	for _, scheme := range schemes {
		t.Run(scheme.String(), func(t *testing.T) {
			rts := startLocalWith(t, 2, Options{TypedDirectMin: 1})
			for _, rt := range rts {
				if err := rt.Transport().SetNoncontigOptions(transport.NoncontigOptions{Scheme: scheme}); err != nil {
					t.Fatal(err)
				}
			}
			n := sendStripes(t, rts)
			rs := rts[1].Transport().NoncontigStats().Received
			total := rs.Pack + rs.SGL + rs.ZCopy
			var forced int64
			switch scheme {
			case datatype.SchemePack:
				forced = rs.Pack
			case datatype.SchemeSGL:
				forced = rs.SGL
			case datatype.SchemeZCopy:
				forced = rs.ZCopy
			default:
				forced = total
			}
			if total != int64(n) || forced != total {
				t.Fatalf("receiver's schemes %+v, want all %d as %v", rs, n, scheme)
			}
			if got := rts[1].Stats().TypedReceived.Load(); got != uint64(n) {
				t.Fatalf("TypedReceived %d, want %d", got, n)
			}
		})
	}
}

// The same stripes packed into their active messages: each sender's packed
// copy is still being read while the next stripes are packed, so a staging
// buffer handed back to the pool too early would show as damaged bytes.
func TestTypedFieldsPackedInFlight(t *testing.T) {
	rts := startLocalWith(t, 2, Options{TypedDirectMin: -1})
	sendStripes(t, rts)
	if got := rts[0].Stats().TypedSent.Load(); got != 0 {
		t.Fatalf("%d fields went by the protocol, want none", got)
	}
}

// sendStripes has two goroutines of rts[0] each send 12 stripes (128 KiB
// packed) to an actor of rts[1], interleaved with small messages, and checks
// that each sender's stripes arrive in order and intact. It returns how many
// stripes were sent.
func sendStripes(t *testing.T, rts []*Runtime) int {
	t.Helper()
	ty, err := datatype.Vector(64, 2048, 4096, datatype.Byte)
	if err != nil {
		t.Fatal(err)
	}
	const senders, steps = 2, 12
	got := make(chan stripe, senders*steps)
	pings := make(chan int, senders*steps)
	props := rts[1].PropsFromFunc(func(c pa.Context) {
		switch m := c.Message().(type) {
		case *stripe:
			got <- *m
		case *ping:
			pings <- m.N
		}
	})
	if _, err := rts[1].Root().SpawnNamed(props, "stripes"); err != nil {
		t.Fatal(err)
	}
	target := rts[0].PID(1, "stripes")
	errs := make(chan error, senders)
	for from := range senders {
		go func() {
			for step := range steps {
				f, _ := stripeOf(ty, from, step)
				if err := rts[0].Send(target, &stripe{From: from, Step: step, Data: f}); err != nil {
					errs <- err
					return
				}
				if err := rts[0].Send(target, &ping{N: from*steps + step}); err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}()
	}
	for range senders {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	next := make([]int, senders)
	for range senders * steps {
		m := <-got
		if m.Step != next[m.From] {
			t.Fatalf("sender %d: step %d arrived, want %d", m.From, m.Step, next[m.From])
		}
		next[m.From]++
		_, want := stripeOf(ty, m.From, m.Step)
		if m.Data.Type != datatype.Byte || !bytes.Equal(m.Data.Buf, want) {
			t.Fatalf("sender %d step %d: field damaged (%d bytes)", m.From, m.Step, len(m.Data.Buf))
		}
	}
	for range senders * steps {
		<-pings
	}
	return senders * steps
}

// With Options.TypedDirectMin left at 0, the size from which a Typed field
// goes by the protocol depends on the peer: DefaultTypedDirectMinCMA toward
// a rank in another process that large messages reach by cross-memory
// attach (integration's actor-typed/default checks it between processes),
// DefaultTypedDirectMin toward others, ranks of this process included
// (StartLocal), with same-host zero copy on or off.
func TestTypedDirectDefault(t *testing.T) {
	for _, cma := range []bool{true, false} {
		t.Run(fmt.Sprintf("cma=%v", cma), func(t *testing.T) {
			if !cma {
				t.Setenv("TROUPE_CMA", "off")
			}
			rts := startLocalWith(t, 2, Options{})
			tr := rts[0].Transport()
			if !tr.SameProcess(1) || (!cma && tr.CMAPeer(1)) {
				t.Fatalf("SameProcess(1) = %v, CMAPeer(1) = %v", tr.SameProcess(1), tr.CMAPeer(1))
			}
			sink := &faceSink{seen: make(chan face, 1)}
			if _, err := rts[1].Root().SpawnNamed(rts[1].Props(func() pa.Actor { return sink }), "faces"); err != nil {
				t.Fatal(err)
			}
			checkTypedThreshold(t, rts[0], rts[0].PID(1, "faces"), sink.seen, DefaultTypedDirectMin)
		})
	}
}

// checkTypedThreshold sends Typed fields of threshold-512 and threshold
// packed bytes to target, whose actor passes what it receives to seen, and
// checks that only the second went by the protocol.
func checkTypedThreshold(t *testing.T, rt *Runtime, target *pa.PID, seen <-chan face, threshold int) {
	t.Helper()
	for _, packed := range []int{threshold - 512, threshold} {
		ty, err := datatype.Vector(int64(packed/512), 512, 1024, datatype.Byte)
		if err != nil {
			t.Fatal(err)
		}
		src := make([]byte, 2*packed)
		for i := range src {
			src[i] = byte(i * 5)
		}
		before := rt.Stats().TypedSent.Load()
		msg := &face{Step: packed, Col: Typed{Buf: src, Type: ty, Count: 1}}
		if _, err := rt.Request(target, msg, 10*time.Second); err != nil {
			t.Fatal(err)
		}
		f := <-seen
		if f.Step != packed || len(f.Col.Buf) != packed || f.Col.Buf[511] != src[511] || f.Col.Buf[512] != src[1024] {
			t.Fatalf("%d packed bytes: step %d, %d bytes landed", packed, f.Step, len(f.Col.Buf))
		}
		want := uint64(0)
		if packed >= threshold {
			want = 1
		}
		if got := rt.Stats().TypedSent.Load() - before; got != want {
			t.Fatalf("a field of %d packed bytes (threshold %d): %d went by the protocol, want %d", packed, threshold, got, want)
		}
	}
}

// gridColumn is a column of a grid of rows x width float64s.
func gridColumn(t testing.TB, rows, width int64) *datatype.Type {
	t.Helper()
	ty, err := datatype.Vector(rows, 1, width, datatype.Float64)
	if err != nil {
		t.Fatal(err)
	}
	return ty
}

// patterned returns n bytes, byte i holding i*mul + add.
func patterned(n, mul, add int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*mul + add)
	}
	return b
}

// A hook whose Typed holds more elements than came (the sender's
// signature is a prefix of the hook's) is a signature mismatch on both
// paths: the message is not delivered, the requester hears of it, and the
// next message arrives intact. By the protocol it was delivered with the
// hook's longer field, only its first half filled, and nobody told.
func TestTypedFieldLongerHook(t *testing.T) {
	for _, path := range typedPaths {
		t.Run(path.name, func(t *testing.T) {
			rts := startLocalWith(t, 2, Options{TypedDirectMin: path.min})
			const rows = 512
			sink := &faceSink{
				dst:  Typed{Buf: make([]byte, 2*rows*8), Type: datatype.Float64, Count: 2 * rows},
				seen: make(chan face, 2),
			}
			if _, err := rts[1].Root().SpawnNamed(rts[1].Props(func() pa.Actor { return sink }), "faces"); err != nil {
				t.Fatal(err)
			}
			target := rts[0].PID(1, "faces")
			src := patterned(rows*300*8, 7, 1)
			msg := &face{Step: 1, Col: Typed{Buf: src, Type: gridColumn(t, rows, 300), Base: 5 * 8, Count: 1}}
			if _, err := rts[0].Request(target, msg, 10*time.Second); err == nil {
				f := <-sink.seen
				t.Fatalf("a field of %d elements was delivered into a hook's of %d (Count %d)", rows, 2*rows, f.Col.Count)
			}
			// The next message, kept packed, arrives intact.
			sink.dst = Typed{}
			msg.Step = 2
			if _, err := rts[0].Request(target, msg, 10*time.Second); err != nil {
				t.Fatal(err)
			}
			if f := <-sink.seen; f.Step != 2 || len(f.Col.Buf) != rows*8 {
				t.Fatalf("the next message: step %d, %d bytes", f.Step, len(f.Col.Buf))
			}
		})
	}
}

// An actor that runs inline on the progress goroutine (synchronized
// dispatcher) and sends a Typed field that goes by the protocol cannot
// wait for the transfer there: its Send fails, and the typed transfers to
// that rank stay in step, so the next one arrives. Before, the message and
// its transfer's number went out, the transfer never ran, and every later
// message from that rank waited behind it for good.
func TestTypedFieldSentInline(t *testing.T) {
	rts := startLocalWith(t, 2, Options{TypedDirectMin: 1})
	const rows = 512
	sink := &faceSink{seen: make(chan face, 2)}
	if _, err := rts[1].Root().SpawnNamed(rts[1].Props(func() pa.Actor { return sink }), "faces"); err != nil {
		t.Fatal(err)
	}
	target := rts[0].PID(1, "faces")
	src := patterned(rows*300*8, 7, 1)
	msg := &face{Step: 1, Col: Typed{Buf: src, Type: gridColumn(t, rows, 300), Base: 5 * 8, Count: 1}}
	sendErr := make(chan error, 1)
	props := rts[0].PropsFromFunc(func(c pa.Context) {
		if _, ok := c.Message().(*ping); ok {
			sendErr <- rts[0].Send(target, msg)
		}
	}, pa.WithDispatcher(pa.NewSynchronizedDispatcher(300)))
	if _, err := rts[0].Root().SpawnNamed(props, "inline"); err != nil {
		t.Fatal(err)
	}
	// From rank 1, so that rank 0's progress goroutine delivers it.
	if err := rts[1].Send(rts[1].PID(0, "inline"), &ping{N: 1}); err != nil {
		t.Fatal(err)
	}
	if err := <-sendErr; err == nil {
		<-sink.seen // went after all
	}
	msg.Step = 2
	if _, err := rts[0].Request(target, msg, 10*time.Second); err != nil {
		t.Fatalf("the next Typed field: %v", err)
	}
	if f := <-sink.seen; f.Step != 2 || len(f.Col.Buf) != rows*8 {
		t.Fatalf("the next message: step %d, %d bytes", f.Step, len(f.Col.Buf))
	}
}
