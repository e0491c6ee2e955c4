package transport

import (
	"context"
	"encoding/binary"
	"fmt"
	"unsafe"

	"github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/transport/ucx"
)

// Tags of typed transfers (kind KindTyped). Two layouts, told apart by bit 59:
//
//	RTS:      kind(4) | 0 | source rank(24) | user tag(16) | sequence(19)
//	transfer: kind(4) | 1 | dir(1) | source rank(24) | transfer id(20) | index(14)
//
// The RTS carries the per-(source, user tag) sequence number, so typed
// messages match in send order exactly like the untyped API (trace-based
// matching). Everything after the RTS is addressed by the sender's transfer
// id: dir 0 flows sender to receiver (pack chunks, SGL chunks, the zero-copy
// completion), dir 1 receiver to sender (CTS, window keys, ACK). Indices wrap;
// messages with equal tags from one peer match in order, so wrapping is safe.
const (
	ncSeqBits  = 19
	ncSeqMask  = 1<<ncSeqBits - 1
	ncXidBits  = 20
	ncXidMask  = 1<<ncXidBits - 1
	ncIdxBits  = 14
	ncIdxMask  = 1<<ncIdxBits - 1
	ncRankMask = 1<<24 - 1

	dirData  = 0 // sender to receiver
	dirReply = 1 // receiver to sender

	idxCTS  = 0 // dirReply: clear to send
	idxKeys = 1 // dirReply: window keys following a CTS
	idxAck  = 2 // dirReply: final status of a pack transfer
	idxFin  = 0 // dirData: zero-copy completion
)

// ncRTSTag builds an RTS tag in space KindTyped (the MPI-style API) or
// KindDDT (runtimes' typed transfers, TypedOptions.Runtime).
func ncRTSTag(space Kind, src uint32, tag uint16, seq uint32) uint64 {
	return uint64(space)<<kindShift | uint64(src&ncRankMask)<<(UserTagBits+ncSeqBits) |
		uint64(tag)<<ncSeqBits | uint64(seq&ncSeqMask)
}

func ncXferTag(dir uint64, src uint32, xid uint32, idx uint32) uint64 {
	return uint64(KindTyped)<<kindShift | 1<<59 | dir<<58 | uint64(src&ncRankMask)<<(ncXidBits+ncIdxBits) |
		uint64(xid&ncXidMask)<<ncIdxBits | uint64(idx&ncIdxMask)
}

// ncDataTag and ncDataMask select the transfer messages that flow sender to
// receiver (dir 0): pack and SGL chunks and the zero-copy completion. With
// the overlap engine on, ovProbe takes them off UCX's queue like tagged
// messages, and their receives (ncRecv) are matched in the engine's table.
const (
	ncDataTag  = uint64(KindTyped)<<kindShift | 1<<59 | dirData<<58
	ncDataMask = uint64(0xf)<<kindShift | 1<<59 | 1<<58
)

// ncXferSource returns the sending rank and index of a transfer tag.
func ncXferSource(tag uint64) (src, idx int) {
	return int(tag >> (ncXidBits + ncIdxBits) & ncRankMask), int(tag & ncIdxMask)
}

// Wire messages, little endian.

const (
	ncVersion  = 2
	rtsHdrLen  = 72
	ctsLen     = 64
	finLen     = 8 // zero-copy completion: byte 0 is finOK or finFailed
	finOK      = 0
	finFailed  = 1        // the sender failed after the CTS (its error is its own)
	ncEagerMax = 32 << 10 // largest payload an RTS may carry inline

	rtsInline    = 1 // RTS flag: the packed payload follows the header
	rtsCrossover = 2 // RTS flag: the sender's layout is near T: the receiver may time pack against SGL
	ctsKeys      = 1 // CTS flag: a window-key message follows
	ctsVerdict   = 2 // CTS flag: the scheme is the layout pair's measured crossover verdict
)

// CTS/ACK status codes.
const (
	stOK       = 0
	stMismatch = 1 // type signatures differ
	stTooSmall = 2 // receive layout smaller than the message
	stFailed   = 3 // receiver failed otherwise
)

// rts is the request to send.
type rts struct {
	proposal datatype.Scheme
	flags    uint8
	xid      uint32
	bytes    int64
	sig      datatype.Signature
	minBlock int64
	segments int64
	chunk    int64 // sender's pack chunk
	// rtt is the sender's latest RTS-to-CTS round trip to this peer, in
	// nanoseconds (0: none yet): what every transfer that waits for a CTS
	// pays before its data moves (the crossover trials charge it to SGL).
	rtt uint32
}

func (m *rts) encode(b []byte) {
	b[0], b[1], b[2], b[3] = ncVersion, byte(m.proposal), m.flags, 0
	le := binary.LittleEndian
	le.PutUint32(b[4:], m.xid)
	le.PutUint64(b[8:], uint64(m.bytes))
	le.PutUint64(b[16:], uint64(m.sig.Elements))
	le.PutUint64(b[24:], m.sig.Hash[0])
	le.PutUint64(b[32:], m.sig.Hash[1])
	le.PutUint64(b[40:], uint64(m.minBlock))
	le.PutUint64(b[48:], uint64(m.segments))
	le.PutUint64(b[56:], uint64(m.chunk))
	le.PutUint32(b[64:], m.rtt)
	le.PutUint32(b[68:], 0)
}

// maxWireChunk bounds the chunk size an RTS or CTS may announce: a
// receiver allocates buffers of that size.
const maxWireChunk = 1 << 30

func (m *rts) decode(b []byte) error {
	if len(b) < rtsHdrLen {
		return fmt.Errorf("%w: typed RTS of %d bytes, header needs %d", ErrInvalid, len(b), rtsHdrLen)
	}
	if b[0] != ncVersion {
		return fmt.Errorf("%w: typed RTS version %d, want %d", ErrInvalid, b[0], ncVersion)
	}
	le := binary.LittleEndian
	m.proposal, m.flags = datatype.Scheme(b[1]), b[2]
	m.xid = le.Uint32(b[4:])
	m.bytes = int64(le.Uint64(b[8:]))
	m.sig.Elements = int64(le.Uint64(b[16:]))
	m.sig.Hash = [2]uint64{le.Uint64(b[24:]), le.Uint64(b[32:])}
	m.minBlock = int64(le.Uint64(b[40:]))
	m.segments = int64(le.Uint64(b[48:]))
	m.chunk = int64(le.Uint64(b[56:]))
	m.rtt = le.Uint32(b[64:])
	switch {
	case m.proposal < datatype.SchemePack || m.proposal > datatype.SchemeZCopy:
		return fmt.Errorf("%w: typed RTS proposes scheme %d", ErrInvalid, m.proposal)
	case m.bytes < 0 || m.minBlock < 0 || m.segments < 0 || m.chunk < 1 || m.chunk > maxWireChunk:
		return fmt.Errorf("%w: typed RTS with bytes %d, min block %d, segments %d, chunk %d", ErrInvalid, m.bytes, m.minBlock, m.segments, m.chunk)
	case datatype.Chunks(m.bytes, m.chunk) > 1<<32:
		return fmt.Errorf("%w: typed RTS of %d bytes in %d-byte chunks: more chunks than a tag numbers", ErrInvalid, m.bytes, m.chunk)
	case m.flags&rtsInline != 0 && int64(len(b)-rtsHdrLen) != m.bytes:
		return fmt.Errorf("%w: typed RTS carries %d inline bytes, says %d", ErrInvalid, len(b)-rtsHdrLen, m.bytes)
	}
	return nil
}

// cts is the clear to send (and, with the same layout, the ACK of a pack
// transfer): the receiver's decision or the error it found.
type cts struct {
	status  uint8
	scheme  datatype.Scheme
	flags   uint8
	nwin    uint32
	chunk   int64
	setID   uint64
	keysLen int64
	rbytes  int64 // receiver's layout size
	rsig    datatype.Signature
}

func (m *cts) encode(b []byte) {
	b[0], b[1], b[2], b[3] = m.status, byte(m.scheme), m.flags, 0
	le := binary.LittleEndian
	le.PutUint32(b[4:], m.nwin)
	le.PutUint64(b[8:], uint64(m.chunk))
	le.PutUint64(b[16:], m.setID)
	le.PutUint64(b[24:], uint64(m.keysLen))
	le.PutUint64(b[32:], uint64(m.rbytes))
	le.PutUint64(b[40:], uint64(m.rsig.Elements))
	le.PutUint64(b[48:], m.rsig.Hash[0])
	le.PutUint64(b[56:], m.rsig.Hash[1])
}

func (m *cts) decode(b []byte) error {
	if len(b) != ctsLen {
		return fmt.Errorf("%w: typed CTS of %d bytes, want %d", ErrInvalid, len(b), ctsLen)
	}
	le := binary.LittleEndian
	m.status, m.scheme, m.flags = b[0], datatype.Scheme(b[1]), b[2]
	m.nwin = le.Uint32(b[4:])
	m.chunk = int64(le.Uint64(b[8:]))
	m.setID = le.Uint64(b[16:])
	m.keysLen = int64(le.Uint64(b[24:]))
	m.rbytes = int64(le.Uint64(b[32:]))
	m.rsig.Elements = int64(le.Uint64(b[40:]))
	m.rsig.Hash = [2]uint64{le.Uint64(b[48:]), le.Uint64(b[56:])}
	if m.status > stFailed {
		return fmt.Errorf("%w: typed CTS with status %d", ErrInvalid, m.status)
	}
	if m.status == stOK && (m.scheme < datatype.SchemePack || m.scheme > datatype.SchemeZCopy) {
		return fmt.Errorf("%w: typed CTS chose scheme %d", ErrInvalid, m.scheme)
	}
	if m.keysLen < 0 || m.keysLen > 1<<34 || m.chunk < 0 || m.rbytes < 0 {
		return fmt.Errorf("%w: typed CTS with keys length %d, chunk %d, receive size %d", ErrInvalid, m.keysLen, m.chunk, m.rbytes)
	}
	return nil
}

// Raw tagged operations of the typed protocol. They reuse the transport's
// request machinery (tracking, pinning, peer-loss failure) with wire tags
// of kind KindTyped.

// ncSend starts a tagged send of b (a contiguous buffer or an IOV list whose
// pointers are pins).
func (t *Transport) ncSend(peer int, tag uint64, b ucx.Buffer, pins []unsafe.Pointer) *Request {
	return t.ncSendChecked(peer, tag, b, pins, nil, nil)
}

// ncSendChecked is ncSend with two hooks, run under the worker lock: check
// (if not nil) is asked before the post, and an error it returns fails the
// send in its place; done (if not nil) runs once the post is settled.
func (t *Transport) ncSendChecked(peer int, tag uint64, b ucx.Buffer, pins []unsafe.Pointer, check func() error, done func(*Request)) *Request {
	r := t.newRequest("typed send", peer, -1, b.Len)
	r.b, r.pins, r.iov = b, pins, b.IOV
	t.exec(func() {
		if done != nil {
			defer done(r)
		}
		p, err := t.peerLocked(peer, r.op)
		if err != nil {
			t.fail(r, err)
			return
		}
		var ureq ucx.Request
		if check != nil {
			err = check()
		}
		if err == nil {
			ureq, err = t.w.TagSend(p.ep, r.b, tag)
		}
		t.settle(r, ureq, err)
	})
	return r
}

// ncSendRTS starts the send of a typed send's RTS, msg, to peer under wire
// (user tag tag), as ncSend does; rtsPostFault (tests) is asked before
// the post. reply is the receive the send posted before for the
// receiver's answer (CTS or acknowledgement): if the RTS fails at its
// post, no answer will come, and reply is withdrawn and fails with the
// RTS's error (it stayed posted for good before).
func (t *Transport) ncSendRTS(peer, tag int, wire uint64, msg ucx.Buffer, reply *Request) *Request {
	fault := func() error {
		if f := t.rtsPostFault; f != nil {
			return f(peer, tag)
		}
		return nil
	}
	return t.ncSendChecked(peer, wire, msg, nil, fault, func(r *Request) {
		if r.fin.Load() && r.err != nil {
			t.withdrawReply(reply, r.err)
		}
	})
}

// withdrawReply takes rr, a typed send's receive of its receiver's answer,
// out of UCX (the receive was posted before the RTS, which failed with
// err) and fails it with err; the worker lock is held. A receive that
// failed already, or matched meanwhile, is left to finish.
func (t *Transport) withdrawReply(rr *Request, err error) {
	if rr.fin.Load() || !rr.ureq.Pending() || t.ops[rr.ureq] != rr {
		return
	}
	if t.cancelInUCX(rr) {
		t.fail(rr, err)
	}
}

// ncSendAfter is ncSend for a message that follows rts, a typed send's
// RTS, without waiting for it: if rts failed at its post (its send ran
// first, under the worker lock), the message is not posted and fails with
// rts's error (its receiver, which never heard of the transfer, would
// never take it). A nil rts is ncSend.
func (t *Transport) ncSendAfter(rts *Request, peer int, tag uint64, b ucx.Buffer, pins []unsafe.Pointer) *Request {
	if rts == nil {
		return t.ncSend(peer, tag, b, pins)
	}
	return t.ncSendChecked(peer, tag, b, pins, func() error {
		if rts.fin.Load() && rts.err != nil {
			return fmt.Errorf("its RTS failed: %w", rts.err)
		}
		return nil
	}, nil)
}

// ncRecv posts a tagged receive of exactly tag into b.
func (t *Transport) ncRecv(peer int, tag uint64, b ucx.Buffer, pins []unsafe.Pointer) *Request {
	return t.ncRecvThen(peer, tag, b, pins, nil)
}

// ncRecvThen is ncRecv that calls posted (if not nil) once the receive is
// in UCX, or has failed before getting there; the worker lock is held then.
func (t *Transport) ncRecvThen(peer int, tag uint64, b ucx.Buffer, pins []unsafe.Pointer, posted func(*Request)) *Request {
	r := t.newRequest("typed recv", peer, -1, b.Len)
	r.recv = true
	r.b, r.pins, r.iov = b, pins, b.IOV
	t.exec(func() {
		if posted != nil {
			defer posted(r)
		}
		if _, err := t.peerLocked(peer, r.op); err != nil {
			t.fail(r, err)
			return
		}
		if t.ov != nil && tag&ncDataMask == ncDataTag && t.ovRecvKey(r, ovKey{wire: tag}, r.bufLen < t.ov.thresh) {
			return
		}
		ureq, err := t.w.TagRecv(r.b, tag, FullMask)
		switch {
		case err != nil:
			t.fail(r, fmt.Errorf("transport: %s rank %d: %w", r.op, peer, err))
		case !ureq.Pending():
			t.fail(r, fmt.Errorf("transport: %s rank %d: UCX completed a receive without reporting it", r.op, peer))
		default:
			t.track(r, ureq)
		}
	})
	return r
}

func bufOf(b []byte) ucx.Buffer { return ucx.Buffer{Ptr: bytesPtr(b), Len: len(b)} }

// waitAll waits for every request and returns the first error.
func waitAll(ctx context.Context, rs []*Request) error {
	var first error
	for _, r := range rs {
		if r == nil {
			continue
		}
		if _, err := r.Wait(ctx); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// iovList builds a C IOV list over pieces of the caller's buffer: piece
// addresses are absolute, buf's first byte is at address origin.
func iovList(buf []byte, origin uintptr, pieces []datatype.IOV) (ucx.Buffer, []unsafe.Pointer) {
	v := ucx.NewIOV(len(pieces))
	pins := make([]unsafe.Pointer, 0, 1)
	base := bytesPtr(buf)
	var total int64
	for i, p := range pieces {
		v.Set(i, unsafe.Add(base, int(p.Addr-origin)), int(p.Len))
		total += p.Len
	}
	pins = append(pins, base)
	return ucx.Buffer{IOV: v, Len: int(total)}, pins
}
