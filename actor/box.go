package actor

import (
	"reflect"
	"unsafe"

	pa "github.com/asynkron/protoactor-go/actor"
)

// Small messages in one allocation.
//
// A received message with a Payload needs three objects: the payload's
// bytes, the decoded value and protoactor's envelope. For a small payload
// the allocations cost more than everything else the delivering goroutine
// does with the message (a third of its time in a 64 B flood), so a
// message of a struct type registered with Register[T], with a fast codec
// and a payload of at most maxBoxed bytes, lands in one object instead: a
// msgBox holding the envelope, the value and the payload. The value's
// Payload and the envelope point into it and keep it alive together: a
// receiver that keeps the payload keeps the value and the envelope alive
// too (at most 32 bytes more than the value), never another message.

// maxBoxed is the largest payload a box holds.
const maxBoxed = 128

// msgBox is one received message's memory; A is the payload's array.
type msgBox[T, A any] struct {
	env pa.MessageEnvelope
	val T
	buf A
}

// boxer makes the boxes of one registered type. (Boxes travel as three
// results, not as a struct: copied through the stack, a struct of slices
// stalled on store forwarding.)
type boxer struct {
	// alloc[i] allocates a box with payload room 16 << i bytes and
	// returns its envelope, its zero value and its payload's room.
	alloc [4]func() (*pa.MessageEnvelope, unsafe.Pointer, []byte)
	// asAny returns the value in a box as the message: *T, or a copy of T.
	asAny func(v unsafe.Pointer, ptr bool) any
}

// boxerFor returns T's boxer, or nil when T is not a struct.
func boxerFor[T any]() *boxer {
	if reflect.TypeFor[T]().Kind() != reflect.Struct {
		return nil
	}
	return &boxer{
		alloc: [4]func() (*pa.MessageEnvelope, unsafe.Pointer, []byte){
			allocBox[T, [16]byte], allocBox[T, [32]byte], allocBox[T, [64]byte], allocBox[T, [128]byte],
		},
		asAny: func(v unsafe.Pointer, ptr bool) any {
			if ptr {
				return (*T)(v)
			}
			return *(*T)(v)
		},
	}
}

func allocBox[T, A any]() (*pa.MessageEnvelope, unsafe.Pointer, []byte) {
	b := new(msgBox[T, A])
	return &b.env, unsafe.Pointer(&b.val), unsafe.Slice((*byte)(unsafe.Pointer(&b.buf)), unsafe.Sizeof(b.buf))
}

// decodeBoxed lands eager message m's payload in a box and decodes the
// message into it; the box's envelope waits in the item for delivery. It
// reports false, having done nothing, when the message should not be
// boxed: its type has no boxer, its payload is too large, it has an error
// already, or its target has a PostReceive hook (which chooses where the
// payload lands).
func (rt *Runtime) decodeBoxed(it *inItem, ct *codecType, data []byte) bool {
	size := len(data)
	if ct == nil || ct.boxer == nil || size > maxBoxed || it.err != "" {
		return false
	}
	var tp targetProc
	if rt.localTarget(it.target, it.e.Target, &tp).hook {
		return false
	}
	i := 0
	for 16<<i < size {
		i++
	}
	env, val, buf := ct.boxer.alloc[i]()
	buf = buf[:size:size]
	copy(buf, data)
	it.env = env
	if ct.fast.decodeAt(val, it.e.Body, buf, 0) {
		it.msg, it.ready = ct.boxer.asAny(val, it.e.Flags&flagPointer != 0), true
		return true
	}
	// Not a form the fast codec reads: msgpack decides, as without a box.
	rt.decode(it, ct, it.e.Body, buf)
	return true
}
