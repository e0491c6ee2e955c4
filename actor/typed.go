package actor

import (
	"encoding/binary"
	"fmt"
	"reflect"

	"go.uber.org/zap"

	"github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/transport"
)

// Typed is a noncontiguous message field: Count elements of the derived
// datatype Type, the first one's origin at byte Base of Buf (MPI's buffer,
// count and datatype). A message type may have one Typed field (or one
// Payload, or one gpu.Buffer), at the top level of its struct.
//
// Nothing of it enters the msgpack body. A field of fewer packed bytes than
// Options.TypedDirectMin (default 32 KiB to a rank in another process of
// the same host reached by cross-memory attach, 256 KiB to others) is packed
// at the sender (datatype.Pack) behind its type signature and travels as
// the active message's data; the receiving rank unpacks it. A larger one follows the
// message by the transport's typed-transfer protocol (docs/noncontig.md):
// pipelined pack, scatter-gather lists or zero-copy windows, chosen per
// layout by the adaptive scheme (or Options.TypedScheme), straight between
// the sender's and the receiver's layouts. Either way Send returns once
// the elements have been read, so Buf may be reused; by the protocol that
// means Send waits for the receiving rank to take them (which it does as
// the message arrives, not when the actor runs).
//
// The receiving actor's PostReceiveTyped hook names the Typed the field
// lands in, which must have the sender's type signature (a different
// layout of it is fine: a column of a grid of another width, say); the
// message's field is then that Typed. Without the hook the field holds
// the packed stream as contiguous bytes (Type datatype.Byte, Base 0, Count
// its length), which the actor may unpack with any type of the same
// signature. A signature mismatch makes the message undeliverable; by the
// protocol the sender's Send fails too (transport.ErrTypeMismatch, or the
// receiver's refusal for a hook's layout longer than the field).
//
// The elements may lie in device memory instead: Dev (any memory kind) in
// place of Buf, the first element's origin at byte Base of Dev. The sender
// packs them into pinned host memory (on the device by gpupack's kernels)
// inside Send, and the packed bytes travel as above; a hook that names a
// Typed with Dev has them unpacked into that device memory before the
// actor runs (staged through pinned memory, unpacked by the kernels). The
// device data must be complete when Send is called. A Typed with both Buf
// and Dev is refused.
type Typed struct {
	Buf   []byte
	Dev   gpu.Buffer
	Type  *datatype.Type
	Base  int64
	Count int64
}

// onDevice reports whether the field's elements are in Dev.
func (t Typed) onDevice() bool { return !t.Dev.IsZero() }

// checkTyped refuses a Typed with both kinds of memory.
func checkTyped(t Typed) error {
	if t.onDevice() && t.Buf != nil {
		return fmt.Errorf("a Typed field with both Buf and Dev")
	}
	return nil
}

// typedFieldOf returns msg's struct value (through the pointer when ptr)
// and its Typed field; ct must have one.
func typedFieldOf(ct *codecType, msg any, ptr bool) (reflect.Value, Typed) {
	v := reflect.ValueOf(msg)
	if ptr {
		v = v.Elem()
	}
	return v, v.Field(ct.typed).Interface().(Typed)
}

// withTyped returns a copy of the message value v with its Typed field set
// to f, as a *T when ptr, else as a T.
func withTyped(ct *codecType, v reflect.Value, ptr bool, f Typed) any {
	c := reflect.New(ct.typ)
	c.Elem().Set(v)
	c.Elem().Field(ct.typed).Set(reflect.ValueOf(f))
	if ptr {
		return c.Interface()
	}
	return c.Elem().Interface()
}

// checkDeviceTyped checks a device Typed field of msg as Send would (a
// type, one kind of memory, a layout inside a live Dev) and returns msg
// with the field zeroed, for Check to encode the rest: Send packs the
// field through a stage, which Check has no transport for. Any other msg
// comes back as it is.
func checkDeviceTyped(ct *codecType, msg any) (any, error) {
	if ct.typed < 0 {
		return msg, nil
	}
	ptr := reflect.ValueOf(msg).Kind() == reflect.Pointer
	v, f := typedFieldOf(ct, msg, ptr)
	if !f.onDevice() {
		return msg, nil
	}
	fail := func(err error) (any, error) {
		return nil, fmt.Errorf("actor: %s: device Typed field: %w", ct.name, err)
	}
	if err := checkTyped(f); err != nil {
		return fail(err)
	}
	if f.Type == nil {
		return fail(fmt.Errorf("no Type"))
	}
	if f.Dev.Freed() {
		return fail(gpu.ErrFreed)
	}
	lo, hi, err := f.Type.DataBounds(f.Count)
	if err != nil {
		return fail(err)
	}
	if n, _ := f.Type.PackedSize(f.Count); n > 0 && (f.Base < 0 || f.Base+lo < 0 || f.Base+hi > int64(f.Dev.Len())) {
		return fail(fmt.Errorf("layout touches bytes [%d, %d) of a %d-byte buffer", f.Base+lo, f.Base+hi, f.Dev.Len()))
	}
	return withTyped(ct, v, ptr, Typed{}), nil
}

// stageTyped stages a device Typed field and returns msg with the field
// replaced by the stage's bytes as elements of the layout's packed twin
// (same type signature, so the receiver sees no difference), and the
// stage, not yet packed: the caller packs it (a field packed into the
// message) or hands it to the typed transfer, which packs it piece by
// piece as it goes, and releases it once the message and its field are
// sent. A message whose Typed field is in host memory comes back
// unchanged, with a nil stage.
func (rt *Runtime) stageTyped(ct *codecType, msg any, ptr bool) (any, *transport.TypedStage, error) {
	if ct.typed < 0 {
		return msg, nil, nil
	}
	v, f := typedFieldOf(ct, msg, ptr)
	if err := checkTyped(f); err != nil {
		return nil, nil, fmt.Errorf("actor: %s: %w", ct.name, err)
	}
	if !f.onDevice() || f.Type == nil {
		return msg, nil, nil
	}
	st, err := rt.t.StageTyped(f.Dev, f.Type, f.Base, f.Count)
	if err != nil {
		return nil, nil, fmt.Errorf("actor: %s: device Typed field: %w", ct.name, err)
	}
	rt.stats.TypedDevicePacked.Add(1)
	return withTyped(ct, v, ptr, Typed{Buf: st.Bytes, Type: st.Twin, Count: st.Count}), st, nil
}

// TypedPostReceiver is implemented by actors that choose where a message's
// Typed field lands. It runs on the runtime's progress goroutine (see
// PostReceiver): once the packed bytes are in, or, for a field that goes
// by the typed-transfer protocol, when the message arrives, before its
// elements move. For a packed field whose data the overlap engine deferred
// (docs/overlap.md, section 7) it runs on the actor's own goroutine just
// before its Receive. Returning a Typed with a nil Type keeps the packed
// bytes.
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
		if t.Count != 0 || len(t.Buf) != 0 || t.onDevice() {
			return nil, fmt.Errorf("a Typed field with data but no Type")
		}
		return nil, nil
	}
	if t.onDevice() {
		// stageTyped replaces device fields before the body is encoded.
		return nil, fmt.Errorf("a device Typed field that was not staged")
	}
	sig, err := t.Type.SignatureHash(t.Count)
	if err != nil {
		return nil, fmt.Errorf("Typed field: %w", err)
	}
	n, err := t.Type.PackedSize(t.Count)
	if err != nil {
		return nil, fmt.Errorf("Typed field: %w", err)
	}
	out := getBuf(typedSigSize + int(n)) // post returns it to the pool (codecType.stagesPayload)
	putSignature(out, sig)
	if _, err := t.Type.Pack(out[typedSigSize:], t.Buf, t.Base, t.Count); err != nil {
		putBuf(out)
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

// typedHook asks the target actor's PostReceiveTyped hook where a Typed
// field of size packed bytes goes; a nil Type means it named nothing.
func (rt *Runtime) typedHook(it *inItem, size int) Typed {
	la, ok := rt.local.Load(it.e.Target)
	if !ok {
		return Typed{}
	}
	h, ok := la.(*localActor).actor.(TypedPostReceiver)
	if !ok {
		return Typed{}
	}
	in := &Incoming{Target: rt.PID(rt.rank, it.e.Target), Size: size}
	if it.e.Sender != "" {
		in.Sender = rt.PID(it.e.SenderRank, it.e.Sender)
	}
	if ct := lookupID(it.e.Type); ct != nil {
		in.Type = ct.name
	}
	return h.PostReceiveTyped(in)
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
	dst := rt.typedHook(it, len(packed))
	if dst.Type == nil {
		return Typed{Buf: append([]byte(nil), packed...), Type: datatype.Byte, Count: int64(len(packed))}, nil
	}
	if err := checkTyped(dst); err != nil {
		return Typed{}, fmt.Errorf("PostReceiveTyped: %w", err)
	}
	want, err := dst.Type.SignatureHash(dst.Count)
	if err != nil {
		return Typed{}, fmt.Errorf("PostReceiveTyped: %w", err)
	}
	if want != sig {
		return Typed{}, fmt.Errorf("type signature mismatch: the sender's is %v, PostReceiveTyped's %v", sig, want)
	}
	if dst.onDevice() {
		if err := rt.unpackDevice(dst, packed); err != nil {
			return Typed{}, err
		}
	} else if _, err := dst.Type.Unpack(dst.Buf, packed, dst.Base, dst.Count); err != nil {
		return Typed{}, fmt.Errorf("unpacking into PostReceiveTyped's buffer: %w", err)
	}
	rt.stats.TypedUnpacked.Add(1)
	return dst, nil
}

// unpackDevice unpacks packed bytes into a device Typed field, through a
// stage.
func (rt *Runtime) unpackDevice(dst Typed, packed []byte) error {
	st, err := rt.t.StageTyped(dst.Dev, dst.Type, dst.Base, dst.Count)
	if err != nil {
		return fmt.Errorf("PostReceiveTyped's device layout: %w", err)
	}
	defer st.Release()
	if len(packed) != len(st.Bytes) {
		return fmt.Errorf("%d packed bytes for a device layout of %d", len(packed), len(st.Bytes))
	}
	copy(st.Bytes, packed)
	if err := st.Unpack(int64(len(packed))); err != nil {
		return fmt.Errorf("unpacking into PostReceiveTyped's device buffer: %w", err)
	}
	return nil
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
	rt.setTyped(it, ct, field)
}

// setTyped decodes it's body and sets its Typed field to field.
func (rt *Runtime) setTyped(it *inItem, ct *codecType, field Typed) {
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

// Large Typed fields (packed size >= Options.TypedDirectMin) do not travel
// in the active message. The sender sends the message with the field
// zeroed, flagged flagTypedXfer with the packed size in PayloadLen, and
// then the field's elements by the transport's typed-transfer protocol
// (TypedOptions.Runtime, tag 0), which picks pipelined pack, scatter-gather
// or zero-copy windows per layout (docs/noncontig.md). The receiving rank
// posts the matching typed receive when the message arrives, into the
// PostReceiveTyped hook's layout or, without one, a packed receive into
// fresh memory. Each side numbers these transfers per peer in message
// order, so no identifier travels: the sender sends a message and its
// transfer's RTS under one per-peer lock, and the receiver posts receives
// in arrival order.

// directTyped is a Typed field that goes by the typed-transfer protocol.
type directTyped struct {
	f     Typed
	bytes int64                 // packed size
	stage *transport.TypedStage // f is a device field's stage, packed as the transfer goes
}

// maxTypedLanding bounds the fresh memory a hook-less receive of a large
// Typed field allocates on the sender's word.
const maxTypedLanding = 1 << 34

// typedDirect returns the message's Typed field when it goes to rank r by
// the typed-transfer protocol, and msg with that field zeroed; otherwise nil
// and msg unchanged.
func (rt *Runtime) typedDirect(r int, ct *codecType, msg any, ptr bool) (*directTyped, any, error) {
	if ct.typed < 0 {
		return nil, msg, nil
	}
	v, f := typedFieldOf(ct, msg, ptr)
	if f.Type == nil {
		return nil, msg, nil
	}
	threshold := rt.typedMin.Load()
	if rt.t.CMAPeer(r) && !rt.t.SameProcess(r) {
		threshold = rt.typedMinCMA.Load()
	}
	n, err := f.Type.PackedSize(f.Count)
	if err != nil || n < threshold {
		return nil, msg, nil // packed into the message (packTyped reports errors)
	}
	if n > maxTypedLanding {
		return nil, nil, fmt.Errorf("actor: %s: Typed field of %d packed bytes, more than %d", ct.name, n, int64(maxTypedLanding))
	}
	lo, hi, err := f.Type.DataBounds(f.Count)
	switch {
	case err != nil:
		return nil, nil, fmt.Errorf("actor: %s: Typed field: %w", ct.name, err)
	case f.Base < 0 || f.Base+lo < 0 || f.Base+hi > int64(len(f.Buf)):
		return nil, nil, fmt.Errorf("actor: %s: Typed field: data at [%d, %d) relative to base %d outside a buffer of %d bytes",
			ct.name, lo, hi, f.Base, len(f.Buf))
	}
	return &directTyped{f: f, bytes: n}, withTyped(ct, v, ptr, Typed{}), nil
}

// typedOptions are the transport options of a Typed field's transfer.
func (rt *Runtime) typedOptions(base int64) transport.TypedOptions {
	return transport.TypedOptions{Base: int(base), Runtime: true, Scheme: datatype.Scheme(rt.typedScheme.Load())}
}

// receiveTyped posts the typed receive of a message whose Typed field
// follows by the typed-transfer protocol (it arrived eager, carrying no
// data), and delivers the message in its turn once the field is in. Every
// such message gets its receive, even one that cannot be delivered, so the
// sender's transfer completes and the sequence stays in step.
func (rt *Runtime) receiveTyped(in *inPeer, m *transport.AMMessage, it *inItem, ct *codecType) {
	it.e.Body = append([]byte(nil), it.e.Body...) // the header dies when we return
	n := it.e.PayloadLen
	switch {
	case m.Size != 0:
		it.err = fmt.Sprintf("typed-transfer message with %d bytes of data", m.Size)
	case n > maxTypedLanding:
		it.err = fmt.Sprintf("Typed field of %d bytes announced, more than %d", n, maxTypedLanding)
		rt.log.Warn("typed transfer refused", zap.Int("peer", it.e.Source), zap.Int("bytes", n))
	case ct == nil:
		it.err = fmt.Sprintf("unknown message type id 0x%08x (not registered on rank %d)", it.e.Type, rt.rank)
	case ct.typed < 0:
		it.err = fmt.Sprintf("typed transfer for %s, which has no Typed field", ct.name)
	}
	var dst Typed
	if it.err == "" {
		dst = rt.typedHook(it, n)
	}
	hooked := dst.Type != nil
	var xfer *transport.TypedTransfer
	var stage *transport.TypedStage // a device layout's staging memory
	if hooked {
		// The transfer accepts a message whose signature is a prefix of
		// the receive's (a smaller one it fails as a mismatch): a layout
		// of more packed bytes than announced has another signature too,
		// refused as the packed path refuses it.
		var err error
		if size, serr := dst.Type.PackedSize(dst.Count); serr == nil && size > int64(n) {
			err = fmt.Errorf("type signature mismatch: %d packed bytes announced, PostReceiveTyped's layout holds %d", n, size)
		} else if err = checkTyped(dst); err == nil && dst.onDevice() {
			// Into pinned memory as the layout's packed twin, each chunk
			// unpacked into the device as it lands.
			if stage, err = rt.t.StageTyped(dst.Dev, dst.Type, dst.Base, dst.Count); err == nil {
				o := rt.typedOptions(0)
				o.Stage = stage
				xfer, err = rt.t.PrepareRecvTyped(it.e.Source, 0, stage.Bytes, stage.Twin, int(stage.Count), o)
			}
		} else if err == nil {
			xfer, err = rt.t.PrepareRecvTyped(it.e.Source, 0, dst.Buf, dst.Type, int(dst.Count), rt.typedOptions(dst.Base))
		}
		if err != nil {
			it.err = "Typed field: PostReceiveTyped: " + err.Error()
			hooked = false
			if stage != nil {
				stage.Release()
				stage = nil
			}
		}
	}
	if xfer == nil {
		o := rt.typedOptions(0)
		if it.err != "" {
			// Undeliverable: the receive refuses the transfer, which keeps
			// the sequence in step and tells the sender, without landing
			// (or allocating) the bytes it announced.
			o.Refuse = true
		} else {
			// No hook (or a broken one): the packed stream, in fresh memory.
			dst = Typed{Buf: make([]byte, n), Type: datatype.Byte, Count: int64(n)}
			o.Packed = true
		}
		var err error
		xfer, err = rt.t.PrepareRecvTyped(it.e.Source, 0, dst.Buf, datatype.Byte, int(dst.Count), o)
		if err != nil {
			it.err = "receiving Typed field: " + err.Error()
			in.pushReady(it)
			return
		}
	}
	in.await(it, xfer.Run, func(st transport.Status, werr error) {
		it.ready = true
		if stage != nil {
			// The transfer has unpacked what came.
			stage.Release()
		}
		switch {
		case it.err != "":
		case werr != nil:
			it.err = "receiving Typed field: " + werr.Error()
		case st.Size != n:
			it.err = fmt.Sprintf("Typed field of %d bytes announced, %d arrived", n, st.Size)
		default:
			if hooked {
				rt.stats.TypedUnpacked.Add(1)
			}
			rt.stats.TypedReceived.Add(1)
			rt.setTyped(it, ct, dst)
		}
	})
}
