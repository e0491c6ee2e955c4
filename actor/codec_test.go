package actor

import (
	"errors"
	"fmt"
	"reflect"
	"testing"

	pa "github.com/asynkron/protoactor-go/actor"
	"pgregory.net/rapid"
)

// propInner is nested in propMsg: its Payload is not at the top level, so
// it travels inline in the body like a []byte.
type propInner struct {
	A   int64
	S   string
	F   []float64
	Raw Payload
	Who *pa.PID
}

// propMsg has a field of every kind the codec must carry.
type propMsg struct {
	I    int
	I8   int8
	I32  int32
	U8   uint8
	U64  uint64
	F32  float32
	F64  float64
	B    bool
	S    string
	Bs   []byte
	Ss   []string
	M    map[string]int64
	MI   map[int32][]string
	In   propInner
	Ins  []propInner
	P    *propInner
	PID  *pa.PID
	PIDs []*pa.PID
	Arr  [3]uint16
	Data Payload // out of band: the active message's data
}

func init() {
	MustRegister[propMsg]()
}

func samplePropMsg() *propMsg {
	return &propMsg{
		I: -1, I8: -8, I32: 1 << 30, U8: 200, U64: 1<<64 - 1, F32: 1.5, F64: -2.25, B: true,
		S: "héllo", Bs: []byte{0, 1, 2}, Ss: []string{"a", ""},
		M: map[string]int64{"k": 1}, MI: map[int32][]string{-3: {"x"}},
		In:   propInner{A: 7, S: "in", F: []float64{0.5}, Raw: Payload{9}, Who: pa.NewPID("rank/2", "who")},
		Ins:  []propInner{{A: 1}, {S: "two"}},
		P:    &propInner{A: 3},
		PID:  &pa.PID{Address: "rank/1", Id: "future$4", RequestId: 77},
		PIDs: []*pa.PID{pa.NewPID("rank/0", "a"), nil},
		Arr:  [3]uint16{1, 2, 65535},
		Data: Payload("out of band"),
	}
}

// Generators. Empty slices and maps are generated as nil: msgpack writes
// both as an empty collection or nil alike and the decoder cannot tell
// which one was sent (see TestCodecEmptyCollections).
func nilIfEmpty[S ~[]E, E any](s S) S {
	if len(s) == 0 {
		return nil
	}
	return s
}

func nilIfEmptyMap[M ~map[K]V, K comparable, V any](m M) M {
	if len(m) == 0 {
		return nil
	}
	return m
}

var genPID = rapid.Custom(func(t *rapid.T) *pa.PID {
	if rapid.Bool().Draw(t, "nilPID") {
		return nil
	}
	return &pa.PID{
		Address:   rapid.String().Draw(t, "addr"),
		Id:        rapid.String().Draw(t, "id"),
		RequestId: rapid.Uint32().Draw(t, "req"),
	}
})

func genBytes() *rapid.Generator[[]byte] {
	return rapid.Map(rapid.SliceOfN(rapid.Byte(), 0, 64), func(b []byte) []byte { return nilIfEmpty(b) })
}

var genInner = rapid.Custom(func(t *rapid.T) propInner {
	return propInner{
		A:   rapid.Int64().Draw(t, "A"),
		S:   rapid.String().Draw(t, "S"),
		F:   nilIfEmpty(rapid.SliceOfN(rapid.Float64(), 0, 8).Draw(t, "F")),
		Raw: Payload(genBytes().Draw(t, "Raw")),
		Who: genPID.Draw(t, "Who"),
	}
})

var genPropMsg = rapid.Custom(func(t *rapid.T) *propMsg {
	m := &propMsg{
		I:    rapid.Int().Draw(t, "I"),
		I8:   rapid.Int8().Draw(t, "I8"),
		I32:  rapid.Int32().Draw(t, "I32"),
		U8:   rapid.Uint8().Draw(t, "U8"),
		U64:  rapid.Uint64().Draw(t, "U64"),
		F32:  rapid.Float32().Draw(t, "F32"),
		F64:  rapid.Float64().Draw(t, "F64"),
		B:    rapid.Bool().Draw(t, "B"),
		S:    rapid.String().Draw(t, "S"),
		Bs:   genBytes().Draw(t, "Bs"),
		Ss:   nilIfEmpty(rapid.SliceOfN(rapid.String(), 0, 5).Draw(t, "Ss")),
		M:    nilIfEmptyMap(rapid.MapOfN(rapid.String(), rapid.Int64(), 0, 5).Draw(t, "M")),
		MI:   nilIfEmptyMap(rapid.MapOfN(rapid.Int32(), rapid.Map(rapid.SliceOfN(rapid.String(), 0, 3), nilIfEmpty[[]string]), 0, 4).Draw(t, "MI")),
		In:   genInner.Draw(t, "In"),
		Ins:  nilIfEmpty(rapid.SliceOfN(genInner, 0, 3).Draw(t, "Ins")),
		PID:  genPID.Draw(t, "PID"),
		PIDs: nilIfEmpty(rapid.SliceOfN(genPID, 0, 4).Draw(t, "PIDs")),
		Arr:  [3]uint16{rapid.Uint16().Draw(t, "a0"), rapid.Uint16().Draw(t, "a1"), rapid.Uint16().Draw(t, "a2")},
		Data: Payload(genBytes().Draw(t, "Data")),
	}
	if rapid.Bool().Draw(t, "hasP") {
		p := genInner.Draw(t, "P")
		m.P = &p
	}
	return m
})

// roundTrip encodes msg and decodes it as the receiving rank would.
func roundTrip(t interface{ Fatalf(string, ...any) }, msg any) any {
	ct, ptr, err := lookupType(msg)
	if err != nil {
		t.Fatalf("%v", err)
	}
	body, payload, err := encodeBody(ct, msg)
	if err != nil {
		t.Fatalf("encodeBody(%#v): %v", msg, err)
	}
	got, err := decodeBody(ct, body, ptr, payload)
	if err != nil {
		t.Fatalf("decodeBody of %#v (body %x): %v", msg, body, err)
	}
	return got
}

// TestCodecRoundTrip: encodeBody then decodeBody gives back an equal value,
// for random messages with numbers, strings, slices, maps, nested structs,
// PIDs and a Payload, sent as *T and as T.
func TestCodecRoundTrip(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		m := genPropMsg.Draw(t, "msg")
		if got := roundTrip(t, m); !reflect.DeepEqual(got, m) {
			t.Fatalf("round trip of *propMsg changed it:\n got %#v\nwant %#v", got, m)
		}
		if got := roundTrip(t, *m); !reflect.DeepEqual(got, *m) {
			t.Fatalf("round trip of propMsg changed it:\n got %#v\nwant %#v", got, *m)
		}
		// Runtime messages with PIDs inside (a Terminated names the
		// actor that ended: one without is refused, TestCodecHostileBodies).
		who := genPID.Draw(t, "who")
		if who == nil {
			who = &pa.PID{}
		}
		term := &pa.Terminated{Who: who, Why: pa.TerminatedReason(rapid.IntRange(0, 3).Draw(t, "why"))}
		if got := roundTrip(t, term).(*pa.Terminated); !samePIDs(got.Who, term.Who) || got.Why != term.Why {
			t.Fatalf("Terminated %v came back as %v", term, got)
		}
	})
}

func samePIDs(a, b *pa.PID) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.Address == b.Address && a.Id == b.Id && a.RequestId == b.RequestId
}

// TestCodecEmptyCollections pins down what the generators rely on: nil
// collections come back nil, and the out-of-band payload keeps its
// nil-ness.
func TestCodecEmptyCollections(t *testing.T) {
	got := roundTrip(t, &propMsg{}).(*propMsg)
	if got.Bs != nil || got.Ss != nil || got.M != nil || got.Ins != nil || got.PIDs != nil || got.P != nil || got.PID != nil || got.Data != nil {
		t.Fatalf("nil fields came back non-nil: %#v", got)
	}
	got = roundTrip(t, &propMsg{Data: Payload{}}).(*propMsg)
	if got.Data == nil || len(got.Data) != 0 {
		t.Fatalf("an empty payload came back as %#v", got.Data)
	}
}

// TestRegisterCollision registers two real types whose names hash to the
// same 32-bit id: the second is an ErrTypeCollision, and the first stays
// registered. The types are unnamed structs made with reflect.StructOf,
// whose names are their spelling ("struct { F123 int }"), so a birthday
// search over field names finds a colliding pair quickly.
func TestRegisterCollision(t *testing.T) {
	spell := func(i int) string { return fmt.Sprintf("struct { F%d int }", i) }
	seen := map[uint32]int{}
	a, b := -1, -1
	for i := 0; i < 1<<20 && a < 0; i++ {
		id := TypeID(spell(i))
		if j, ok := seen[id]; ok {
			a, b = j, i
		}
		seen[id] = i
	}
	if a < 0 {
		t.Fatal("no FNV-1a collision among 2^20 names")
	}
	mk := func(i int) reflect.Type {
		return reflect.StructOf([]reflect.StructField{{Name: fmt.Sprintf("F%d", i), Type: reflect.TypeFor[int]()}})
	}
	ta, tb := mk(a), mk(b)
	if typeName(ta) != spell(a) || typeName(tb) != spell(b) || TypeID(typeName(ta)) != TypeID(typeName(tb)) {
		t.Fatalf("types %q and %q do not collide as predicted", typeName(ta), typeName(tb))
	}
	if err := registerType(ta, nil); err != nil {
		t.Fatalf("registering %s: %v", ta, err)
	}
	if err := registerType(ta, nil); err != nil {
		t.Fatalf("registering %s again: %v, want nil", ta, err)
	}
	err := registerType(tb, nil)
	if !errors.Is(err, ErrTypeCollision) {
		t.Fatalf("registering %s after %s (both 0x%08x): %v, want ErrTypeCollision", tb, ta, TypeID(typeName(ta)), err)
	}
	if ct := lookupID(TypeID(typeName(ta))); ct == nil || ct.typ != ta {
		t.Fatalf("after the collision the id names %v, want %s", ct, ta)
	}
	if _, _, err := lookupType(reflect.New(tb).Elem().Interface()); !errors.Is(err, ErrUnregistered) {
		t.Fatalf("the colliding type is usable: %v", err)
	}
	// Types that cannot cross ranks are refused.
	if err := registerType(reflect.TypeFor[func()](), nil); err == nil {
		t.Fatal("registering a func type succeeded")
	}
	if err := Register[struct {
		A, B Payload
	}](); err == nil {
		t.Fatal("registering a type with two Payload fields succeeded")
	}
}

// TestCodecHostileBodies: truncated bodies, flipped bytes, bad lengths and
// bodies of the wrong type give errors (wrapping a *DecodeError where the
// bytes are malformed), never a panic.
func TestCodecHostileBodies(t *testing.T) {
	propCT, _, _ := lookupType(&propMsg{})
	pingCT, _, _ := lookupType(&ping{})
	int64CT, _, _ := lookupType(int64(0))
	rapid.Check(t, func(t *rapid.T) {
		m := genPropMsg.Draw(t, "msg")
		body, _, err := encodeBody(propCT, m)
		if err != nil {
			t.Fatal(err)
		}
		// Truncated: always malformed.
		k := rapid.IntRange(0, len(body)-1).Draw(t, "cut")
		_, err = decodeBody(propCT, body[:k], true, nil)
		var de *DecodeError
		if !errors.As(err, &de) {
			t.Fatalf("body truncated to %d of %d bytes: %v, want a *DecodeError", k, len(body), err)
		}
		// Bytes overwritten (a length, a type byte, anything): no panic.
		mut := append([]byte(nil), body...)
		for n := rapid.IntRange(1, 4).Draw(t, "flips"); n > 0; n-- {
			mut[rapid.IntRange(0, len(mut)-1).Draw(t, "at")] = rapid.Byte().Draw(t, "b")
		}
		if _, err := decodeBody(propCT, mut, true, nil); err != nil && !errors.As(err, &de) {
			t.Fatalf("mutated body: %v (%T) wraps no *DecodeError", err, err)
		}
		// The wrong type: decoded as another message, no panic.
		_, _ = decodeBody(pingCT, body, false, nil)
		if _, err := decodeBody(int64CT, body, false, nil); err == nil {
			t.Fatal("a propMsg body decoded as an int64")
		}
	})
	for _, c := range []struct {
		name string
		body []byte
	}{
		{"empty", nil},
		{"array of 4 G elements", []byte{0xdd, 0xff, 0xff, 0xff, 0xff, 0x01}},
		{"map of 4 G pairs", []byte{0xdf, 0xff, 0xff, 0xff, 0xff}},
		{"2 GiB string", []byte{0xdb, 0x7f, 0xff, 0xff, 0xff, 'a'}},
		{"bin longer than the body", []byte{0xc5, 0x01, 0x00, 1, 2, 3}},
		{"ext longer than the body", []byte{0xc9, 0x00, 0x01, 0x00, 0x00, 0x05}},
		{"nested too deep", append(make([]byte, 0, 200), bytesOf(0x91, 100)...)},
		{"reserved type byte", []byte{0xc1}},
		{"trailing bytes", []byte{0x80, 0x00}},
		{"truncated float64", []byte{0xcb, 0x00, 0x00}},
	} {
		_, err := decodeBody(propCT, c.body, true, nil)
		var de *DecodeError
		if !errors.As(err, &de) {
			t.Errorf("%s: %v, want a *DecodeError", c.name, err)
		}
	}
	// A body that is just nil decodes to the zero value of every type
	// (msgpack once panicked on it: FuzzDecodeBody), except the runtime
	// messages that must name an actor (a *Watch, *Unwatch or *Terminated
	// without one would crash protoactor): those are a *DecodeError.
	for _, ct := range fuzzTypes {
		for _, ptr := range []bool{false, true} {
			_, err := decodeBody(ct, []byte{0xc0}, ptr, nil)
			zero := reflect.New(ct.typ).Interface()
			if ptr && checkRuntimeMessage(zero) != nil {
				var de *DecodeError
				if !errors.As(err, &de) {
					t.Errorf("nil body as *%s: %v, want a *DecodeError", ct.name, err)
				}
				continue
			}
			if err != nil {
				t.Errorf("nil body as %s (pointer %v): %v", ct.name, ptr, err)
			}
		}
	}
	// Well-formed msgpack of the wrong shape: an error, not a panic.
	for _, body := range [][]byte{
		{0xa3, 'a', 'b', 'c'},        // a string for a struct
		{0x81, 0xa1, 'I', 0xa1, 'x'}, // a string for an int field
		{0x81, 0xa2, 'S', 's', 0x93, 1, 2, 3},
	} {
		if _, err := decodeBody(propCT, body, true, nil); err == nil {
			t.Errorf("%x decoded as a propMsg", body)
		}
	}
}

func bytesOf(b byte, n int) []byte {
	out := make([]byte, n)
	for i := range out {
		out[i] = b
	}
	return out
}

// TestLookupTypeAlternating: lookupType's last-type shortcut gives the
// right type and pointer flag when value, pointer and other types take
// turns, and still rejects a nil pointer of the type it remembers.
func TestLookupTypeAlternating(t *testing.T) {
	cases := []struct {
		msg any
		typ reflect.Type
		ptr bool
	}{
		{&ping{N: 1}, reflect.TypeOf(ping{}), true},
		{&ping{N: 2}, reflect.TypeOf(ping{}), true},
		{ping{N: 3}, reflect.TypeOf(ping{}), false},
		{&pong{}, reflect.TypeOf(pong{}), true},
		{int64(7), reflect.TypeOf(int64(0)), false},
		{ping{}, reflect.TypeOf(ping{}), false},
	}
	for round := 0; round < 3; round++ {
		for i, c := range cases {
			ct, ptr, err := lookupType(c.msg)
			if err != nil || ct.typ != c.typ || ptr != c.ptr {
				t.Fatalf("round %d case %d (%T): got %v ptr=%v err=%v, want %v ptr=%v", round, i, c.msg, ct, ptr, err, c.typ, c.ptr)
			}
		}
	}
	if _, _, err := lookupType(&ping{}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := lookupType((*ping)(nil)); err == nil {
		t.Fatal("nil *ping right after *ping: no error")
	}
	if _, _, err := lookupType(&unregistered{}); !errors.Is(err, ErrUnregistered) {
		t.Fatalf("unregistered type after a registered one: %v", err)
	}
}
