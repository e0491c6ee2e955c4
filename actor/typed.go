package actor

import (
	"encoding/binary"
	"fmt"
	"reflect"

	"github.com/troupe-hpc/troupe/datatype"
)

// Typed is a noncontiguous message field: Count elements of the derived
// datatype Type, the first one's origin at byte Base of Buf (MPI's buffer,
// count and datatype). A message type may have one Typed field (or one
// Payload, or one gpu.Buffer), at the top level of its struct.
//
// Nothing of it enters the msgpack body. The sender packs the elements
// (host-pack scheme: datatype.Pack into one contiguous buffer) and sends
// them as the active message's data, after their type signature; large
// data moves by rendezvous or, between processes of one host, by
// cross-memory attach. The receiving rank lands the bytes in pooled memory
// and unpacks them into the Typed its target actor's PostReceiveTyped hook
// returns, which must have the sender's type signature; the message's field
// is then that Typed. Without the hook the field holds the packed stream as
// contiguous bytes (Type datatype.Byte, Base 0, Count its length), which
// the actor may unpack with any type of the same signature. The other
// noncontiguous schemes (SGL, zero-copy windows, adaptive) exist on the
// tagged API (transport.SendTyped) only.
type Typed struct {
	Buf   []byte
	Type  *datatype.Type
	Base  int64
	Count int64
}

// TypedPostReceiver is implemented by actors that choose where a message's
// Typed field is unpacked. It runs once the packed bytes are in: on the
// runtime's progress goroutine (see PostReceiver), or, for a message whose
// data the overlap engine deferred (docs/overlap.md, section 7), on the
// actor's own goroutine just before its Receive. Returning a Typed with a
// nil Type keeps the packed bytes.
type TypedPostReceiver interface {
	PostReceiveTyped(in *Incoming) Typed
}

var typedType = reflect.TypeFor[Typed]()

// typedSigSize is the signature that precedes a Typed field's packed bytes:
// elements (8) and hash (16).
const typedSigSize = 24

// packTyped packs a Typed field's elements behind their type signature.
func packTyped(f reflect.Value) ([]byte, error) {
	t := f.Interface().(Typed)
	if t.Type == nil {
		if t.Count != 0 || len(t.Buf) != 0 {
			return nil, fmt.Errorf("a Typed field with data but no Type")
		}
		return nil, nil
	}
	sig, err := t.Type.SignatureHash(t.Count)
	if err != nil {
		return nil, fmt.Errorf("Typed field: %w", err)
	}
	n, err := t.Type.PackedSize(t.Count)
	if err != nil {
		return nil, fmt.Errorf("Typed field: %w", err)
	}
	out := make([]byte, typedSigSize+n)
	putSignature(out, sig)
	if _, err := t.Type.Pack(out[typedSigSize:], t.Buf, t.Base, t.Count); err != nil {
		return nil, fmt.Errorf("packing a Typed field: %w", err)
	}
	return out, nil
}

func putSignature(b []byte, s datatype.Signature) {
	binary.LittleEndian.PutUint64(b[0:], uint64(s.Elements))
	binary.LittleEndian.PutUint64(b[8:], s.Hash[0])
	binary.LittleEndian.PutUint64(b[16:], s.Hash[1])
}

func getSignature(b []byte) datatype.Signature {
	return datatype.Signature{
		Elements: int64(binary.LittleEndian.Uint64(b[0:])),
		Hash:     [2]uint64{binary.LittleEndian.Uint64(b[8:]), binary.LittleEndian.Uint64(b[16:])},
	}
}

// typedLanding unpacks a landed Typed field (signature and packed bytes, in
// pooled memory) where the target actor's hook says, or copies the packed
// bytes out, and returns the field's value.
func (rt *Runtime) typedLanding(it *inItem, data []byte) (Typed, error) {
	if len(data) == 0 {
		return Typed{}, nil // the sender's field was empty
	}
	if len(data) < typedSigSize {
		return Typed{}, fmt.Errorf("Typed field of %d bytes, shorter than its signature", len(data))
	}
	sig, packed := getSignature(data), data[typedSigSize:]
	var dst Typed
	if la, ok := rt.local.Load(it.e.Target); ok {
		if h, ok := la.(*localActor).actor.(TypedPostReceiver); ok {
			in := &Incoming{Target: rt.PID(rt.rank, it.e.Target), Size: len(packed)}
			if it.e.Sender != "" {
				in.Sender = rt.PID(it.e.SenderRank, it.e.Sender)
			}
			if ct := lookupID(it.e.Type); ct != nil {
				in.Type = ct.name
			}
			dst = h.PostReceiveTyped(in)
		}
	}
	if dst.Type == nil {
		return Typed{Buf: append([]byte(nil), packed...), Type: datatype.Byte, Count: int64(len(packed))}, nil
	}
	want, err := dst.Type.SignatureHash(dst.Count)
	if err != nil {
		return Typed{}, fmt.Errorf("PostReceiveTyped: %w", err)
	}
	if want != sig {
		return Typed{}, fmt.Errorf("type signature mismatch: the sender's is %v, PostReceiveTyped's %v", sig, want)
	}
	if _, err := dst.Type.Unpack(dst.Buf, packed, dst.Base, dst.Count); err != nil {
		return Typed{}, fmt.Errorf("unpacking into PostReceiveTyped's buffer: %w", err)
	}
	rt.stats.TypedUnpacked.Add(1)
	return dst, nil
}

// decodeTyped decodes a message with a Typed field around its landed data.
func (rt *Runtime) decodeTyped(it *inItem, ct *codecType, data []byte) {
	defer putBuf(data)
	it.ready = true
	if it.err != "" {
		return
	}
	field, err := rt.typedLanding(it, data)
	if err != nil {
		it.err = "Typed field: " + err.Error()
		return
	}
	msg, err := decodeBody(ct, it.e.Body, it.e.Flags&flagPointer != 0, nil)
	if err != nil {
		rt.stats.DecodeErrors.Add(1)
		it.err = err.Error()
		return
	}
	v := reflect.ValueOf(msg)
	if v.Kind() == reflect.Pointer {
		v.Elem().Field(ct.typed).Set(reflect.ValueOf(field))
	} else {
		c := reflect.New(ct.typ).Elem()
		c.Set(v)
		c.Field(ct.typed).Set(reflect.ValueOf(field))
		msg = c.Interface()
	}
	it.msg = msg
}
