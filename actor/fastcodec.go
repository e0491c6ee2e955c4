package actor

import (
	"encoding"
	"encoding/binary"
	"math"
	"reflect"
	"slices"
	"strings"
	"unsafe"

	pa "github.com/asynkron/protoactor-go/actor"
	"github.com/vmihailenco/msgpack/v5"
)

// This file holds the codec's fast path: for registered types made only of
// predeclared scalars, strings, byte slices, slices of numbers, actor PIDs
// and the runtime's nested values (and a top-level Payload), a plan
// computed once at registration encodes and decodes values without
// reflection per call. It writes exactly the bytes
// vmihailenco/msgpack writes for the type (TestFastCodecSameBytes checks),
// so the two are interchangeable on the wire. Its decoder accepts only the
// forms that encoder writes, checking every length against the bytes left;
// anything else (another encoder's choices, malformed or hostile input)
// makes it give up, and the body goes through validateMsgpack and msgpack
// exactly as before, errors included.

// fastKind is the wire shape of one value.
type fastKind uint8

const (
	fkBool fastKind = iota + 1
	fkInt           // compact: the shortest msgpack integer
	fkInt8
	fkInt16
	fkInt32
	fkInt64
	fkUint // compact
	fkUint8
	fkUint16
	fkUint32
	fkUint64
	fkFloat32
	fkFloat64
	fkString
	fkBytes
	fkSlice // a slice of elem
	fkAny   // a nested value of any registered type (anyValue)
	fkPID   // a *pa.PID: nil, or the map of its three exported fields
)

// fastScalars maps the predeclared types the fast path carries to their
// shape. Named types (type Celsius float64) are left to msgpack: they may
// implement its encoder interfaces or be registered as extensions.
var fastScalars = map[reflect.Type]fastKind{
	reflect.TypeFor[bool]():    fkBool,
	reflect.TypeFor[int]():     fkInt,
	reflect.TypeFor[int8]():    fkInt8,
	reflect.TypeFor[int16]():   fkInt16,
	reflect.TypeFor[int32]():   fkInt32,
	reflect.TypeFor[int64]():   fkInt64,
	reflect.TypeFor[uint]():    fkUint,
	reflect.TypeFor[uint8]():   fkUint8,
	reflect.TypeFor[uint16]():  fkUint16,
	reflect.TypeFor[uint32]():  fkUint32,
	reflect.TypeFor[uint64]():  fkUint64,
	reflect.TypeFor[float32](): fkFloat32,
	reflect.TypeFor[float64](): fkFloat64,
	reflect.TypeFor[string]():  fkString,
}

// fastValue is how one value (a field, or the whole message) travels.
type fastValue struct {
	kind    fastKind
	elem    fastKind     // fkSlice: the elements' kind (a numeric scalar or bool)
	esize   uintptr      // fkSlice: the element size in memory
	typ     reflect.Type // fkSlice: the slice type, to allocate it
	payload bool         // the Payload field: always nil in the body
}

// fastField is one field of a struct plan.
type fastField struct {
	name string
	key  []byte // the msgpack-encoded name
	off  uintptr
	fastValue
}

// fastCodec is the plan of one registered type.
type fastCodec struct {
	isStruct bool
	value    fastValue   // the whole value, when not a struct
	fields   []fastField // in declaration order (msgpack's)
	payload  uintptr     // the Payload field's offset, or ^0
}

var (
	fastMarshalers = []reflect.Type{
		reflect.TypeFor[msgpack.CustomEncoder](),
		reflect.TypeFor[msgpack.CustomDecoder](),
		reflect.TypeFor[msgpack.Marshaler](),
		reflect.TypeFor[msgpack.Unmarshaler](),
		reflect.TypeFor[encoding.BinaryMarshaler](),
		reflect.TypeFor[encoding.BinaryUnmarshaler](),
		reflect.TypeFor[encoding.TextMarshaler](),
		reflect.TypeFor[encoding.TextUnmarshaler](),
	}
)

// customCoded reports whether msgpack would hand t to one of its encoder or
// decoder interfaces rather than encode it by its kind.
func customCoded(t reflect.Type) bool {
	for _, i := range fastMarshalers {
		if t.Implements(i) || reflect.PointerTo(t).Implements(i) {
			return true
		}
	}
	return false
}

var (
	anyValueType = reflect.TypeFor[anyValue]()
	pidPtrType   = reflect.TypeFor[*pa.PID]()
)

// fastValueOf returns the plan of a value of type t, or false.
func fastValueOf(t reflect.Type) (fastValue, bool) {
	if k, ok := fastScalars[t]; ok {
		return fastValue{kind: k}, true
	}
	switch t {
	case anyValueType:
		return fastValue{kind: fkAny}, true
	case pidPtrType:
		return fastValue{kind: fkPID}, true
	}
	if t == reflect.TypeFor[[]byte]() {
		return fastValue{kind: fkBytes}, true
	}
	if t.Kind() == reflect.Slice && t.Name() == "" {
		if k, ok := fastScalars[t.Elem()]; ok && k != fkString {
			return fastValue{kind: fkSlice, elem: k, esize: t.Elem().Size(), typ: t}, true
		}
	}
	return fastValue{}, false
}

// newFastCodec plans ct's type, or returns nil when msgpack must do it.
func newFastCodec(ct *codecType) *fastCodec {
	t := ct.typ
	if ct.device >= 0 || ct.typed >= 0 || customCoded(t) {
		return nil
	}
	if t.Kind() != reflect.Struct {
		v, ok := fastValueOf(t)
		if !ok || v.kind == fkAny || v.kind == fkPID {
			return nil
		}
		return &fastCodec{value: v, payload: ^uintptr(0)}
	}
	fc := &fastCodec{isStruct: true, payload: ^uintptr(0)}
	seen := map[string]bool{}
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		if f.Name == "_msgpack" || f.Anonymous {
			return nil // struct options, or fields msgpack inlines
		}
		tag := f.Tag.Get("msgpack")
		if strings.ContainsAny(tag, ",\"'\\ :\t") {
			return nil // options (omitempty, alias, ...): msgpack's business
		}
		if tag == "-" || !f.IsExported() {
			continue
		}
		name := f.Name
		if tag != "" {
			name = tag
		}
		if seen[name] {
			return nil
		}
		seen[name] = true
		var v fastValue
		if i == ct.payload {
			v = fastValue{kind: fkBytes, payload: true}
			fc.payload = f.Offset
		} else {
			var ok bool
			if v, ok = fastValueOf(f.Type); !ok {
				return nil
			}
		}
		fc.fields = append(fc.fields, fastField{name: name, key: appendString(nil, name), off: f.Offset, fastValue: v})
	}
	// A struct of one pointer (beside zero-size fields) is stored in an
	// interface as that pointer, which appendBody's view of a value message
	// does not handle.
	if len(fc.fields) == 1 && fc.fields[0].kind == fkPID && t.Size() == unsafe.Sizeof(uintptr(0)) {
		return nil
	}
	// At most 64 fields (a bit each in decode's mask). And at least one
	// unless the struct is empty: a struct of unexported fields only may
	// be pointer-shaped, which appendBody's view of a value message does
	// not handle.
	if len(fc.fields) > 64 || (len(fc.fields) == 0 && t.Size() != 0) {
		return nil
	}
	return fc
}

// efaceData is the pointer an interface holds to its (non-pointer) value.
func efaceData(v any) unsafe.Pointer {
	return (*[2]unsafe.Pointer)(unsafe.Pointer(&v))[1]
}

// appendBody appends msg's body (msg is a T or a non-nil *T of the plan's
// type) and returns its Payload field, if any. It reports false, having
// appended garbage, when a nested value needs msgpack (an unregistered or
// slow-coded type, or one msgpack refuses): the caller then encodes msg
// that way, errors included.
func (fc *fastCodec) appendBody(b []byte, msg any, ptr bool) ([]byte, []byte, bool) {
	var p unsafe.Pointer
	if ptr {
		p = reflect.ValueOf(msg).UnsafePointer()
	} else {
		// None of the plan's types is pointer-shaped: the interface points
		// at the value.
		p = efaceData(msg)
	}
	if !fc.isStruct {
		return appendFast(b, &fc.value, p), nil, true
	}
	var payload []byte
	b = appendMapLen(b, len(fc.fields))
	for i := range fc.fields {
		f := &fc.fields[i]
		b = append(b, f.key...)
		fp := unsafe.Add(p, f.off)
		switch {
		case f.payload:
			payload = *(*[]byte)(fp)
			b = append(b, 0xc0)
		case f.kind == fkAny:
			var ok bool
			if b, ok = appendAny(b, (*anyValue)(fp)); !ok {
				return b, nil, false
			}
		case f.kind == fkPID:
			b = appendPID(b, *(**pa.PID)(fp))
		default:
			b = appendFast(b, &f.fastValue, fp)
		}
	}
	return b, payload, true
}

// appendAny appends a nested value as anyValue.EncodeMsgpack writes it:
// nil, or [type id (uint32), pointer flag, body (bin)]. It reports false
// when the value's type has no fast plan or cannot be nested (msgpack's
// path then encodes it, or reports why it cannot).
func appendAny(b []byte, a *anyValue) ([]byte, bool) {
	if a.V == nil {
		return append(b, 0xc0), true
	}
	ct, ptr, err := lookupType(a.V)
	if err != nil || ct.fast == nil || nestable(ct) != nil {
		return b, false
	}
	b = binary.BigEndian.AppendUint32(append(b, 0x93, 0xce), ct.id)
	if ptr {
		b = append(b, 0xc3)
	} else {
		b = append(b, 0xc2)
	}
	// The body goes after the longest bin header, which then moves up to
	// its own length.
	head := len(b)
	b = append(b, 0, 0, 0, 0, 0)
	b, _, ok := ct.fast.appendBody(b, a.V, ptr)
	if !ok {
		return b, false
	}
	n := len(b) - head - 5
	hdr := appendBinLen(make([]byte, 0, 5), n)
	copy(b[head+len(hdr):], b[head+5:])
	copy(b[head:], hdr)
	return b[:len(b)-(5-len(hdr))], true
}

// Keys of a PID's fields, as msgpack writes them.
var (
	pidAddressKey   = appendString(nil, "Address")
	pidIDKey        = appendString(nil, "Id")
	pidRequestIDKey = appendString(nil, "RequestId")
)

// appendPID appends a *pa.PID as msgpack writes it: nil, or the map of its
// exported fields in declaration order.
func appendPID(b []byte, pid *pa.PID) []byte {
	if pid == nil {
		return append(b, 0xc0)
	}
	b = append(b, 0x83)
	b = appendString(append(b, pidAddressKey...), pid.Address)
	b = appendString(append(b, pidIDKey...), pid.Id)
	return binary.BigEndian.AppendUint32(append(append(b, pidRequestIDKey...), 0xce), pid.RequestId)
}

func appendMapLen(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, 0x80|byte(n))
	case n <= math.MaxUint16:
		return append(b, 0xde, byte(n>>8), byte(n))
	default:
		return append(b, 0xdf, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	}
}

// appendInt appends n in the shortest form (msgpack's EncodeInt).
func appendInt(b []byte, n int64) []byte {
	switch {
	case n >= 0:
		return appendUint(b, uint64(n))
	case n >= -32:
		return append(b, byte(n))
	case n >= math.MinInt8:
		return append(b, 0xd0, byte(n))
	case n >= math.MinInt16:
		return append(b, 0xd1, byte(n>>8), byte(n))
	case n >= math.MinInt32:
		return append(b, 0xd2, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	}
	return binary.BigEndian.AppendUint64(append(b, 0xd3), uint64(n))
}

// appendScalar appends the scalar of kind k at p.
func appendScalar(b []byte, k fastKind, p unsafe.Pointer) []byte {
	switch k {
	case fkBool:
		if *(*bool)(p) {
			return append(b, 0xc3)
		}
		return append(b, 0xc2)
	case fkInt:
		return appendInt(b, int64(*(*int)(p)))
	case fkInt8:
		return append(b, 0xd0, byte(*(*int8)(p)))
	case fkInt16:
		return binary.BigEndian.AppendUint16(append(b, 0xd1), uint16(*(*int16)(p)))
	case fkInt32:
		return binary.BigEndian.AppendUint32(append(b, 0xd2), uint32(*(*int32)(p)))
	case fkInt64:
		return binary.BigEndian.AppendUint64(append(b, 0xd3), uint64(*(*int64)(p)))
	case fkUint:
		return appendUint(b, uint64(*(*uint)(p)))
	case fkUint8:
		return append(b, 0xcc, *(*uint8)(p))
	case fkUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xcd), *(*uint16)(p))
	case fkUint32:
		return binary.BigEndian.AppendUint32(append(b, 0xce), *(*uint32)(p))
	case fkUint64:
		return binary.BigEndian.AppendUint64(append(b, 0xcf), *(*uint64)(p))
	case fkFloat32:
		return binary.BigEndian.AppendUint32(append(b, 0xca), math.Float32bits(*(*float32)(p)))
	case fkFloat64:
		return binary.BigEndian.AppendUint64(append(b, 0xcb), math.Float64bits(*(*float64)(p)))
	}
	panic("actor: fast codec: not a scalar")
}

// appendFast appends the value v describes at p.
func appendFast(b []byte, v *fastValue, p unsafe.Pointer) []byte {
	switch v.kind {
	case fkString:
		return appendString(b, *(*string)(p))
	case fkBytes:
		bs := *(*[]byte)(p)
		if bs == nil {
			return append(b, 0xc0)
		}
		return append(appendBinLen(b, len(bs)), bs...)
	case fkSlice:
		h := (*sliceHeader)(p)
		if h.data == nil {
			return append(b, 0xc0)
		}
		b = appendArrayLen(b, h.len)
		if v.elem == fkFloat64 {
			// Halo faces and the like: 9 bytes a value, written in
			// place rather than appended one by one.
			n := len(b)
			b = slices.Grow(b, 9*h.len)[:n+9*h.len]
			out := b[n:]
			for i, f := range unsafe.Slice((*float64)(h.data), h.len) {
				o := out[9*i : 9*i+9]
				o[0] = 0xcb
				binary.BigEndian.PutUint64(o[1:], math.Float64bits(f))
			}
			return b
		}
		for i := 0; i < h.len; i++ {
			b = appendScalar(b, v.elem, unsafe.Add(h.data, uintptr(i)*v.esize))
		}
		return b
	}
	return appendScalar(b, v.kind, p)
}

// appendBinLen appends a msgpack bin header (msgpack's EncodeBytesLen).
func appendBinLen(b []byte, n int) []byte {
	switch {
	case n < 256:
		return append(b, 0xc4, byte(n))
	case n <= math.MaxUint16:
		return append(b, 0xc5, byte(n>>8), byte(n))
	default:
		return append(b, 0xc6, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	}
}

type sliceHeader struct {
	data unsafe.Pointer
	len  int
	cap  int
}

// fastReader reads what appendBody writes. Any surprise sets bad; the
// caller then leaves the body to msgpack.
type fastReader struct {
	b     []byte
	off   int
	bad   bool
	depth int // anyValues the body is nested in (maxAnyDepth)
}

func (r *fastReader) byte() byte {
	if r.off >= len(r.b) {
		r.bad = true
		return 0
	}
	c := r.b[r.off]
	r.off++
	return c
}

// take returns the next n bytes (aliasing the body), n checked against
// what is left.
func (r *fastReader) take(n int) []byte {
	if n < 0 || n > len(r.b)-r.off {
		r.bad = true
		return nil
	}
	p := r.b[r.off : r.off+n]
	r.off += n
	return p
}

func (r *fastReader) be(n int) uint64 {
	var v uint64
	for _, c := range r.take(n) {
		v = v<<8 | uint64(c)
	}
	return v
}

// int reads any msgpack integer that fits an int64.
func (r *fastReader) int() int64 {
	c := r.byte()
	switch {
	case c < 0x80 || c >= 0xe0:
		return int64(int8(c))
	case c == 0xcc:
		return int64(r.be(1))
	case c == 0xcd:
		return int64(r.be(2))
	case c == 0xce:
		return int64(r.be(4))
	case c == 0xcf:
		v := r.be(8)
		if v > math.MaxInt64 {
			r.bad = true
		}
		return int64(v)
	case c == 0xd0:
		return int64(int8(r.be(1)))
	case c == 0xd1:
		return int64(int16(r.be(2)))
	case c == 0xd2:
		return int64(int32(r.be(4)))
	case c == 0xd3:
		return int64(r.be(8))
	}
	r.bad = true
	return 0
}

// uint reads any non-negative msgpack integer in an unsigned form.
func (r *fastReader) uint() uint64 {
	c := r.byte()
	switch {
	case c < 0x80:
		return uint64(c)
	case c == 0xcc:
		return r.be(1)
	case c == 0xcd:
		return r.be(2)
	case c == 0xce:
		return r.be(4)
	case c == 0xcf:
		return r.be(8)
	}
	r.bad = true
	return 0
}

// float64s reads len(dst) msgpack float64 values (each 0xcb and 8 bytes)
// into dst in one pass.
func (r *fastReader) float64s(dst []float64) {
	if r.bad || 9*len(dst) > len(r.b)-r.off {
		r.bad = true
		return
	}
	src := r.b[r.off : r.off+9*len(dst)]
	for i := range dst {
		if len(src) < 9 || src[0] != 0xcb {
			r.bad = true
			return
		}
		dst[i] = math.Float64frombits(binary.BigEndian.Uint64(src[1:9]))
		src = src[9:]
	}
	r.off += 9 * len(dst)
}

// fixed reads a value written with type byte code and n bytes.
func (r *fastReader) fixed(code byte, n int) uint64 {
	if r.byte() != code {
		r.bad = true
		return 0
	}
	return r.be(n)
}

// binLen reads the length of a bin header whose first byte is c.
func (r *fastReader) binLen(c byte) int {
	switch c {
	case 0xc4:
		return int(r.be(1))
	case 0xc5:
		return int(r.be(2))
	case 0xc6:
		return int(r.be(4))
	}
	r.bad = true
	return 0
}

// strLen reads a string header.
func (r *fastReader) strLen() int {
	c := r.byte()
	switch {
	case c&0xe0 == 0xa0:
		return int(c & 0x1f)
	case c == 0xd9:
		return int(r.be(1))
	case c == 0xda:
		return int(r.be(2))
	case c == 0xdb:
		return int(r.be(4))
	}
	r.bad = true
	return 0
}

// scalar reads a scalar of kind k into p.
func (r *fastReader) scalar(k fastKind, p unsafe.Pointer) {
	switch k {
	case fkBool:
		switch r.byte() {
		case 0xc2:
			*(*bool)(p) = false
		case 0xc3:
			*(*bool)(p) = true
		default:
			r.bad = true
		}
	case fkInt:
		v := r.int()
		if int64(int(v)) != v {
			r.bad = true
		}
		*(*int)(p) = int(v)
	case fkInt8:
		*(*int8)(p) = int8(r.fixed(0xd0, 1))
	case fkInt16:
		*(*int16)(p) = int16(r.fixed(0xd1, 2))
	case fkInt32:
		*(*int32)(p) = int32(r.fixed(0xd2, 4))
	case fkInt64:
		*(*int64)(p) = int64(r.fixed(0xd3, 8))
	case fkUint:
		v := r.uint()
		if uint64(uint(v)) != v {
			r.bad = true
		}
		*(*uint)(p) = uint(v)
	case fkUint8:
		*(*uint8)(p) = uint8(r.fixed(0xcc, 1))
	case fkUint16:
		*(*uint16)(p) = uint16(r.fixed(0xcd, 2))
	case fkUint32:
		*(*uint32)(p) = uint32(r.fixed(0xce, 4))
	case fkUint64:
		*(*uint64)(p) = r.fixed(0xcf, 8)
	case fkFloat32:
		*(*float32)(p) = math.Float32frombits(uint32(r.fixed(0xca, 4)))
	case fkFloat64:
		*(*float64)(p) = math.Float64frombits(r.fixed(0xcb, 8))
	default:
		r.bad = true
	}
}

// value reads the value v describes into p (zeroed memory).
func (r *fastReader) value(v *fastValue, p unsafe.Pointer) {
	switch v.kind {
	case fkString:
		n := r.strLen()
		if s := r.take(n); !r.bad {
			*(*string)(p) = string(s)
		}
	case fkBytes:
		c := r.byte()
		if c == 0xc0 {
			return // nil
		}
		if v.payload {
			r.bad = true // the Payload field travels as the data
			return
		}
		n := r.binLen(c)
		if s := r.take(n); !r.bad {
			*(*[]byte)(p) = append(make([]byte, 0, n), s...)
		}
	case fkSlice:
		c := r.byte()
		var n int
		switch {
		case c == 0xc0:
			return // nil
		case c&0xf0 == 0x90:
			n = int(c & 0x0f)
		case c == 0xdc:
			n = int(r.be(2))
		case c == 0xdd:
			n = int(r.be(4))
		default:
			r.bad = true
			return
		}
		// Every element takes a byte at least: no allocation beyond the
		// frame's size.
		if r.bad || n > len(r.b)-r.off {
			r.bad = true
			return
		}
		s := reflect.MakeSlice(v.typ, n, n)
		data := s.UnsafePointer()
		if v.elem == fkFloat64 {
			r.float64s(unsafe.Slice((*float64)(data), n))
		} else {
			for i := 0; i < n && !r.bad; i++ {
				r.scalar(v.elem, unsafe.Add(data, uintptr(i)*v.esize))
			}
		}
		if !r.bad {
			reflect.NewAt(v.typ, p).Elem().Set(s)
		}
	case fkAny:
		r.anyValue((*anyValue)(p))
	case fkPID:
		r.pid((**pa.PID)(p))
	default:
		r.scalar(v.kind, p)
	}
}

// anyValue reads what appendAny writes. A type this rank does not know, or
// one without a fast plan, is left to msgpack (which reports the former).
func (r *fastReader) anyValue(a *anyValue) {
	c := r.byte()
	if c == 0xc0 {
		return // nil
	}
	if c != 0x93 {
		r.bad = true
		return
	}
	id := uint32(r.fixed(0xce, 4))
	var ptr bool
	switch r.byte() {
	case 0xc2:
	case 0xc3:
		ptr = true
	default:
		r.bad = true
	}
	body := r.take(r.binLen(r.byte()))
	if r.bad {
		return
	}
	ct := lookupID(id)
	if ct == nil || ct.fast == nil || nestable(ct) != nil || r.depth >= maxAnyDepth {
		r.bad = true // msgpack reports it
		return
	}
	v, ok := ct.fast.decode(ct, body, ptr, nil, r.depth+1)
	if !ok {
		r.bad = true
		return
	}
	a.V = v
}

// pid reads what appendPID writes: nil, or a map of a PID's three fields
// (in any order, each at most once).
func (r *fastReader) pid(dst **pa.PID) {
	c := r.byte()
	if c == 0xc0 {
		return // nil
	}
	if c&0xf0 != 0x80 || c&0x0f > 3 {
		r.bad = true
		return
	}
	pid := &pa.PID{}
	var seen [3]bool
	for i := 0; i < int(c&0x0f) && !r.bad; i++ {
		key := r.take(r.strLen())
		var k int
		switch string(key) {
		case "Address":
			k = 0
		case "Id":
			k = 1
		case "RequestId":
			k = 2
		default:
			r.bad = true
			return
		}
		if seen[k] {
			r.bad = true
			return
		}
		seen[k] = true
		switch k {
		case 0:
			pid.Address = string(r.take(r.strLen()))
		case 1:
			pid.Id = string(r.take(r.strLen()))
		default:
			pid.RequestId = uint32(r.fixed(0xce, 4))
		}
	}
	if !r.bad {
		*dst = pid
	}
}

// decode decodes body into a new value of ct's type, setting the Payload
// field to payload when it is not nil, or reports false.
func (fc *fastCodec) decode(ct *codecType, body []byte, ptr bool, payload []byte, depth int) (any, bool) {
	v := reflect.New(ct.typ)
	if !fc.decodeAt(v.UnsafePointer(), body, payload, depth) {
		return nil, false
	}
	if ptr {
		return v.Interface(), true
	}
	return v.Elem().Interface(), true
}

// decodeAt decodes body into the zero value of the codec's type at p,
// setting the Payload field to payload when it is not nil, or reports
// false (p then holds a partly decoded value).
func (fc *fastCodec) decodeAt(p unsafe.Pointer, body []byte, payload []byte, depth int) bool {
	r := &fastReader{b: body, depth: depth}
	if !fc.isStruct {
		r.value(&fc.value, p)
	} else {
		var n int
		switch c := r.byte(); {
		case c&0xf0 == 0x80:
			n = int(c & 0x0f)
		case c == 0xde:
			n = int(r.be(2))
		default:
			return false // not a map (or a huge one): msgpack decides
		}
		if n > len(fc.fields) {
			return false
		}
		var seen uint64
		for i := 0; i < n && !r.bad; i++ {
			j := fc.field(r, i)
			if j < 0 || seen&(1<<j) != 0 {
				// An unknown field, or one given twice: msgpack decides.
				return false
			}
			seen |= 1 << j
			f := &fc.fields[j]
			r.value(&f.fastValue, unsafe.Add(p, f.off))
		}
	}
	if r.bad || r.off != len(body) {
		return false
	}
	if fc.payload != ^uintptr(0) && payload != nil {
		*(*[]byte)(unsafe.Add(p, fc.payload)) = payload
	}
	return true
}

// field reads a key and returns the index of its field: the i-th when
// keys come in declaration order (as appendBody writes them), else the one
// of that name; -1 when there is none.
func (fc *fastCodec) field(r *fastReader, i int) int {
	key := r.take(r.strLen())
	if r.bad {
		return -1
	}
	if i < len(fc.fields) && fc.fields[i].name == string(key) {
		return i
	}
	for j := range fc.fields {
		if fc.fields[j].name == string(key) {
			return j
		}
	}
	return -1
}
