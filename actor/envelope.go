package actor

import (
	"bytes"
	"fmt"
	"math/bits"
	"sync/atomic"

	pa "github.com/asynkron/protoactor-go/actor"
)

// wireVersion is the envelope protocol version.
const wireVersion = 1

// Envelope flags.
const (
	flagPointer    = 1 << iota // the body was sent as *T (else T)
	flagSystem                 // a system message (watch, unwatch, terminated, stop)
	flagBodyHdr                // the body travels in the header; the AM data is the payload
	flagNoCredit               // runtime traffic that bypasses eager credits
	flagTypedXfer              // with flagBodyHdr: the Typed field follows by the typed-transfer protocol, PayloadLen packed bytes
	flagDeviceIPC              // with flagBodyHdr: the gpu.Buffer field's PayloadLen bytes are copied by CUDA IPC; the data is its descriptor (device_ipc.go)
	flagDevicePair             // with flagBodyHdr: the gpu.Buffer field's PayloadLen bytes follow on the pair channel; no data (device_pair.go)
)

// envelope is the header of every actor message on the wire (DESIGN 5.1):
// a msgpack array of version, flags, source rank, target actor id, target
// request id, sender actor id ("" for none), message type id, out-of-band
// payload length, sender rank and, when flagBodyHdr is set, the body.
type envelope struct {
	Flags      uint32
	Source     int    // sending rank
	Target     string // target actor id on the receiving rank
	TargetReq  uint32 // the target PID's request id
	SenderRank int    // rank of the sender actor (usually Source)
	Sender     string // sender actor id ("" = none)
	Type       uint32 // registered type id
	PayloadLen int    // bytes of out-of-band payload (AM data) when flagBodyHdr
	Body       []byte // the body, when flagBodyHdr
}

const envelopeFields = 10

// maxEnvelope bounds a header we accept; real ones are far smaller.
const maxEnvelope = 64 << 10

// appendEnvelope appends e's wire form to b.
func appendEnvelope(b []byte, e *envelope) []byte {
	b = appendArrayLen(b, envelopeFields)
	b = appendUint(b, wireVersion)
	b = appendUint(b, uint64(e.Flags))
	b = appendUint(b, uint64(e.Source))
	b = appendString(b, e.Target)
	b = appendUint(b, uint64(e.TargetReq))
	b = appendString(b, e.Sender)
	b = appendUint(b, uint64(e.Type))
	b = appendUint(b, uint64(e.PayloadLen))
	b = appendUint(b, uint64(e.SenderRank))
	if e.Flags&flagBodyHdr != 0 {
		b = appendBin(b, e.Body)
	} else {
		b = append(b, 0xc0)
	}
	return b
}

// decodeEnvelope parses a header. The body aliases b. size is the number
// of ranks, to check the source. Every failure is a *DecodeError.
func decodeEnvelope(b []byte, size int) (envelope, error) {
	var e envelope
	err := decodeEnvelopeInto(&e, b, size, nil)
	return e, err
}

// targetCache keeps the PIDs of the local actors messages were sent to,
// so that a message to a known target allocates neither its id nor its
// PID, and the target's process, so that it is not looked up by name for
// every message. Only the goroutine delivering active messages uses the
// map; entries are shared with the items it decodes.
type targetCache struct {
	addr string
	m    map[string]*target
	last *target // the target decodeEnvelopeInto saw last
}

// target is a targetCache entry.
type target struct {
	pid  *pa.PID
	proc atomic.Pointer[targetProc] // nil until a delivery found it
}

// targetProc is what a delivery found about a target: its process and,
// for one of the runtime's actors, its record. Cached in the target while
// Runtime.localEpoch is still epoch.
type targetProc struct {
	proc  pa.Process
	found bool
	la    *localActor // nil: not one of the runtime's actors
	epoch uint64
}

// maxTargets bounds targetCache: it starts over when full.
const maxTargets = 4096

// maxTargetLen is the longest actor id targetCache keeps.
const maxTargetLen = 64

func (c *targetCache) get(raw []byte) *target {
	if c.last != nil && string(raw) == c.last.pid.Id {
		return c.last // the common case: messages to one actor in a row
	}
	if t, ok := c.m[string(raw)]; ok {
		return t
	}
	t := &target{pid: pa.NewPID(c.addr, string(raw))}
	if len(raw) > maxTargetLen {
		return t
	}
	if len(c.m) >= maxTargets {
		clear(c.m)
	}
	c.m[t.pid.Id] = t
	return t
}

// decodeEnvelopeInto is decodeEnvelope into *e; with targets set, the
// target id comes from (and goes into) that cache, and targets.last is its
// PID (nil for a reply to Request).
func decodeEnvelopeInto(e *envelope, b []byte, size int, targets *targetCache) error {
	if len(b) > maxEnvelope {
		return &DecodeError{Reason: fmt.Sprintf("envelope of %d bytes exceeds %d", len(b), maxEnvelope)}
	}
	r := &wireReader{b: b}
	if n := r.arrayLen(); r.err == nil && n != envelopeFields {
		r.fail("envelope has %d fields, want %d", n, envelopeFields)
	}
	if v := r.uint(); r.err == nil && v != wireVersion {
		r.fail("protocol version %d, want %d", v, wireVersion)
	}
	flags := r.uint()
	src := r.uint()
	if targets != nil {
		if raw := r.stringRaw(); r.err == nil && bytes.HasPrefix(raw, []byte(requestPrefix)) {
			// A reply to Request: its id is used once, not worth a cache
			// entry (the runtime finds its waiter by id).
			targets.last = nil
			e.Target = string(raw)
		} else if r.err == nil {
			targets.last = targets.get(raw)
			e.Target = targets.last.pid.Id
		}
	} else {
		e.Target = r.string()
	}
	treq := r.uint()
	e.Sender = r.string()
	typ := r.uint()
	plen := r.uint()
	srank := r.uint()
	e.Body = r.bin()
	r.end()
	switch {
	case r.err != nil:
	case flags >= 1<<7:
		r.fail("unknown flags 0x%x", flags)
	case flags&(flagTypedXfer|flagDeviceIPC|flagDevicePair) != 0 && flags&flagBodyHdr == 0:
		r.fail("typed-transfer or device flag without the body-in-header flag")
	case bits.OnesCount64(flags&(flagTypedXfer|flagDeviceIPC|flagDevicePair)) > 1:
		r.fail("more than one of the typed-transfer, device IPC and device pair flags")
	case src >= uint64(size) || srank >= uint64(size):
		r.fail("source rank %d or sender rank %d outside a job of %d", src, srank, size)
	case treq > 0xffffffff || typ > 0xffffffff:
		r.fail("request or type id out of range")
	case plen > 1<<40:
		r.fail("payload length %d out of range", plen)
	case flags&flagBodyHdr == 0 && (e.Body != nil || plen != 0):
		r.fail("body or payload length without the body-in-header flag")
	}
	if r.err != nil {
		*e = envelope{}
		return r.err
	}
	e.Flags, e.Source, e.TargetReq, e.Type, e.PayloadLen = uint32(flags), int(src), uint32(treq), uint32(typ), int(plen)
	e.SenderRank = int(srank)
	return nil
}

// DecodeError reports malformed wire data.
type DecodeError struct {
	Offset int    // byte offset where decoding failed
	Reason string // what was wrong
}

func (e *DecodeError) Error() string {
	return fmt.Sprintf("actor: malformed message at byte %d: %s", e.Offset, e.Reason)
}
