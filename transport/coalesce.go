package transport

import (
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/troupe-hpc/troupe/transport/ucx"
)

// Coalescing (docs/transport.md, "Coalescing posted messages").
//
// A posted active message (PostAM) normally leaves as one UCP active
// message. When the peer is not keeping up, so that UCX still holds earlier
// posts to it (its receive queue was full), a small post is instead
// appended to the peer's bundle, which leaves as one active message with id
// amBundle: when no post to the peer is in flight any more, when the
// bundle is full, before any other active message to the peer (order), or
// before the progress goroutine sleeps. The messages would have waited in
// UCX's queue anyway; in a bundle they cost the sender a copy instead of a
// UCX send each, and the receiver one arrival instead of one each. A peer
// that keeps up gets one active message per post, as before.
//
// A bundle's header is the number of messages (uvarint); its data is the
// messages, each a frame:
//
//	id (uint16, little endian) | header length (uvarint) | data length (uvarint) | header | data
//
// The receiver runs each message's handler as if it had arrived alone,
// with Rendezvous false.

// amBundle is the active-message id of bundles.
const amBundle uint16 = 0x32

const (
	// coalesceMax is the largest header plus data PostAM coalesces.
	coalesceMax = 1 << 10
	// bundleCap is the most data a bundle holds: one shared-memory
	// fragment (UCX's default segment takes 8256 bytes), and a TCP one.
	bundleCap = 8000
)

// canCoalesce reports whether a post of n bytes to p joins p's bundle; the
// worker lock is held.
func (t *Transport) canCoalesce(p *peer, n int) bool {
	return !t.opts.NoCoalesce && n <= coalesceMax && (p.bundled > 0 || p.ep.PostsInFlight() > 0)
}

// bundleAdd appends a message to p's bundle, sending the bundle first if
// the message would not fit. It reports whether UCX queued that send; the
// worker lock is held.
func (t *Transport) bundleAdd(p *peer, id uint16, header, data []byte) (queued bool, err error) {
	n := 2 + binary.MaxVarintLen32*2 + len(header) + len(data)
	if p.bundled > 0 && len(p.bundle)+n > bundleCap {
		queued, err = t.bundleSend(p)
		if err != nil {
			return false, err
		}
	}
	if p.bundled == 0 {
		t.bundling = append(t.bundling, p.rank)
		t.bundlesPending.Add(1)
		// The poster moves the queue (it sends full bundles, progressing
		// when UCX queues them): the progress goroutine stands aside
		// meanwhile, as it does for a PostAM that progressed (posting).
		t.postPendingAt.Store(time.Now().UnixNano())
	}
	b := binary.LittleEndian.AppendUint16(p.bundle, id)
	b = binary.AppendUvarint(b, uint64(len(header)))
	b = binary.AppendUvarint(b, uint64(len(data)))
	b = append(b, header...)
	p.bundle = append(b, data...)
	p.bundled++
	return queued, nil
}

// bundleSend sends p's bundle, if it holds anything, and reports whether UCX
// queued it. Its messages' PostAM calls have returned: a failure is counted
// in PostFailed, not returned, unless the worker refused the send outright,
// when the error is returned too. The worker lock is held.
func (t *Transport) bundleSend(p *peer) (queued bool, err error) {
	if p.bundled == 0 {
		return false, nil
	}
	n := p.bundled
	t.bundleDone(p)
	var hdr [binary.MaxVarintLen32]byte
	done, err := t.w.AMPost(p.ep, amBundle, binary.AppendUvarint(hdr[:0], uint64(n)), p.bundle, AMEager)
	p.bundle = p.bundle[:0]
	if err != nil {
		t.bundleFailed += uint64(n)
		return false, fmt.Errorf("transport: am-send rank %d: a bundle of %d messages: %w", p.rank, n, err)
	}
	t.bundlesSent.Add(1)
	t.bundledMsgs.Add(int64(n))
	return !done, nil
}

// bundleDone forgets that p has a bundle waiting; the worker lock is held.
func (t *Transport) bundleDone(p *peer) {
	p.bundled = 0
	for i, r := range t.bundling {
		if r == p.rank {
			t.bundling = append(t.bundling[:i], t.bundling[i+1:]...)
			t.bundlesPending.Add(-1)
			return
		}
	}
}

// bundleFlush sends the bundle waiting for rank, if any, so that what
// follows leaves after it; the worker lock is held.
func (t *Transport) bundleFlush(rank int) {
	if p := t.peers[rank]; p != nil && p.bundled > 0 {
		if _, err := t.bundleSend(p); err != nil {
			t.log.Warn("bundle not sent", zap.Error(err))
		}
	}
}

// bundlesFlush sends waiting bundles: every one (all), or those to peers
// with no post in flight any more. It reports whether it sent any; the
// worker lock is held.
func (t *Transport) bundlesFlush(all bool) bool {
	sent := false
	for i := 0; i < len(t.bundling); {
		p := t.peers[t.bundling[i]]
		if !all && p.ep.PostsInFlight() > 0 {
			i++
			continue
		}
		sent = true
		if _, err := t.bundleSend(p); err != nil { // removes it from bundling
			t.log.Warn("bundle not sent", zap.Error(err))
		}
	}
	return sent
}

// bundleDrop discards the bundle of a lost peer, counting its messages as
// failed posts; the worker lock is held.
func (t *Transport) bundleDrop(p *peer) {
	if p.bundled > 0 {
		t.bundleFailed += uint64(p.bundled)
		t.bundleDone(p)
		p.bundle = p.bundle[:0]
	}
}

// CoalesceStats reports how many bundles PostAM's coalescing sent and how
// many messages they carried.
func (t *Transport) CoalesceStats() (bundles, messages int64) {
	return t.bundlesSent.Load(), t.bundledMsgs.Load()
}

// errBundle is the cause of every malformed-bundle error.
var errBundle = errors.New("malformed bundle")

// bundleFrame is one message of a bundle.
type bundleFrame struct {
	id     uint16
	header []byte
	data   []byte
}

// nextFrame decodes the frame at the start of b and returns it and the
// rest of b. It never reads past b and allocates nothing.
func nextFrame(b []byte) (bundleFrame, []byte, error) {
	var f bundleFrame
	if len(b) < 2 {
		return f, nil, fmt.Errorf("%w: %d bytes left, too few for a frame", errBundle, len(b))
	}
	f.id = binary.LittleEndian.Uint16(b)
	b = b[2:]
	hl, k := binary.Uvarint(b)
	if k <= 0 {
		return f, nil, fmt.Errorf("%w: bad header length", errBundle)
	}
	b = b[k:]
	dl, k := binary.Uvarint(b)
	if k <= 0 {
		return f, nil, fmt.Errorf("%w: bad data length", errBundle)
	}
	b = b[k:]
	if hl > uint64(len(b)) || dl > uint64(len(b))-hl {
		return f, nil, fmt.Errorf("%w: a frame of %d+%d bytes with %d left", errBundle, hl, dl, len(b))
	}
	f.header = b[:hl:hl]
	f.data = b[hl : hl+dl : hl+dl]
	return f, b[hl+dl:], nil
}

// deliverBundle runs the handlers of a bundle's messages, in order, as
// deliverOne does for a message that arrived alone; amMu is held. A
// malformed bundle is delivered up to the damage and the rest dropped.
func (t *Transport) deliverBundle(ev *ucx.Event) {
	want, k := binary.Uvarint(ev.AMHeader())
	if k <= 0 {
		t.log.Warn("malformed bundle dropped: bad message count")
		return
	}
	hs := *t.amh.Load()
	b := ev.AMData()
	got := uint64(0)
	lastID, lastH := uint16(amBundle), AMHandler(nil) // bundles mostly repeat one id
	delivered, size := 0, 0
	defer func() { t.traffic.amDelivered(delivered, size) }()
	for len(b) > 0 {
		f, rest, err := nextFrame(b)
		if err != nil {
			t.log.Warn("rest of a bundle dropped", zap.Uint64("delivered", got), zap.Error(err))
			return
		}
		b = rest
		got++
		h := lastH
		if f.id != lastID {
			h = hs[f.id].h
			lastID, lastH = f.id, h
		}
		if h == nil || f.id == amBundle || f.id == amCMAData {
			t.log.Warn("bundled active message without a handler dropped", zap.Uint16("id", f.id))
			continue
		}
		m := t.amMsg
		if m == nil {
			m = new(AMMessage)
		}
		*m = AMMessage{t: t, Header: f.header, Size: len(f.data), id: f.id, bundled: true, data: f.data}
		delivered, size = delivered+1, size+len(f.header)+len(f.data)
		h(m)
		if m.kept {
			t.amMsg = nil
		} else {
			t.amMsg = m
		}
	}
	if got != want {
		t.log.Warn("bundle held a different number of messages than announced", zap.Uint64("announced", want), zap.Uint64("found", got))
	}
}
