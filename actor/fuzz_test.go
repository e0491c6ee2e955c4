package actor

import (
	"bytes"
	"errors"
	"reflect"
	"runtime"
	"testing"

	pa "github.com/asynkron/protoactor-go/actor"
)

// fuzzRanks is the job size the fuzzed envelopes are checked against.
const fuzzRanks = 64

// seedEnvelopes are valid envelopes for the fuzzers' seed corpus (the
// committed corpus under testdata/fuzz holds these and malformed ones).
func seedEnvelopes() [][]byte {
	es := []envelope{
		{Source: 0, Target: "echo", Type: TypeID("x")},
		{Flags: flagPointer, Source: 3, Target: "future$12", TargetReq: 7, SenderRank: 2, Sender: "request$9", Type: 0xdeadbeef},
		{Flags: flagSystem | flagNoCredit, Source: 63, SenderRank: 63, Target: string(make([]byte, 300)), Type: 1},
		{Flags: flagBodyHdr | flagPointer, Source: 1, Target: "sink", Type: 42, PayloadLen: 1 << 20, Body: []byte{0x81, 0xa1, 'N', 0x05}},
		{Flags: flagBodyHdr, Source: 5, Target: "a", Type: 1 << 31, PayloadLen: 70000, Body: make([]byte, 300)},
		{Flags: flagBodyHdr, Source: 2, Target: "b", Body: []byte{}},
		{Flags: flagBodyHdr | flagDeviceIPC | flagPointer, Source: 1, Target: "sink", Type: 7, PayloadLen: 4096, Body: []byte{0x90}},
	}
	return encodeEnvelopes(es)
}

// encodeEnvelopes returns the wire form of each of es.
func encodeEnvelopes(es []envelope) [][]byte {
	var out [][]byte
	for i := range es {
		out = append(out, appendEnvelope(nil, &es[i]))
	}
	return out
}

// FuzzDecodeEnvelope: decodeEnvelope never panics, fails only with a
// *DecodeError, and whatever it accepts re-encodes to exactly the same
// bytes (the wire form of an envelope is canonical).
func FuzzDecodeEnvelope(f *testing.F) {
	for _, b := range seedEnvelopes() {
		f.Add(b)
		f.Add(b[:len(b)/2])
	}
	f.Add([]byte{})
	f.Add([]byte{0x9a, 0xcc, 0x01}) // version in a longer form than needed
	cache := &targetCache{addr: Address(0), m: map[string]*target{}}
	f.Fuzz(func(t *testing.T, b []byte) {
		e, err := decodeEnvelope(b, fuzzRanks)
		// The runtime's decoding, through its target cache, agrees.
		var ce envelope
		cerr := decodeEnvelopeInto(&ce, b, fuzzRanks, cache)
		if (err == nil) != (cerr == nil) || (err == nil && !reflect.DeepEqual(e, ce)) || (err == nil && cache.last.pid.Id != e.Target) {
			t.Fatalf("%x: %+v %v, through the target cache %+v %v", b, e, err, ce, cerr)
		}
		if err != nil {
			var de *DecodeError
			if !errors.As(err, &de) {
				t.Fatalf("error %v (%T) is not a *DecodeError", err, err)
			}
			return
		}
		if again := appendEnvelope(nil, &e); !bytes.Equal(again, b) {
			t.Fatalf("accepted %x, which re-encodes as %x (%+v)", b, again, e)
		}
	})
}

// FuzzEnvelopeShort: whatever the short-form reader accepts, the general
// one reads to exactly the same fields.
func FuzzEnvelopeShort(f *testing.F) {
	for _, b := range append(seedEnvelopes(), shortEnvelopes()...) {
		f.Add(b)
		f.Add(b[:len(b)-1])
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var short, general rawEnvelope
		if !parseEnvelopeShort(b, &short) {
			return
		}
		if err := parseEnvelope(b, &general); err != nil || !reflect.DeepEqual(short, general) {
			t.Fatalf("%x: short form read %+v, the general reader %+v (%v)", b, short, general, err)
		}
	})
}

// shortEnvelopes are envelopes of the shape parseEnvelopeShort reads: every
// payload length encoding it takes, no body, an empty one and a full one.
func shortEnvelopes() [][]byte {
	es := []envelope{
		{Flags: flagBodyHdr | flagPointer, Source: 1, Target: "sink", Type: TypeID("x"), PayloadLen: 64, SenderRank: 1, Body: []byte{0x81, 0xa1, 'N', 0x05}},
		{Flags: flagBodyHdr, Source: 127, Target: "a", Type: 0x10000, PayloadLen: 200, SenderRank: 3, Body: []byte{}},
		{Flags: flagBodyHdr, Source: 2, Target: string(make([]byte, 31)), Type: 0xffffffff, PayloadLen: 4096, Body: make([]byte, 255)},
		{Flags: flagBodyHdr, Source: 2, Target: "t", Type: 0x12345678, PayloadLen: 1 << 20, Body: []byte{0x90}},
		{Flags: flagPointer, Source: 0, Target: "echo", TargetReq: 127, Sender: "request#z", SenderRank: 1, Type: TypeID("y")},
	}
	return encodeEnvelopes(es)
}

// TestEnvelopeShortForm: the envelopes of ordinary messages take the short
// path, and those just outside its forms are left to the general reader.
func TestEnvelopeShortForm(t *testing.T) {
	for _, b := range shortEnvelopes() {
		var f rawEnvelope
		if !parseEnvelopeShort(b, &f) {
			t.Errorf("%x: not read by the short path", b)
		}
		e, err := decodeEnvelope(b, 128)
		if err != nil || !bytes.Equal(appendEnvelope(nil, &e), b) {
			t.Errorf("%x: decoded %+v, %v", b, e, err)
		}
	}
	for _, e := range []envelope{
		{Source: 128, Target: "a", Type: 0x10000},                                 // source needs 2 bytes
		{Source: 0, Target: string(make([]byte, 32)), Type: 0x10000},              // str 8 target
		{Source: 0, Target: "a", Type: 0xffff},                                    // 16-bit type id
		{Flags: flagBodyHdr, Target: "a", Type: 0x10000, Body: make([]byte, 256)}, // bin 16 body
		{Target: "a", TargetReq: 128, Type: 0x10000},                              // 2-byte request id
	} {
		b := appendEnvelope(nil, &e)
		var f rawEnvelope
		if parseEnvelopeShort(b, &f) {
			t.Errorf("%x (%+v): read by the short path", b, e)
		}
		if _, err := decodeEnvelope(b, 256); err != nil {
			t.Errorf("%x: %v", b, err)
		}
	}
}

// FuzzValidateMsgpack: the validator never panics, fails only with a
// *DecodeError, and what it accepts the msgpack decoder can decode into an
// interface without panicking.
func FuzzValidateMsgpack(f *testing.F) {
	for _, b := range seedBodies(f) {
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		err := validateMsgpack(b)
		if err != nil {
			var de *DecodeError
			if !errors.As(err, &de) {
				t.Fatalf("error %v (%T) is not a *DecodeError", err, err)
			}
			return
		}
		ct, _, err := lookupType(fuzzAny{})
		if err != nil {
			t.Fatal(err)
		}
		_, _ = decodeBody(ct, b, true, nil)
	})
}

// fuzzAny decodes any msgpack value.
type fuzzAny struct{ V any }

// fuzzTypes are the registered types FuzzDecodeBody decodes into.
var fuzzTypes = []*codecType{}

func init() {
	MustRegister[fuzzAny]()
	MustRegister[hostileReply]()
	MustRegister[hostileKeys]()
	for _, t := range []any{propMsg{}, ping{}, pa.Terminated{}, pa.Watch{}, UndeliverableError{}, int64(0), "", []float64{}, fuzzAny{}, hostileReply{}, hostileKeys{}} {
		ct, _, err := lookupType(t)
		if err != nil {
			panic(err)
		}
		fuzzTypes = append(fuzzTypes, ct)
	}
}

// seedBodies are valid bodies of the fuzzed types, then malformed ones.
func seedBodies(tb testing.TB) [][]byte {
	var out [][]byte
	for _, m := range []any{samplePropMsg(), &ping{N: 3, Text: "hi"}, &pa.Terminated{Who: pa.NewPID("rank/1", "x"), Why: pa.TerminatedReason_AddressTerminated}, int64(-5), "str", []float64{1, 2.5}} {
		ct, _, err := lookupType(m)
		if err != nil {
			tb.Fatal(err)
		}
		body, _, err := encodeBody(ct, m)
		if err != nil {
			tb.Fatal(err)
		}
		out = append(out, body, body[:len(body)-1])
	}
	return append(out,
		[]byte{0xdd, 0xff, 0xff, 0xff, 0xff},       // array of 4 G elements, none there
		[]byte{0xc6, 0x7f, 0xff, 0xff, 0xff, 0x00}, // 2 GiB of binary, 1 byte there
		[]byte{0xdf, 0x00, 0x00, 0x00, 0x02, 0xa1, 'a'},
		[]byte{0xc1},                    // never-used type byte
		bytes.Repeat([]byte{0x91}, 100), // nested deeper than allowed
		[]byte{0xa5, 'N'},               // a string where a struct is due, truncated
		[]byte{},
	)
}

// FuzzDecodeBody: decoding any bytes as any registered type never panics,
// fails with an error that wraps a *DecodeError, and allocates at most a
// bounded multiple of the body's size: the validator has checked every
// declared length against the bytes present, so a hostile length cannot
// make the decoder reserve memory the frame does not justify.
func FuzzDecodeBody(f *testing.F) {
	bodies := seedBodies(f)
	for i, b := range bodies {
		f.Add(uint8(i), b)
	}
	f.Fuzz(func(t *testing.T, which uint8, b []byte) {
		ct := fuzzTypes[int(which)%len(fuzzTypes)]
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		_, err := decodeBody(ct, b, which&0x80 != 0, nil)
		runtime.ReadMemStats(&after)
		if err != nil {
			var de *DecodeError
			if !errors.As(err, &de) {
				t.Fatalf("decoding %x as %s: error %v (%T) wraps no *DecodeError", b, ct.name, err, err)
			}
		}
		// An element takes at least one byte of the body and at most a few
		// hundred bytes of memory (a propMsg, a map bucket share, a string
		// header), plus the decoder's fixed costs.
		if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 512*uint64(len(b))+64<<10 {
			t.Fatalf("decoding %d bytes as %s allocated %d bytes", len(b), ct.name, alloc)
		}
	})
}
