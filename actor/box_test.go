package actor

import (
	"bytes"
	"testing"
	"time"
	"unsafe"

	pa "github.com/asynkron/protoactor-go/actor"
)

// boxedAt reports whether b's payload lies right after *b, in one
// allocation: the message was boxed.
func boxedAt(b *blob) bool {
	return len(b.Data) > 0 && uintptr(unsafe.Pointer(&b.Data[0])) == uintptr(unsafe.Pointer(b))+unsafe.Sizeof(*b)
}

// TestBoxedMessages: small payloads of every box size and around the
// limit, sent as pointers and as values, arrive intact and in order, with
// the credit header; those of at most maxBoxed bytes sent as pointers
// arrive boxed (the payload right after the value), and a boxed payload's
// capacity ends at its length, so appending to it cannot reach past it.
func TestBoxedMessages(t *testing.T) {
	rts := startLocal(t, 2)
	type got struct {
		b     blob
		ptr   bool
		boxed bool
		src   string
	}
	seen := make(chan got, 64)
	if _, err := rts[1].Root().SpawnNamed(rts[1].PropsFromFunc(func(c pa.Context) {
		switch m := c.Message().(type) {
		case *blob:
			seen <- got{b: *m, ptr: true, boxed: boxedAt(m), src: c.MessageHeader().Get(HeaderSourceRank)}
		case blob:
			seen <- got{b: m, src: c.MessageHeader().Get(HeaderSourceRank)}
		}
	}), "boxes"); err != nil {
		t.Fatal(err)
	}
	target := rts[0].PID(1, "boxes")
	sizes := []int{0, 1, 15, 16, 17, 33, 64, 65, 100, 128, 129, 4000}
	for _, size := range sizes {
		data := bytes.Repeat([]byte{byte(size)}, size)
		if err := rts[0].Send(target, &blob{Name: "p", Data: data}); err != nil {
			t.Fatal(err)
		}
		if err := rts[0].Send(target, blob{Name: "v", Data: data}); err != nil {
			t.Fatal(err)
		}
	}
	for _, size := range sizes {
		want := bytes.Repeat([]byte{byte(size)}, size)
		for _, ptr := range []bool{true, false} {
			var g got
			select {
			case g = <-seen:
			case <-time.After(10 * time.Second):
				t.Fatalf("size %d: no message", size)
			}
			if g.ptr != ptr || !bytes.Equal(g.b.Data, want) || (g.ptr && g.b.Name != "p") || (!g.ptr && g.b.Name != "v") {
				t.Fatalf("size %d, pointer %v: got %q with %d bytes (pointer %v)", size, ptr, g.b.Name, len(g.b.Data), g.ptr)
			}
			if g.src != "0" {
				t.Fatalf("size %d: source rank header %q", size, g.src)
			}
			if wantBoxed := ptr && size > 0 && size <= maxBoxed; g.boxed != wantBoxed {
				t.Fatalf("size %d, pointer %v: boxed %v, want %v", size, ptr, g.boxed, wantBoxed)
			}
			if size > 0 && size <= maxBoxed && cap(g.b.Data) != len(g.b.Data) {
				t.Fatalf("size %d: payload capacity %d", size, cap(g.b.Data))
			}
		}
	}
}

// TestBoxedSlowBody: a boxed message whose body the fast codec does not
// read (a field this rank's type lacks, as a newer sender may write) is
// decoded by msgpack, its payload still in the box.
func TestBoxedSlowBody(t *testing.T) {
	rts := startLocal(t, 1)
	ct, _, err := lookupType(blob{})
	if err != nil || ct.boxer == nil {
		t.Fatalf("blob: %v, boxer %v", err, ct.boxer != nil)
	}
	// {"Name": "s", "New": 1}
	body := []byte{0x82, 0xa4, 'N', 'a', 'm', 'e', 0xa1, 's', 0xa3, 'N', 'e', 'w', 0x01}
	var fast inItem
	if _, ok := ct.fast.decode(ct, body, true, nil, 0); ok {
		t.Fatal("the fast codec read an unknown field: the test no longer reaches msgpack")
	}
	fast.e = envelope{Flags: flagBodyHdr | flagPointer, Target: "nobody", Body: body, PayloadLen: 3}
	if !rts[0].decodeBoxed(&fast, ct, []byte{1, 2, 3}) {
		t.Fatal("not boxed")
	}
	b, ok := fast.msg.(*blob)
	if !ok || fast.err != "" || b.Name != "s" || !bytes.Equal(b.Data, []byte{1, 2, 3}) || fast.env == nil {
		t.Fatalf("decoded %#v, error %q", fast.msg, fast.err)
	}
}
