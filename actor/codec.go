package actor

import (
	"bytes"
	"errors"
	"fmt"
	"hash/fnv"
	"reflect"
	"sync"
	"sync/atomic"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/transport"
)

// ErrUnregistered is returned when a message's type was never registered.
var ErrUnregistered = errors.New("actor: message type not registered")

// ErrTypeCollision is returned by Register when two type names hash to the
// same 32-bit type id.
var ErrTypeCollision = errors.New("actor: type id collision")

// Payload is a byte slice that travels outside the msgpack body, as the data
// of the active message: rendezvous for large sizes, landing straight in the
// memory the receiving actor names through its PostReceive hook (zero copy),
// or else in pooled memory. A message type may have one Payload field, at the
// top level of its struct; anywhere else a Payload is encoded inline like
// []byte.
type Payload []byte

// codecType is one registered type.
type codecType struct {
	id      uint32
	name    string
	typ     reflect.Type // the value type (never a pointer)
	payload int          // index of the Payload field, or -1
	device  int          // index of the gpu.Buffer field, or -1
	typed   int          // index of the Typed field, or -1
	fast    *fastCodec   // the reflection-free plan, or nil (fastcodec.go)
	boxer   *boxer       // makes boxes for small received messages, or nil (box.go)

	// sentAs are lastSent's entries for this type: sent as a value, and
	// as a pointer.
	sentAs [2]sentType

	// lastLarge is the encoded size of the type's last message when that
	// was larger than transport.MaxPostAM, else 0: the next one is encoded
	// into a pooled buffer of that size (post).
	lastLarge atomic.Int64
}

// noteSize records the encoded size n of a message of the type (lastLarge).
func (ct *codecType) noteSize(n int) {
	switch {
	case n > transport.MaxPostAM:
		ct.lastLarge.Store(int64(n))
	case ct.lastLarge.Load() != 0:
		ct.lastLarge.Store(0)
	}
}

// sentType is a message type as lookupType found it: the dynamic type of
// the message, its registered type, and whether it was a pointer.
type sentType struct {
	t   reflect.Type
	ct  *codecType
	ptr bool
}

// lastSent is the type lookupType found last. Senders mostly send one type
// many times in a row, and comparing two reflect.Types costs less than
// hashing one into the registry's map.
var lastSent atomic.Pointer[sentType]

// registry holds the registered types. Lookups, one per message sent and
// received, read immutable maps without a lock; Register (rare) replaces
// them under mu.
var registry = newRegistry() // set before any init function runs

type typeRegistry struct {
	mu     sync.Mutex
	byID   atomic.Pointer[map[uint32]*codecType]
	byType atomic.Pointer[map[reflect.Type]*codecType]
}

func newRegistry() *typeRegistry {
	r := &typeRegistry{}
	r.byID.Store(&map[uint32]*codecType{})
	r.byType.Store(&map[reflect.Type]*codecType{})
	return r
}

// typeName is the stable name a type id is derived from: the import path
// and name for named types, the type's spelling otherwise.
func typeName(t reflect.Type) string {
	if t.Name() != "" && t.PkgPath() != "" {
		return t.PkgPath() + "." + t.Name()
	}
	return t.String()
}

// TypeID returns the 32-bit wire id of a type name (FNV-1a).
func TypeID(name string) uint32 {
	h := fnv.New32a()
	h.Write([]byte(name))
	return h.Sum32()
}

// Register adds T to the message type registry, so that values of T and *T
// can be sent to actors on other ranks. Every rank must register the same
// types (typically in an init function). Registering a type twice is
// harmless; two different types whose names hash to the same id are an
// ErrTypeCollision.
func Register[T any]() error {
	return registerType(reflect.TypeFor[T](), boxerFor[T]())
}

// MustRegister is Register that panics on error, for init functions.
func MustRegister[T any]() {
	if err := Register[T](); err != nil {
		panic(err)
	}
}

// noNestedSpecial reports a gpu.Buffer or Typed inside t (t itself may be
// one: it is a top-level field's type, which is allowed). Only top-level
// fields of those types travel; nested, they arrived empty.
func noNestedSpecial(t reflect.Type, seen map[reflect.Type]bool) error {
	var walk func(t reflect.Type, top bool) error
	walk = func(t reflect.Type, top bool) error {
		if !top && (t == deviceType || t == typedType) {
			return fmt.Errorf("a %s below the top level of a message does not travel", t)
		}
		if t == deviceType || t == typedType || seen[t] {
			return nil
		}
		seen[t] = true
		switch t.Kind() {
		case reflect.Pointer, reflect.Slice, reflect.Array:
			return walk(t.Elem(), false)
		case reflect.Map:
			if err := walk(t.Key(), false); err != nil {
				return err
			}
			return walk(t.Elem(), false)
		case reflect.Struct:
			for i := 0; i < t.NumField(); i++ {
				if err := walk(t.Field(i).Type, false); err != nil {
					return err
				}
			}
		}
		return nil
	}
	return walk(t, true)
}

// registerType registers t; bx, when not nil, makes boxes of t (box.go).
func registerType(t reflect.Type, bx *boxer) error {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t.Kind() == reflect.Interface || t.Kind() == reflect.Func || t.Kind() == reflect.Chan {
		return fmt.Errorf("actor: cannot register %s: a %s cannot cross ranks", t, t.Kind())
	}
	ct := &codecType{name: typeName(t), typ: t, payload: -1, device: -1, typed: -1}
	ct.sentAs = [2]sentType{{t: t, ct: ct}, {t: reflect.PointerTo(t), ct: ct, ptr: true}}
	ct.id = TypeID(ct.name)
	if t.Kind() == reflect.Struct {
		for i := 0; i < t.NumField(); i++ {
			f := t.Field(i)
			ft := f.Type
			if err := noNestedSpecial(ft, map[reflect.Type]bool{}); err != nil {
				return fmt.Errorf("actor: cannot register %s: field %s: %w", ct.name, f.Name, err)
			}
			if ft != payloadType && ft != deviceType && ft != typedType {
				continue
			}
			if !f.IsExported() || f.Anonymous || f.Tag.Get("msgpack") == "-" {
				// The codec would send it on one path and drop it, or
				// panic setting it, on another.
				return fmt.Errorf("actor: cannot register %s: its %s field %s must be exported, named and not tagged msgpack:\"-\"", ct.name, ft, f.Name)
			}
			if ct.payload >= 0 || ct.device >= 0 || ct.typed >= 0 {
				return fmt.Errorf("actor: cannot register %s: more than one Payload, gpu.Buffer or Typed field", ct.name)
			}
			switch ft {
			case payloadType:
				ct.payload = i
			case deviceType:
				ct.device = i
			default:
				ct.typed = i
			}
		}
	}
	ct.fast = newFastCodec(ct)
	if ct.fast != nil && ct.payload >= 0 && bx != nil {
		ct.boxer = bx
	}
	registry.mu.Lock()
	defer registry.mu.Unlock()
	byID, byType := *registry.byID.Load(), *registry.byType.Load()
	if old, ok := byID[ct.id]; ok {
		if old.typ == t {
			return nil
		}
		return fmt.Errorf("%w: %s and %s both hash to 0x%08x", ErrTypeCollision, old.name, ct.name, ct.id)
	}
	newID := make(map[uint32]*codecType, len(byID)+1)
	for k, v := range byID {
		newID[k] = v
	}
	newID[ct.id] = ct
	newType := make(map[reflect.Type]*codecType, len(byType)+1)
	for k, v := range byType {
		newType[k] = v
	}
	newType[t] = ct
	registry.byType.Store(&newType)
	registry.byID.Store(&newID)
	return nil
}

var payloadType = reflect.TypeFor[Payload]()

// lookupType finds the registered type of a message value and whether it
// was passed as a pointer.
func lookupType(msg any) (*codecType, bool, error) {
	t := reflect.TypeOf(msg)
	if t == nil {
		return nil, false, fmt.Errorf("%w: nil message", ErrUnregistered)
	}
	var ct *codecType
	ptr := false
	if last := lastSent.Load(); last != nil && last.t == t {
		ct, ptr = last.ct, last.ptr
	} else {
		if t.Kind() == reflect.Pointer {
			t, ptr = t.Elem(), true
		}
		ct = (*registry.byType.Load())[t]
		if ct == nil {
			return nil, false, fmt.Errorf("%w: %s (call actor.Register[%s]() on every rank)", ErrUnregistered, typeName(t), t.Name())
		}
		if ptr {
			lastSent.Store(&ct.sentAs[1])
		} else {
			lastSent.Store(&ct.sentAs[0])
		}
	}
	if ptr && reflect.ValueOf(msg).IsNil() {
		return nil, false, fmt.Errorf("actor: nil *%s message", ct.name)
	}
	return ct, ptr, nil
}

func lookupID(id uint32) *codecType {
	return (*registry.byID.Load())[id]
}

var encoderPool = sync.Pool{New: func() any {
	b := new(bytes.Buffer)
	enc := msgpack.NewEncoder(b)
	return &pooledEncoder{buf: b, enc: enc}
}}

type pooledEncoder struct {
	buf *bytes.Buffer
	enc *msgpack.Encoder
}

// encodeBody encodes msg (of registered type ct) as msgpack and returns the
// body and, if the type has a Payload field, its bytes (not in the body).
func encodeBody(ct *codecType, msg any) (body []byte, payload []byte, err error) {
	if ct.fast != nil {
		body, payload, ok := ct.fast.appendBody(nil, msg, reflect.TypeOf(msg).Kind() == reflect.Pointer)
		if ok {
			return body, payload, nil
		}
	}
	return encodeBodySlow(ct, msg)
}

// appendBody is encodeBody appending the body to b; ptr says msg is a *T.
func appendBody(b []byte, ct *codecType, msg any, ptr bool) (body []byte, payload []byte, err error) {
	if ct.fast != nil {
		var ok bool
		if body, payload, ok = ct.fast.appendBody(b, msg, ptr); ok {
			return body, payload, nil
		}
	}
	body, payload, err = encodeBodySlow(ct, msg)
	return append(b, body...), payload, err
}

// stagesPayload reports whether the data sent beside the body is the
// runtime's own copy (a Typed field packed, a gpu.Buffer field staged to
// the host, both in getBuf's memory) rather than the sender's Payload.
func (ct *codecType) stagesPayload() bool { return ct.typed >= 0 || ct.device >= 0 }

// encodeBodySlow is encodeBody by msgpack's reflection.
func encodeBodySlow(ct *codecType, msg any) (body []byte, payload []byte, err error) {
	v := reflect.ValueOf(msg)
	if v.Kind() == reflect.Pointer {
		v = v.Elem()
	}
	// The one field that travels outside the body (Payload, gpu.Buffer or
	// Typed) becomes the data and is zeroed in a copy that is encoded.
	if i := max(ct.payload, ct.device, ct.typed); i >= 0 {
		f := v.Field(i)
		switch i {
		case ct.payload:
			payload = f.Bytes()
		case ct.device:
			payload, err = stageDevice(f)
		default:
			payload, err = packTyped(f)
		}
		if err != nil {
			return nil, nil, fmt.Errorf("actor: %s: %w", ct.name, err)
		}
		c := reflect.New(ct.typ).Elem()
		c.Set(v)
		c.Field(i).SetZero()
		v = c
	}
	pe := encoderPool.Get().(*pooledEncoder)
	defer encoderPool.Put(pe)
	pe.buf.Reset()
	if err := pe.enc.EncodeValue(v); err != nil {
		return nil, nil, fmt.Errorf("actor: encoding %s: %w", ct.name, err)
	}
	return bytes.Clone(pe.buf.Bytes()), payload, nil
}

var decoderPool = sync.Pool{New: func() any { return msgpack.NewDecoder(nil) }}

// decodeBody decodes a body of type ct after validating it; payload (may be
// nil) is set into the Payload field.
func decodeBody(ct *codecType, body []byte, ptr bool, payload []byte) (any, error) {
	return decodeBodyDepth(ct, body, ptr, payload, gpu.Buffer{}, 0)
}

// decodeBodyDevice is decodeBody that also sets the gpu.Buffer field to dev.
func decodeBodyDevice(ct *codecType, body []byte, ptr bool, payload []byte, dev gpu.Buffer) (any, error) {
	return decodeBodyDepth(ct, body, ptr, payload, dev, 0)
}

// maxAnyDepth bounds how deep values of type any (anyValue: fields of type
// any, an array broadcast's value) may nest in one message. Each level is
// a body of its own, which the msgpack validator's depth limit does not
// look into; without a bound a message of nested values could exhaust the
// stack, or cost time quadratic in its size (the fast decoder walks the
// levels below before it gives one up).
const maxAnyDepth = 16

// decodeBodyDepth is decodeBodyDevice for a body nested in depth
// anyValues; it refuses runtime messages that would fail in protoactor
// (checkRuntimeMessage).
func decodeBodyDepth(ct *codecType, body []byte, ptr bool, payload []byte, dev gpu.Buffer, depth int) (any, error) {
	var (
		msg any
		ok  bool
	)
	if ct.fast != nil && dev.IsZero() {
		msg, ok = ct.fast.decode(ct, body, ptr, payload, depth)
	}
	if !ok {
		var err error
		if msg, err = decodeBodySlow(ct, body, ptr, payload, dev, depth); err != nil {
			return nil, err
		}
	}
	if err := checkRuntimeMessage(msg); err != nil {
		return nil, err
	}
	return msg, nil
}

// checkRuntimeMessage refuses the protoactor system messages that name no
// actor (a Watch or Unwatch without a watcher, a Terminated without the
// actor that ended): protoactor would dereference the nil PID, in the
// rank's message path or in its dead-letter handler.
func checkRuntimeMessage(msg any) error {
	var missing string
	switch m := msg.(type) {
	case *actor.Watch:
		if m == nil || m.Watcher == nil {
			missing = "Watch without a watcher"
		}
	case *actor.Unwatch:
		if m == nil || m.Watcher == nil {
			missing = "Unwatch without a watcher"
		}
	case *actor.Terminated:
		if m == nil || m.Who == nil {
			missing = "Terminated without the actor that ended"
		}
	}
	if missing != "" {
		return &DecodeError{Reason: missing}
	}
	return nil
}

// bodyReader is what msgpack decodes a body from; depth is the number of
// anyValues the body is nested in, which anyValue.DecodeMsgpack reads back
// through the decoder (Decoder.Buffered returns the reader when it is a
// byte scanner, as this one is).
type bodyReader struct {
	*bytes.Reader
	depth int
}

// decodeBodySlow is decodeBodyDevice by msgpack's reflection, the body
// validated first. msgpack panics on some bodies that are valid msgpack
// but do not fit the type (a value that does not implement an interface
// field, an unhashable map key): that is an error like any other.
func decodeBodySlow(ct *codecType, body []byte, ptr bool, payload []byte, dev gpu.Buffer, depth int) (any, error) {
	if err := validateMsgpack(body); err != nil {
		return nil, fmt.Errorf("actor: body of %s: %w", ct.name, err)
	}
	v := reflect.New(ct.typ)
	dec := decoderPool.Get().(*msgpack.Decoder)
	dec.Reset(&bodyReader{bytes.NewReader(body), depth})
	// Decode into the addressable *v, not v: given the unaddressable
	// pointer itself, msgpack panics on a body that is just nil (0xc0),
	// as it tries to set the pointer to nil (found by FuzzDecodeBody).
	err := decodeValue(dec, v.Elem())
	dec.Reset(nil)
	decoderPool.Put(dec)
	if err != nil {
		return nil, &DecodeError{Reason: fmt.Sprintf("body of %s: %v", ct.name, err)}
	}
	if ct.payload >= 0 && payload != nil {
		v.Elem().Field(ct.payload).SetBytes(payload)
	}
	if ct.device >= 0 && !dev.IsZero() {
		v.Elem().Field(ct.device).Set(reflect.ValueOf(dev))
	}
	if ptr {
		return v.Interface(), nil
	}
	return v.Elem().Interface(), nil
}

// decodeValue is dec.DecodeValue(v) with msgpack's panics turned into
// errors.
func decodeValue(dec *msgpack.Decoder, v reflect.Value) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("msgpack: %v", p)
		}
	}()
	return dec.DecodeValue(v)
}

// UndeliverableError is the response a Request gets when its message could
// not be delivered on the target rank (unknown type there, malformed body,
// no such actor), and the reason dead letters carry.
type UndeliverableError struct {
	Target string // target actor id
	Reason string
	// cause is the error behind it on this rank (a *transport.PeerLostError
	// for requests pending on a rank that was lost); it does not travel.
	cause error
}

func (e *UndeliverableError) Error() string {
	return fmt.Sprintf("actor: message to %s undeliverable: %s", e.Target, e.Reason)
}

// Unwrap returns the error behind e on this rank, if any: requests pending
// on a lost rank fail with an e that wraps a *transport.PeerLostError, so
// errors.Is(err, transport.ErrPeerLost) holds for them.
func (e *UndeliverableError) Unwrap() error { return e.cause }

func init() {
	// Runtime messages every rank understands.
	for _, t := range []reflect.Type{
		reflect.TypeFor[actor.Watch](),
		reflect.TypeFor[actor.Unwatch](),
		reflect.TypeFor[actor.Terminated](),
		reflect.TypeFor[actor.Stop](),
		reflect.TypeFor[actor.PoisonPill](),
		reflect.TypeFor[actor.DeadLetterResponse](),
		reflect.TypeFor[UndeliverableError](),
		reflect.TypeFor[bool](),
		reflect.TypeFor[int](),
		reflect.TypeFor[int64](),
		reflect.TypeFor[uint64](),
		reflect.TypeFor[float64](),
		reflect.TypeFor[string](),
		reflect.TypeFor[[]byte](),
		reflect.TypeFor[[]int64](),
		reflect.TypeFor[[]float64](),
	} {
		if err := registerType(t, nil); err != nil {
			panic(err)
		}
	}
}
