package transport

// The overlap engine and same-host zero copy (CMA) together.
//
// A CMA message reaches the receiver as a 32-byte descriptor under the
// message's tag (cma.go); its bytes stay in the sender's memory until the
// receiver reads them with one process_vm_readv and acknowledges. For the
// engine the descriptor is the rendezvous header and that read is the
// transfer: ovProbe takes descriptors off UCX's unexpected queue with the
// other USER messages, receives the 32 bytes, and then reports
// HeaderArrived with the message's real size. The decisions act as for a
// UCX rendezvous:
//
//   - Offload (expected): the progress goroutine reads into the receive's
//     buffer at once, while the application computes.
//   - Onload (expected): the read waits for the receiver's next call, or
//     for the policy to offload it at its revisit time (ovRevisit).
//   - Prefetch (unexpected): the progress goroutine reads into a pool slot
//     and acknowledges, which releases the sender before the receive is
//     posted; the slot is copied out when it is.
//   - Onload (unexpected): the descriptor is kept; when the receive is
//     posted, the progress goroutine reads straight into its buffer (the
//     posting call returns at once).
//
// Every function here runs with the worker lock held.

import (
	"fmt"
	"unsafe"

	"github.com/troupe-hpc/troupe/overlap"
	"github.com/troupe-hpc/troupe/transport/ucx"
)

// ovCMATake receives the descriptor msg that ovProbe took off UCX's queue.
// Until it is in, the message counts as not arrived: its entry in the
// unexpected table (descPending) only tells ovRecv that the receive must
// wait in the engine's table rather than in UCX, where the descriptor no
// longer is.
func (t *Transport) ovCMATake(msg ucx.Message, wire uint64, src, tag, length int) {
	ov := t.ov
	ov.nextID++
	m := &ovMsg{id: ov.nextID, wire: wire, peer: src, tag: tag, cma: true, descPending: true, slot: overlap.NoSlot}
	ov.unexp[m.key()] = m
	buf := make([]byte, cmaDescSize)
	h := t.newRequest("cma-descriptor", -1, 0, cmaDescSize)
	h.probe = func(st ucx.Status, n int) { t.ovCMADesc(m, st, length, buf[:n]) }
	ureq, err := t.w.TagMsgRecv(ucx.Buffer{Ptr: unsafe.Pointer(&buf[0]), Len: cmaDescSize}, msg)
	if err != nil {
		t.ovCMADesc(m, ucx.StatusOf(err), length, nil)
		return
	}
	t.track(h, ureq, unsafe.Pointer(&buf[0]))
}

// ovCMADesc handles the arrival of m's descriptor: the header of an expected
// message if its receive waits in the table, else of an unexpected one.
func (t *Transport) ovCMADesc(m *ovMsg, st ucx.Status, length int, b []byte) {
	ov := t.ov
	if ov.unexp[m.key()] != m {
		return // the transport closed meanwhile
	}
	m.descPending = false
	var d cmaDesc
	var err error
	if st != ucx.StatusOK || length != cmaDescSize {
		err = fmt.Errorf("%w: recv from rank %d tag %d: receiving a CMA descriptor (%d bytes, UCX status %v)", ErrProtocol, m.peer, m.tag, length, st)
	} else {
		d, err = decodeDesc(b, m.peer, m.tag)
	}
	r := ov.posted[m.key()]
	if err != nil {
		// Nothing can be acknowledged without a descriptor; the receive
		// (now or when posted) fails with the error.
		m.done, m.err, m.eager = true, err, true
		if r != nil {
			delete(ov.posted, m.key())
			delete(ov.unexp, m.key())
			t.step(overlap.Event{Kind: overlap.RecvCancelled, ID: r.ov.id})
			t.fail(r, err)
		}
		return
	}
	m.desc, m.size = d, int(d.n)
	if r == nil {
		t.ovCMAUnexpected(m)
		return
	}
	delete(ov.posted, m.key())
	delete(ov.unexp, m.key())
	dec := t.step(overlap.Event{Kind: overlap.HeaderArrived, ID: r.ov.id, Peer: r.peer, Tag: m.wire, Size: int64(d.n), Expected: true})
	r.ov.size, r.ov.cma = int(d.n), &d
	if dec.Action == overlap.Offload || r.ov.size < ov.thresh || t.receiverIn() {
		t.ovCMAStart(r)
		return
	}
	t.ovHold(r, dec.Revisit)
}

// ovCMAUnexpected decides for a CMA message whose descriptor arrived before
// its receive: prefetch into a slot now, or keep the descriptor.
func (t *Transport) ovCMAUnexpected(m *ovMsg) {
	ov := t.ov
	m.tracked = true
	d := t.step(overlap.Event{Kind: overlap.HeaderArrived, ID: m.id, Peer: m.peer, Tag: m.wire, Size: int64(m.size)})
	if d.Action != overlap.Prefetch || d.Slot < 0 || d.Slot >= len(ov.slots) || m.size > ov.slotSize {
		m.mode = overlap.Onload
		return
	}
	if ov.slots[d.Slot] == nil {
		ov.slots[d.Slot] = make([]byte, ov.slotSize)
	}
	m.mode, m.slot = overlap.Prefetch, d.Slot
	m.data = ov.slots[d.Slot][:m.size]
	f := t.newRequest("prefetch", m.peer, m.tag, m.size)
	f.recv = true
	f.b = ucx.Buffer{Ptr: bytesPtr(m.data), Len: m.size}
	f.ov = &ovRecv{id: m.id, wire: m.wire, fetch: m}
	t.step(overlap.Event{Kind: overlap.TransferStarted, ID: m.id})
	t.cmaArrived(f, m.desc)
}

// ovCMAStart starts the read of r's CMA message into r's buffer; the read
// itself runs outside the lock (runCMAJobs).
func (t *Transport) ovCMAStart(r *Request) {
	d := *r.ov.cma
	r.ov.cma, r.ov.held = nil, false
	if r.ov.size >= t.ov.thresh {
		t.step(overlap.Event{Kind: overlap.TransferStarted, ID: r.ov.id})
		r.ov.started = true
		if int(d.n) > r.bufLen { // cmaArrived fails it at once
			t.ovTransferDone(r, nil)
		}
	}
	t.cmaArrived(r, d)
}

// ovCMAGiveBack turns the CMA message of a cancelled onloaded receive back
// into an unexpected message for the next receive with its sequence number.
func (t *Transport) ovCMAGiveBack(r *Request) {
	ov := t.ov
	d := *r.ov.cma
	r.ov.cma = nil
	src, utag, _ := SplitUserTag(r.ov.wire)
	ov.nextID++
	m := &ovMsg{id: ov.nextID, wire: r.ov.wire, peer: int(src), tag: int(utag), size: int(d.n), cma: true, desc: d, slot: overlap.NoSlot}
	ov.unexp[m.key()] = m
	t.ovCMAUnexpected(m)
}
