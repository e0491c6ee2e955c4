package actor

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
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
	proc atomic.Pointer[cachedProc] // nil until a delivery found it
}

// targetProc is what a delivery found about a target: its process and,
// for one of the runtime's actors, its record, whether it has a
// PostReceive hook and its mailbox (when it is the runtime's). Cached in
// the target, padded (cachedProc), while Runtime.localEpoch is still epoch.
type targetProc struct {
	proc  pa.Process
	found bool
	hook  bool        // la has a PostReceive hook
	la    *localActor // nil: not one of the runtime's actors
	mbox  *mailbox    // the actor's mailbox, when the runtime's; else nil
	epoch uint64
}

// cachedProc is a cached targetProc. The delivering goroutine reads it for
// every message: padded so that no other object, written on another core,
// shares its cache lines (small objects next to protoactor's process and
// the actor's record did, which cost a cache miss per message).
type cachedProc struct {
	_ [cacheLine]byte
	targetProc
	_ [cacheLine]byte
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
	var f rawEnvelope
	if !parseEnvelopeShort(b, &f) {
		if err := parseEnvelope(b, &f); err != nil {
			*e = envelope{}
			return err
		}
	}
	if reason := f.check(size); reason != "" {
		*e = envelope{}
		return &DecodeError{Offset: len(b), Reason: reason}
	}
	switch {
	case targets == nil:
		e.Target = string(f.target)
	case bytes.HasPrefix(f.target, []byte(requestPrefix)):
		// A reply to Request: its id is used once, not worth a cache
		// entry (the runtime finds its waiter by id).
		targets.last = nil
		e.Target = string(f.target)
	default:
		targets.last = targets.get(f.target)
		e.Target = targets.last.pid.Id
	}
	e.Sender = string(f.sender)
	e.Body = f.body
	e.Flags, e.Source, e.TargetReq, e.Type, e.PayloadLen = uint32(f.flags), int(f.src), uint32(f.treq), uint32(f.typ), int(f.plen)
	e.SenderRank = int(f.srank)
	return nil
}

// rawEnvelope is an envelope's fields as read from the wire, before the
// checks that relate them; the byte slices alias the header.
type rawEnvelope struct {
	flags, src, treq, typ, plen, srank uint64
	target, sender, body               []byte
}

// parseEnvelope reads the fields of an envelope in any valid encoding.
func parseEnvelope(b []byte, f *rawEnvelope) error {
	r := &wireReader{b: b}
	if n := r.arrayLen(); r.err == nil && n != envelopeFields {
		r.fail("envelope has %d fields, want %d", n, envelopeFields)
	}
	if v := r.uint(); r.err == nil && v != wireVersion {
		r.fail("protocol version %d, want %d", v, wireVersion)
	}
	f.flags = r.uint()
	f.src = r.uint()
	f.target = r.stringRaw()
	f.treq = r.uint()
	f.sender = r.stringRaw()
	f.typ = r.uint()
	f.plen = r.uint()
	f.srank = r.uint()
	f.body = r.bin()
	r.end()
	return r.err
}

// parseEnvelopeShort reads the envelope nearly every message has (ranks,
// flags, request id and sender rank under 128, ids under 32 bytes, a type
// id above 0xffff, a body under 256 bytes or none) without the general
// reader. It reports false, having read nothing reliable, when some field
// has another form: parseEnvelope decides then. What it accepts,
// parseEnvelope reads identically (FuzzEnvelopeShort checks).
func parseEnvelopeShort(b []byte, f *rawEnvelope) bool {
	// Array, version, flags, source, target's type byte.
	if len(b) < 5 || b[0] != 0x90|envelopeFields || b[1] != wireVersion || b[2] >= 0x80 || b[3] >= 0x80 || b[4]&0xe0 != 0xa0 {
		return false
	}
	f.flags, f.src = uint64(b[2]), uint64(b[3])
	i, n := 5, int(b[4]&0x1f)
	// Target, request id, sender's type byte.
	if len(b)-i < n+2 || b[i+n] >= 0x80 || b[i+n+1]&0xe0 != 0xa0 {
		return false
	}
	f.target, f.treq = b[i:i+n:i+n], uint64(b[i+n])
	i, n = i+n+2, int(b[i+n+1]&0x1f)
	// Sender, type id (0xce and 4 bytes), then the payload length's type
	// byte.
	if len(b)-i < n+6 || b[i+n] != 0xce {
		return false
	}
	f.sender = b[i : i+n : i+n]
	i += n
	if f.typ = uint64(binary.BigEndian.Uint32(b[i+1:])); f.typ <= math.MaxUint16 {
		return false
	}
	i += 5
	switch c := b[i]; {
	case c < 0x80:
		f.plen = uint64(c)
		i++
	case c == 0xcc && len(b)-i >= 2:
		if f.plen = uint64(b[i+1]); f.plen < 0x80 {
			return false
		}
		i += 2
	case c == 0xcd && len(b)-i >= 3:
		if f.plen = uint64(binary.BigEndian.Uint16(b[i+1:])); f.plen <= math.MaxUint8 {
			return false
		}
		i += 3
	case c == 0xce && len(b)-i >= 5:
		if f.plen = uint64(binary.BigEndian.Uint32(b[i+1:])); f.plen <= math.MaxUint16 {
			return false
		}
		i += 5
	default:
		return false
	}
	// Sender rank, then the body: nil, or bin 8.
	if len(b)-i < 2 || b[i] >= 0x80 {
		return false
	}
	f.srank = uint64(b[i])
	i++
	switch b[i] {
	case 0xc0:
		f.body = nil
		i++
	case 0xc4:
		if len(b)-i < 2 {
			return false
		}
		n, i = int(b[i+1]), i+2
		if len(b)-i < n {
			return false
		}
		f.body = b[i : i+n : i+n]
		i += n
	default:
		return false
	}
	return i == len(b)
}

// check relates the fields to each other and to the job's size: the
// reason they are invalid, or "".
func (f *rawEnvelope) check(size int) string {
	switch {
	case f.flags >= 1<<7:
		return fmt.Sprintf("unknown flags 0x%x", f.flags)
	case f.flags&(flagTypedXfer|flagDeviceIPC|flagDevicePair) != 0 && f.flags&flagBodyHdr == 0:
		return "typed-transfer or device flag without the body-in-header flag"
	case bits.OnesCount64(f.flags&(flagTypedXfer|flagDeviceIPC|flagDevicePair)) > 1:
		return "more than one of the typed-transfer, device IPC and device pair flags"
	case f.src >= uint64(size) || f.srank >= uint64(size):
		return fmt.Sprintf("source rank %d or sender rank %d outside a job of %d", f.src, f.srank, size)
	case f.treq > 0xffffffff || f.typ > 0xffffffff:
		return "request or type id out of range"
	case f.plen > 1<<40:
		return fmt.Sprintf("payload length %d out of range", f.plen)
	case f.flags&flagBodyHdr == 0 && (f.body != nil || f.plen != 0):
		return "body or payload length without the body-in-header flag"
	}
	return ""
}

// DecodeError reports malformed wire data.
type DecodeError struct {
	Offset int    // byte offset where decoding failed
	Reason string // what was wrong
}

func (e *DecodeError) Error() string {
	return fmt.Sprintf("actor: malformed message at byte %d: %s", e.Offset, e.Reason)
}
