package transport

import (
	"encoding/binary"
	"slices"
	"unsafe"

	"go.uber.org/zap"

	"github.com/troupe-hpc/troupe/transport/ucx"
)

// Retiring window sets.
//
// A receiver drops a layout's window sets with the layout (evicted past
// NoncontigOptions.MaxLayouts, or by Deregister). Each peer that received
// a set's keys keeps them in its remote window cache under the set's id,
// which is never used again, with the remote key it unpacked for its puts:
// left alone, both would pile up for as long as the ranks run (before
// 2026-11-25 they did). So the receiver tells each such peer which sets are
// gone (an active message, amWinRetire), and the peer drops their entries
// and destroys the unpacked remote keys no remaining entry uses.
//
// No transfer still needs a retired set: the receiver drops only layouts no
// transfer uses, and a sender is done with a set (its puts flushed) before
// its completion message reaches the receiver and ends the transfer there.
// Set ids are never reused, so a late retirement cannot hit a newer set.

// amWinRetire is the active-message id of window set retirements: the
// header is the sending rank, the data the retired set ids (8 bytes each,
// little-endian).
const amWinRetire uint16 = 0x33

// maxRetireIDs bounds the set ids one retirement message carries.
const maxRetireIDs = 512

// retireSets tells peer that this rank's window sets ids are gone; the
// worker lock is held.
func (t *Transport) retireSets(peer int, ids []uint64) {
	p, err := t.peerLocked(peer, "window retire")
	if err != nil {
		return // lost or closed: its cache went with it
	}
	for len(ids) > 0 {
		n := min(len(ids), maxRetireIDs)
		msg := make([]byte, 8+8*n) // the header, then the data
		binary.LittleEndian.PutUint64(msg, uint64(t.rank))
		for i, id := range ids[:n] {
			binary.LittleEndian.PutUint64(msg[8+8*i:], id)
		}
		ids = ids[n:]
		ureq, err := t.w.AMSend(p.ep, amWinRetire, msg[:8], ucx.Buffer{Ptr: unsafe.Pointer(&msg[8]), Len: 8 * n}, AMEager)
		if err != nil {
			t.log.Warn("retiring window sets failed", zap.Int("peer", peer), zap.Error(err))
			return
		}
		if v, ok := noncontigs.Load(t); ok {
			v.(*noncontig).c.setsRetired.Add(int64(n))
		}
		if ureq.Pending() {
			t.track(t.newRequest("window retire", peer, 0, 0), ureq, unsafe.Pointer(&msg[0]))
		}
	}
}

// onWinRetire drops the remote window cache entries a peer retired, and
// the remote keys unpacked for them that no remaining entry uses.
func (t *Transport) onWinRetire(m *AMMessage) {
	data := m.Data()
	if len(m.Header) != 8 || m.Rendezvous || len(data) == 0 || len(data)%8 != 0 {
		t.log.Warn("malformed window set retirement dropped", zap.Int("header", len(m.Header)), zap.Int("bytes", m.Size))
		return
	}
	from := binary.LittleEndian.Uint64(m.Header)
	if from >= uint64(t.size) {
		t.log.Warn("window set retirement from no rank dropped", zap.Uint64("from", from))
		return
	}
	v, ok := noncontigs.Load(t)
	if !ok {
		return // no typed transfer here: nothing cached
	}
	nc := v.(*noncontig)
	ids := make([]uint64, len(data)/8)
	for i := range ids {
		ids[i] = binary.LittleEndian.Uint64(data[8*i:])
	}
	t.mu.Lock()
	unused := nc.forgetRemote(int(from), ids)
	if p := t.peers[from]; p != nil {
		for _, k := range unused {
			if rk := p.ncRkeys[k]; rk != nil {
				rk.Destroy()
				delete(p.ncRkeys, k)
			}
		}
	}
	t.mu.Unlock()
	select {
	case nc.retired <- struct{}{}:
	default:
	}
}

// forgetRemote drops peer's window sets ids from the remote window cache
// and returns the registration keys of the dropped sets that no remaining
// set of that peer uses.
func (nc *noncontig) forgetRemote(peer int, ids []uint64) []string {
	nc.mu.Lock()
	defer nc.mu.Unlock()
	m := nc.remote[peer]
	var dropped []string
	for _, id := range ids {
		e := m[id]
		if e == nil {
			continue
		}
		delete(m, id)
		nc.c.remoteForgotten.Add(1)
		if rs := e.filled(); rs != nil && !slices.Contains(dropped, string(rs.rkey)) {
			dropped = append(dropped, string(rs.rkey))
		}
	}
	if len(m) == 0 {
		delete(nc.remote, peer)
	}
	unused := dropped[:0]
	for _, k := range dropped {
		used := false
		for _, e := range m {
			if rs := e.filled(); rs != nil && string(rs.rkey) == k {
				used = true
				break
			}
		}
		if !used {
			unused = append(unused, k)
		}
	}
	return unused
}

// filled returns the entry's keys if they have arrived, else nil.
func (e *remoteEntry) filled() *remoteSet {
	select {
	case <-e.ready:
		return e.set
	default:
		return nil
	}
}
