package actor

import (
	"fmt"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/troupe-hpc/troupe/gpu"
)

// anyValue carries a value of any registered type inside another message:
// on the wire it is the value's type id, pointer flag and encoded body.
type anyValue struct {
	V any
}

var (
	_ msgpack.CustomEncoder = anyValue{}
	_ msgpack.CustomDecoder = (*anyValue)(nil)
)

// nestable refuses a type whose values cannot travel nested in another
// message (a Broadcast's value, a field of type any): its Payload,
// gpu.Buffer or Typed field travels beside the body, which a nested value
// has not (the field arrived empty, silently, before 2026-11-25).
func nestable(ct *codecType) error {
	switch {
	case ct.payload >= 0:
		return fmt.Errorf("actor: %s has a Payload field and cannot be nested in another message", ct.name)
	case ct.device >= 0:
		return fmt.Errorf("actor: %s has a gpu.Buffer field and cannot be nested in another message", ct.name)
	case ct.typed >= 0:
		return fmt.Errorf("actor: %s has a Typed field and cannot be nested in another message", ct.name)
	}
	return nil
}

// EncodeMsgpack implements msgpack.CustomEncoder.
func (a anyValue) EncodeMsgpack(enc *msgpack.Encoder) error {
	if a.V == nil {
		return enc.EncodeNil()
	}
	ct, ptr, err := lookupType(a.V)
	if err != nil {
		return err
	}
	if err := nestable(ct); err != nil {
		return err
	}
	body, _, err := encodeBody(ct, a.V)
	if err != nil {
		return err
	}
	if err := enc.EncodeArrayLen(3); err != nil {
		return err
	}
	if err := enc.EncodeUint32(ct.id); err != nil {
		return err
	}
	if err := enc.EncodeBool(ptr); err != nil {
		return err
	}
	return enc.EncodeBytes(body)
}

// DecodeMsgpack implements msgpack.CustomDecoder.
func (a *anyValue) DecodeMsgpack(dec *msgpack.Decoder) error {
	n, err := dec.DecodeArrayLen()
	if err != nil {
		return err
	}
	if n == -1 {
		a.V = nil
		return nil
	}
	if n != 3 {
		return &DecodeError{Reason: fmt.Sprintf("nested value has %d fields, want 3", n)}
	}
	id, err := dec.DecodeUint32()
	if err != nil {
		return err
	}
	ptr, err := dec.DecodeBool()
	if err != nil {
		return err
	}
	body, err := dec.DecodeBytes()
	if err != nil {
		return err
	}
	ct := lookupID(id)
	if ct == nil {
		return &DecodeError{Reason: fmt.Sprintf("nested value of unknown type id 0x%08x", id)}
	}
	if err := nestable(ct); err != nil {
		return &DecodeError{Reason: "nested value: " + err.Error()}
	}
	depth := 0
	if br, ok := dec.Buffered().(*bodyReader); ok {
		depth = br.depth
	}
	if depth >= maxAnyDepth {
		return &DecodeError{Reason: fmt.Sprintf("values of type any nested more than %d deep", maxAnyDepth)}
	}
	a.V, err = decodeBodyDepth(ct, body, ptr, nil, gpu.Buffer{}, depth+1)
	return err
}
