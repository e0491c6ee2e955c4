package actor

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"reflect"
	"testing"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"
	"pgregory.net/rapid"

	"github.com/troupe-hpc/troupe/gpu"
)

// fastAll has a field of every shape the fast codec carries, a renamed
// one, a skipped one, an unexported one and the Payload.
type fastAll struct {
	B       bool
	I       int
	I8      int8
	I16     int16
	I32     int32
	I64     int64
	U       uint
	U8      uint8
	U16     uint16
	U32     uint32
	U64     uint64
	F32     float32
	F64     float64
	S       string `msgpack:"str"`
	Bs      []byte
	Fs      []float64
	Is      []int32
	Skipped int `msgpack:"-"`
	hidden  int
	Data    Payload
}

// Types the fast codec must leave to msgpack.
type (
	fastOmit struct {
		A int `msgpack:"a,omitempty"`
	}
	fastNamed   struct{ C celsius }
	celsius     float64
	fastNested  struct{ In fastSmall }
	fastSmall   struct{ A, B int }
	fastEmbed   struct{ fastSmall }
	fastPtr     struct{ P *int }
	fastMap     struct{ M map[string]int }
	fastStrings struct{ S []string }
	fastTime    struct{ T time.Time }
	fastHidden  struct{ p *int }
	fastCustom  struct{ A int }
	fastMany    struct {
		A0, A1, A2, A3, A4, A5, A6, A7, A8, A9, A10, A11, A12, A13, A14, A15 int
	}
	fastTooMany struct {
		A0, A1, A2, A3, A4, A5, A6, A7, A8, A9, A10, A11, A12, A13, A14, A15, A16, A17, A18, A19 int
		B0, B1, B2, B3, A4b, A5b, A6b, A7b, A8b, A9b, A10b, A11b, A12b, A13b, A14b, A15b         int
		C0, C1, C2, C3, C4, C5, C6, C7, C8, C9, C10, C11, C12, C13, C14, C15, C16, C17, C18      int
		D0, D1, D2, D3, D4, D5, D6, D7, D8, D9                                                   int
	}
	fastArray struct{ A [2]int }
	// fastRefs has the runtime's reference shapes: a PID and a nested value.
	fastRefs struct {
		N   int
		To  *pa.PID
		Val anyValue
	}
	fastOnePID struct{ P *pa.PID } // stored in an interface as the pointer
)

func (fastCustom) MarshalText() ([]byte, error) { return []byte("x"), nil }

func init() {
	MustRegister[fastAll]()
	MustRegister[fastSmall]()
	MustRegister[fastRefs]()
	for _, r := range []func() error{
		Register[fastOmit], Register[fastNamed], Register[fastNested], Register[fastEmbed],
		Register[fastPtr], Register[fastMap], Register[fastStrings], Register[fastTime],
		Register[fastHidden], Register[fastCustom], Register[fastMany], Register[fastTooMany], Register[fastArray], Register[fastOnePID],
		Register[[]int], Register[celsius], Register[int8], Register[uint], Register[float32],
	} {
		if err := r(); err != nil {
			panic(err)
		}
	}
}

func codecOf(t testing.TB, v any) *codecType {
	t.Helper()
	ct, _, err := lookupType(v)
	if err != nil {
		t.Fatal(err)
	}
	return ct
}

// TestFastCodecPlans: which registered types get the fast path.
func TestFastCodecPlans(t *testing.T) {
	for _, v := range []any{fastAll{}, fastSmall{}, fastMany{}, fastRefs{}, reducePartial{}, Reduced{}, arrayBroadcast{}, UndeliverableError{}, ping{}, pong{}, 0, int64(0), uint64(0), int8(0), uint(0), float32(0), 1.5, true, "", []byte{}, []int64{}, []float64{}, []int{}} {
		if codecOf(t, v).fast == nil {
			t.Errorf("%T has no fast plan", v)
		}
	}
	for _, v := range []any{fastOmit{}, fastNamed{}, celsius(0), fastNested{}, fastEmbed{}, fastPtr{}, fastMap{}, fastStrings{}, fastTime{}, fastHidden{}, fastCustom{}, fastArray{}, fastTooMany{}, fastOnePID{}, propMsg{}, benchDevMsg{}} {
		if codecOf(t, v).fast != nil {
			t.Errorf("%T has a fast plan; msgpack must encode it", v)
		}
	}
}

// benchDevMsg has a device buffer: never on the fast path.
type benchDevMsg struct {
	N   int
	Buf gpu.Buffer
}

func init() { MustRegister[benchDevMsg]() }

var genFastAll = rapid.Custom(func(t *rapid.T) *fastAll {
	return &fastAll{
		B: rapid.Bool().Draw(t, "b"), I: rapid.Int().Draw(t, "i"), I8: rapid.Int8().Draw(t, "i8"),
		I16: rapid.Int16().Draw(t, "i16"), I32: rapid.Int32().Draw(t, "i32"), I64: rapid.Int64().Draw(t, "i64"),
		U: rapid.Uint().Draw(t, "u"), U8: rapid.Uint8().Draw(t, "u8"), U16: rapid.Uint16().Draw(t, "u16"),
		U32: rapid.Uint32().Draw(t, "u32"), U64: rapid.Uint64().Draw(t, "u64"),
		F32: rapid.Float32().Draw(t, "f32"), F64: rapid.Float64().Draw(t, "f64"),
		S:    rapid.StringN(0, 300, -1).Draw(t, "s"),
		Bs:   nilIfEmpty(rapid.SliceOfN(rapid.Byte(), 0, 300).Draw(t, "bs")),
		Fs:   nilIfEmpty(rapid.SliceOfN(rapid.Float64(), 0, 20).Draw(t, "fs")),
		Is:   nilIfEmpty(rapid.SliceOfN(rapid.Int32(), 0, 20).Draw(t, "is")),
		Data: nilIfEmpty(rapid.SliceOfN(rapid.Byte(), 0, 10).Draw(t, "data")),
	}
})

// sameValue is reflect.DeepEqual that takes NaNs with the same bits as
// equal.
func sameValue(a, b any) bool {
	return reflect.DeepEqual(a, b) || bytes.Equal(fastBytes(a), fastBytes(b))
}

func fastBytes(v any) []byte {
	ct, ptr, err := lookupType(v)
	if err != nil || ct.fast == nil {
		return nil
	}
	b, _, ok := ct.fast.appendBody(nil, v, ptr)
	if !ok {
		return nil
	}
	return b
}

// TestFastCodecSameBytes: the fast encoder writes exactly msgpack's bytes,
// the fast decoder reads them back to what msgpack's decoder makes of
// them, as *T and as T, for structs and top-level values.
func TestFastCodecSameBytes(t *testing.T) {
	check := func(t *rapid.T, v any) {
		ct, ptr, err := lookupType(v)
		if err != nil {
			t.Fatal(err)
		}
		if ct.fast == nil {
			t.Fatalf("%T: no fast plan", v)
		}
		slow, slowPay, err := encodeBodySlow(ct, v)
		if err != nil {
			t.Fatal(err)
		}
		fast, fastPay, err := appendBody([]byte{0xff}, ct, v, ptr) // after a byte already there
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(fast[1:], slow) {
			t.Fatalf("%T %+v:\nfast    %x\nmsgpack %x", v, v, fast[1:], slow)
		}
		if !bytes.Equal(fastPay, slowPay) || (fastPay == nil) != (slowPay == nil) {
			t.Fatalf("payload %x, msgpack's %x", fastPay, slowPay)
		}
		want, err := decodeBodySlow(ct, slow, ptr, slowPay, gpu.Buffer{}, 0)
		if err != nil {
			t.Fatal(err)
		}
		got, ok := ct.fast.decode(ct, slow, ptr, slowPay, 0)
		if !ok {
			t.Fatalf("fast decoder refused its own %x", slow)
		}
		if !sameValue(got, want) {
			t.Fatalf("fast decode %#v, msgpack %#v", got, want)
		}
		if !sameValue(got, v) {
			t.Fatalf("round trip of %#v gave %#v", v, got)
		}
	}
	rapid.Check(t, func(t *rapid.T) {
		m := genFastAll.Draw(t, "msg")
		check(t, m)
		check(t, *m)
		check(t, &fastSmall{A: rapid.Int().Draw(t, "a"), B: rapid.Int().Draw(t, "b")})
		check(t, fastMany{A3: rapid.Int().Draw(t, "a3"), A15: rapid.Int().Draw(t, "a15")})
		check(t, &ping{N: rapid.Int().Draw(t, "n"), Text: rapid.String().Draw(t, "text")})
		check(t, &fastRefs{N: rapid.Int().Draw(t, "n"), To: genPID.Draw(t, "to"), Val: anyValue{V: genNested.Draw(t, "val")}})
		check(t, reducePartial{Round: rapid.Uint64().Draw(t, "round"), Op: Max, Target: genPID.Draw(t, "target"),
			Value: anyValue{V: genNested.Draw(t, "value")}, FromRank: rapid.IntRange(0, 1000).Draw(t, "from")})
		check(t, &Reduced{Array: "a", Round: 3, Op: Sum, Value: anyValue{V: genNested.Draw(t, "sum")}})
		check(t, rapid.Int().Draw(t, "int"))
		check(t, rapid.Int64().Draw(t, "int64"))
		check(t, rapid.Int8().Draw(t, "int8"))
		check(t, rapid.Uint().Draw(t, "uint"))
		check(t, rapid.Uint64().Draw(t, "uint64"))
		check(t, rapid.Float64().Draw(t, "float64"))
		check(t, rapid.Float32().Draw(t, "float32"))
		check(t, rapid.Bool().Draw(t, "bool"))
		check(t, rapid.String().Draw(t, "string"))
		check(t, rapid.SliceOfN(rapid.Byte(), 0, 70000).Draw(t, "bytes"))
		check(t, nilIfEmpty(rapid.SliceOfN(rapid.Int64(), 0, 40).Draw(t, "int64s")))
		check(t, nilIfEmpty(rapid.SliceOfN(rapid.Float64(), 0, 40).Draw(t, "float64s")))
		check(t, nilIfEmpty(rapid.SliceOfN(rapid.Int(), 0, 40).Draw(t, "ints")))
	})
	// Edges of the compact integer forms, and empty (not nil) slices.
	for _, n := range []int{0, 127, 128, 255, 256, 65535, 65536, math.MaxUint32, math.MaxUint32 + 1, math.MaxInt64, -1, -32, -33, -128, -129, -32768, -32769, math.MinInt32, math.MinInt32 - 1, math.MinInt64} {
		rapid.Check(t, func(t *rapid.T) { check(t, &fastAll{I: n, Bs: []byte{}, Fs: []float64{}}) })
	}
	// Nested bodies on both sides of each bin header size.
	for _, n := range []int{0, 251, 252, 253, 254, 65531, 65532, 65533, 65534, 70000} {
		rapid.Check(t, func(t *rapid.T) { check(t, &fastRefs{Val: anyValue{V: make([]byte, n)}}) })
	}
}

var (
	// genNested draws values of registered fast types, bodies of every bin
	// header size among them.
	genNested = rapid.OneOf(
		rapid.Just[any](nil),
		rapid.Int().AsAny(),
		rapid.Uint64().AsAny(),
		rapid.String().AsAny(),
		rapid.Custom(func(t *rapid.T) any { return nilIfEmpty(rapid.SliceOfN(rapid.Float64(), 0, 40).Draw(t, "fs")) }),
		rapid.Custom(func(t *rapid.T) any { return rapid.SliceOfN(rapid.Byte(), 0, 70000).Draw(t, "bs") }),
		rapid.Custom(func(t *rapid.T) any { return &fastSmall{A: rapid.Int().Draw(t, "a"), B: rapid.Int().Draw(t, "b")} }),
		rapid.Custom(func(t *rapid.T) any { return fastSmall{A: rapid.Int().Draw(t, "a")} }),
	)
)

// TestFastCodecNestedDefers: a nested value the fast path cannot write (a
// slow-coded type, an unregistered one, one with a Payload) or read (a type
// id this rank does not know) goes to msgpack, with msgpack's bytes, value
// or error.
func TestFastCodecNestedDefers(t *testing.T) {
	ct := codecOf(t, fastRefs{})
	type unregistered struct{ A int }
	for _, v := range []any{fastMap{M: map[string]int{"a": 1}}, &fastNested{In: fastSmall{A: 2}}, unregistered{}, &fastAll{I: 1}} {
		m := &fastRefs{N: 1, Val: anyValue{V: v}}
		got, _, gerr := encodeBody(ct, m)
		want, _, werr := encodeBodySlow(ct, m)
		if (gerr == nil) != (werr == nil) || (gerr != nil && gerr.Error() != werr.Error()) || !bytes.Equal(got, want) {
			t.Fatalf("%T nested: %x %v, msgpack alone %x %v", v, got, gerr, want, werr)
		}
		if gerr != nil {
			continue
		}
		if _, ok := ct.fast.decode(ct, got, true, nil, 0); ok {
			t.Fatalf("%T nested: the fast decoder took a slow-coded nested body", v)
		}
		back, err := decodeBody(ct, got, true, nil)
		if err != nil || !reflect.DeepEqual(back, m) {
			t.Fatalf("%T nested: decoded %#v %v, want %#v", v, back, err, m)
		}
	}
	// A nested type id nobody registered: msgpack's error.
	body := fastBytes(&fastRefs{Val: anyValue{V: 5}})
	id := binary.BigEndian.AppendUint32(nil, codecOf(t, 5).id)
	i := bytes.Index(body, id)
	if i < 0 {
		t.Fatalf("no type id in %x", body)
	}
	copy(body[i:], []byte{0xde, 0xad, 0xbe, 0xef})
	_, gerr := decodeBody(ct, body, true, nil)
	_, werr := decodeBodySlow(ct, body, true, nil, gpu.Buffer{}, 0)
	if gerr == nil || werr == nil || gerr.Error() != werr.Error() {
		t.Fatalf("unknown nested type: %v, msgpack alone %v", gerr, werr)
	}
}

// TestFastDecodeDefers: bodies the fast decoder did not write (other
// integer widths, a map with an unknown or repeated key, a field in another
// form, trailing bytes, truncation) go to msgpack, so what comes out, value
// or error, is what msgpack alone gives.
func TestFastDecodeDefers(t *testing.T) {
	ct := codecOf(t, fastSmall{})
	for _, b := range [][]byte{
		{0x82, 0xa1, 'A', 0xd3, 0, 0, 0, 0, 0, 0, 0, 5, 0xa1, 'B', 0x01},        // int64 form: fast
		{0x82, 0xa1, 'B', 0x02, 0xa1, 'A', 0x01},                                // other order: fast
		{0x81, 0xa1, 'A', 0xcb, 0x40, 0x14, 0, 0, 0, 0, 0, 0},                   // a float for an int
		{0x82, 0xa1, 'A', 0x01, 0xa1, 'A', 0x02},                                // repeated key
		{0x82, 0xa1, 'A', 0x01, 0xa1, 'C', 0x02},                                // unknown key
		{0x82, 0xa1, 'A', 0x01, 0xa1, 'B', 0xc0},                                // nil for an int
		{0x92, 0x01, 0x02},                                                      // as an array
		{0x82, 0xa1, 'A', 0x01, 0xa1, 'B', 0x02, 0x00},                          // trailing byte
		{0x82, 0xa1, 'A', 0x01, 0xa1, 'B'},                                      // truncated
		{0x82, 0xa1, 'A', 0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, // uint64 over MaxInt64
		{0xc0},
		{},
	} {
		for _, ptr := range []bool{true, false} {
			got, gerr := decodeBody(ct, b, ptr, nil)
			want, werr := decodeBodySlow(ct, b, ptr, nil, gpu.Buffer{}, 0)
			if (gerr == nil) != (werr == nil) || (gerr != nil && gerr.Error() != werr.Error()) {
				t.Fatalf("%x: error %v, msgpack alone %v", b, gerr, werr)
			}
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("%x: %#v, msgpack alone %#v", b, got, want)
			}
		}
	}
	// The Payload field travels as the data: a body that carries bytes in
	// it is msgpack's to decode, and the data then wins as before.
	all := codecOf(t, fastAll{})
	body := []byte{0x81, 0xa4, 'D', 'a', 't', 'a', 0xc4, 0x01, 0x07}
	if _, ok := all.fast.decode(all, body, true, Payload{1}, 0); ok {
		t.Fatal("fast decoder took a body with bytes in the Payload field")
	}
	got, err := decodeBody(all, body, true, Payload{1})
	if err != nil || !bytes.Equal(got.(*fastAll).Data, []byte{1}) {
		t.Fatalf("payload field: %v %v", got, err)
	}
}

// FuzzFastDecode: whatever the fast decoder accepts, msgpack decodes to
// the same value (and the fast decoder never panics).
func FuzzFastDecode(f *testing.F) {
	types := []*codecType{codecOf(f, fastAll{}), codecOf(f, ping{}), codecOf(f, fastSmall{}), codecOf(f, 0), codecOf(f, ""), codecOf(f, []float64{}), codecOf(f, []byte{}), codecOf(f, fastRefs{})}
	for i, v := range []any{&fastAll{I: -3, S: "x", Bs: []byte{1}, Fs: []float64{2}, Data: Payload{4}}, &ping{N: 5, Text: "hi"}, &fastSmall{A: 1, B: -200}, 7, "seven", []float64{1, 2}, []byte{9},
		&fastRefs{N: 2, To: &pa.PID{Address: "r1", Id: "x", RequestId: 3}, Val: anyValue{V: &fastSmall{A: 4}}}} {
		f.Add(uint8(i), fastBytes(v))
	}
	f.Fuzz(func(t *testing.T, which uint8, b []byte) {
		ct := types[int(which)%len(types)]
		ptr := which&0x80 != 0
		got, ok := ct.fast.decode(ct, b, ptr, nil, 0)
		if !ok {
			return
		}
		want, err := decodeBodySlow(ct, b, ptr, nil, gpu.Buffer{}, 0)
		if err != nil {
			t.Fatalf("fast decoder accepted %x as %s, msgpack refuses it: %v", b, ct.name, err)
		}
		if !sameValue(got, want) {
			t.Fatalf("%x as %s: fast %#v, msgpack %#v", b, ct.name, got, want)
		}
	})
}

// BenchmarkFloat64s encodes and decodes a message with a []float64 field of
// 256 and 2304 values (the faces of Jacobi3D's 16^3 and 48^3 blocks).
func BenchmarkFloat64s(b *testing.B) {
	ct := codecOf(b, fastAll{})
	for _, n := range []int{256, 2304} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			m := &fastAll{Fs: make([]float64, n)}
			for i := range m.Fs {
				m.Fs[i] = float64(i) / 7
			}
			encodeDecodeLoop(b, ct, m)
			b.SetBytes(int64(8 * n))
		})
	}
}

// encodeDecodeLoop encodes m (a pointer) into a reused buffer and decodes
// it, b.N times.
func encodeDecodeLoop(b *testing.B, ct *codecType, m any) {
	var buf []byte
	for b.Loop() {
		body, _, err := appendBody(buf[:0], ct, m, true)
		if err != nil {
			b.Fatal(err)
		}
		buf = body
		if _, err := decodeBody(ct, body, true, nil); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkReducePartial encodes and decodes a rank's reduction partial
// (Jacobi3D's residual and sweep), fast path against msgpack's reflection.
func BenchmarkReducePartial(b *testing.B) {
	ct := codecOf(b, reducePartial{})
	m := &reducePartial{Round: 1234, Op: Max, Target: &pa.PID{Address: "troupe/0", Id: "$driver", RequestId: 0},
		Value: anyValue{V: []float64{1.25e-5, 1234}}, FromRank: 1}
	b.Run("fast", func(b *testing.B) { encodeDecodeLoop(b, ct, m) })
	b.Run("msgpack", func(b *testing.B) {
		for b.Loop() {
			body, _, err := encodeBodySlow(ct, m)
			if err != nil {
				b.Fatal(err)
			}
			if _, err := decodeBodySlow(ct, body, true, nil, gpu.Buffer{}, 0); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// fastLeadZero is stored in an interface as its PID pointer (its other
// field has no size): the fast plan read the PID's first word as the
// field, and a nil one crashed the encoder.
type fastLeadZero struct {
	_  [0]func()
	To *pa.PID
}

// fastColonTag's tag would be a name and an option to msgpack.
type fastColonTag struct {
	A int `msgpack:"x:y"`
}

func init() {
	MustRegister[fastLeadZero]()
	MustRegister[fastColonTag]()
}

// TestFastCodecReviewCases: shapes a review of 2026-12-07 found the fast
// plan getting wrong are left to msgpack, and round-trip.
func TestFastCodecReviewCases(t *testing.T) {
	for _, v := range []any{fastLeadZero{}, fastColonTag{}} {
		if codecOf(t, v).fast != nil {
			t.Errorf("%T has a fast plan; msgpack must encode it", v)
		}
	}
	for _, v := range []any{fastLeadZero{To: pa.NewPID("rank/1", "worker")}, fastLeadZero{}, &fastLeadZero{To: pa.NewPID("rank/1", "w")}} {
		ct, ptr, err := lookupType(v)
		if err != nil {
			t.Fatal(err)
		}
		body, payload, err := encodeBody(ct, v)
		if err != nil {
			t.Fatal(err)
		}
		got, err := decodeBody(ct, body, ptr, payload)
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(got, v) {
			t.Errorf("%#v arrived as %#v", v, got)
		}
	}
}

// TestRegisterRefusesHiddenSpecialFields: a Payload, gpu.Buffer or Typed
// field that is unexported, embedded or tagged msgpack:"-", or a
// gpu.Buffer or Typed below the top level, is refused at Register; one
// path sent such a field and another dropped it, panicked setting it, or
// delivered it empty.
func TestRegisterRefusesHiddenSpecialFields(t *testing.T) {
	type hiddenPayload struct {
		N    int
		data Payload
	}
	type skippedPayload struct {
		N    int
		Data Payload `msgpack:"-"`
	}
	type hiddenBuffer struct{ buf gpu.Buffer }
	type nestedBuffer struct {
		N  int
		In struct{ Buf gpu.Buffer }
	}
	type bufferSlice struct{ Bufs []gpu.Buffer }
	type nestedTyped struct{ M map[string]Typed }
	for name, err := range map[string]error{
		"unexported Payload":    Register[hiddenPayload](),
		"Payload tagged \"-\"":  Register[skippedPayload](),
		"unexported gpu.Buffer": Register[hiddenBuffer](),
		"nested gpu.Buffer":     Register[nestedBuffer](),
		"slice of gpu.Buffer":   Register[bufferSlice](),
		"map of Typed":          Register[nestedTyped](),
	} {
		if err == nil {
			t.Errorf("a type with an %s registered", name)
		}
	}
	type fine struct {
		N   int
		Buf gpu.Buffer
		In  struct{ Raw Payload } // a nested Payload is bytes in the body
	}
	if err := Register[fine](); err != nil {
		t.Errorf("a top-level gpu.Buffer beside a nested Payload: %v", err)
	}
}
