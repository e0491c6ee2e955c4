package actor

import (
	"bytes"
	"errors"
	"testing"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"

	"github.com/troupe-hpc/troupe/datatype"
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

// A column of a 512x300 float64 grid (a vector of 512 blocks, rendezvous
// sized) is sent as a Typed field: unpacked into a column of another grid
// of a different width by the hook (same signature, different layout), kept
// packed without a type, refused with a reason when the signatures differ.
func TestTypedFields(t *testing.T) {
	rts := startLocal(t, 2)
	const rows = 512
	colOf := func(width int64) *datatype.Type {
		ty, err := datatype.Vector(rows, 1, width, datatype.Float64)
		if err != nil {
			t.Fatal(err)
		}
		return ty
	}
	src := make([]byte, rows*300*8)
	for i := range src {
		src[i] = byte(i*7 + 1)
	}
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
	// A hook whose type signature differs (float32 elements): the requester
	// hears why, and the message is not delivered.
	f32, err := datatype.Vector(rows, 1, 100, datatype.Float32)
	if err != nil {
		t.Fatal(err)
	}
	sink.dst = Typed{Buf: dstGrid, Type: f32, Count: 1}
	_, err = rts[0].Request(target, msg, 10*time.Second)
	var ue *UndeliverableError
	if !errors.As(err, &ue) || !bytes.Contains([]byte(ue.Reason), []byte("signature")) {
		t.Fatalf("signature mismatch: got %v, want an UndeliverableError about the signature", err)
	}
	if n := rts[1].Stats().TypedUnpacked.Load(); n != 1 {
		t.Fatalf("TypedUnpacked = %d, want 1", n)
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

// Bad Typed fields fail at the sender's Send, and a type may not carry two
// out-of-body fields.
func TestTypedFieldErrors(t *testing.T) {
	rts := startLocal(t, 2)
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
	if err := Register[twoSpecial](); err == nil {
		t.Fatal("a type with a Payload and a Typed field was registered")
	}
}
