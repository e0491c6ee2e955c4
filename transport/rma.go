package transport

import (
	"context"
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"runtime"

	"github.com/troupe-hpc/troupe/transport/ucx"
)

// regHandle is what the registration cache keeps per entry.
type regHandle struct {
	mem  *ucx.MemHandle
	rkey []byte
}

func (t *Transport) mapMemory(start, end uintptr) (any, error) {
	m, err := t.ctx.MemMap(start, int(end-start))
	if err != nil {
		return nil, err
	}
	rk, err := m.PackRkey()
	if err != nil {
		_ = m.Unmap()
		return nil, err
	}
	return &regHandle{mem: m, rkey: rk}, nil
}

func (t *Transport) unmapMemory(h any) {
	if rh, ok := h.(*regHandle); ok {
		if err := rh.mem.Unmap(); err != nil {
			t.log.Warn("unmapping registered memory failed")
		}
	}
}

// Region is registered local memory that peers may Put to and Get from
// within its bounds.
type Region struct {
	t     *Transport
	e     *regEntry
	buf   []byte
	pin   runtime.Pinner
	freed bool
}

// RemoteKey is what a peer needs to access a Region: the owner's rank, the
// region's address and length, and UCX's packed remote key. Ship it with
// MarshalBinary.
type RemoteKey struct {
	Rank   int
	Addr   uint64
	Len    int
	Packed []byte
}

// Register registers buf for RMA through the registration cache: memory
// already covered by a cached registration is not registered again. buf stays
// pinned until Release.
func (t *Transport) Register(buf []byte) (*Region, error) {
	if len(buf) == 0 {
		return nil, fmt.Errorf("%w: register: empty buffer", ErrInvalid)
	}
	r := &Region{t: t, buf: buf}
	r.pin.Pin(&buf[0])
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		r.pin.Unpin()
		return nil, ErrClosed
	}
	e, err := t.reg.acquire(uintptr(bytesPtr(buf)), len(buf))
	if err != nil {
		r.pin.Unpin()
		return nil, fmt.Errorf("transport: register %d bytes: %w", len(buf), err)
	}
	r.e = e
	return r, nil
}

// Bytes is the registered memory.
func (r *Region) Bytes() []byte { return r.buf }

// Key returns the remote key peers use to reach this region.
func (r *Region) Key() RemoteKey {
	return RemoteKey{Rank: r.t.rank, Addr: uint64(uintptr(bytesPtr(r.buf))), Len: len(r.buf), Packed: r.e.handle.(*regHandle).rkey}
}

// Release ends this use of the region. The registration stays cached for
// reuse until evicted or invalidated by Deregister.
func (r *Region) Release() {
	t := r.t
	t.mu.Lock()
	defer t.mu.Unlock()
	if r.freed {
		return
	}
	r.freed = true
	if !t.closed {
		t.reg.release(r.e)
	}
	r.pin.Unpin()
}

// Deregister invalidates every cached registration overlapping buf, as when
// that memory is about to be freed, and drops the typed-transfer layouts
// over it that no transfer is using (with their window keys). Regions still
// in use stay valid until released; later registrations of that memory
// register it anew.
func (t *Transport) Deregister(buf []byte) int {
	lo := uintptr(bytesPtr(buf))
	t.mu.Lock()
	if t.closed || len(buf) == 0 {
		t.mu.Unlock()
		return 0
	}
	n := t.reg.invalidate(lo, len(buf))
	t.mu.Unlock()
	if v, ok := noncontigs.Load(t); ok {
		v.(*noncontig).forgetRange(lo, lo+uintptr(len(buf)))
	}
	return n
}

// RegCacheStats returns the registration cache's counters.
func (t *Transport) RegCacheStats() RegCacheStats {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.reg.snapshot()
}

// Remote keys travel as rank (4 bytes), address (8), length (8), packed
// size (4), the packed rkey, then an FNV-1a hash (8) of all that: UCX
// trusts packed rkeys entirely (a corrupt one crashed the process in
// ucp_ep_rkey_unpack), so a key whose bytes changed on the way is refused
// before it reaches UCX. A key forged with a valid hash is beyond that.
const (
	remoteKeyHeader = 24
	remoteKeyHash   = 8
)

// MarshalBinary encodes the key for a peer.
func (k RemoteKey) MarshalBinary() ([]byte, error) {
	b := make([]byte, 0, remoteKeyHeader+len(k.Packed)+remoteKeyHash)
	b = binary.LittleEndian.AppendUint32(b, uint32(k.Rank))
	b = binary.LittleEndian.AppendUint64(b, k.Addr)
	b = binary.LittleEndian.AppendUint64(b, uint64(k.Len))
	b = binary.LittleEndian.AppendUint32(b, uint32(len(k.Packed)))
	b = append(b, k.Packed...)
	return binary.LittleEndian.AppendUint64(b, fnv1a(b)), nil
}

// UnmarshalBinary decodes a key encoded by MarshalBinary. A key whose bytes
// do not hash to what its sender computed fails with ErrInvalid.
func (k *RemoteKey) UnmarshalBinary(b []byte) error {
	if len(b) < remoteKeyHeader+remoteKeyHash {
		return fmt.Errorf("%w: remote key of %d bytes is shorter than its header and hash (%d)", ErrInvalid, len(b), remoteKeyHeader+remoteKeyHash)
	}
	body := b[:len(b)-remoteKeyHash]
	if got, want := fnv1a(body), binary.LittleEndian.Uint64(b[len(body):]); got != want {
		return fmt.Errorf("%w: remote key of %d bytes is corrupt (hash %#x, its sender's %#x)", ErrInvalid, len(b), got, want)
	}
	n := binary.LittleEndian.Uint32(body[20:24])
	if int(n) != len(body)-remoteKeyHeader || n == 0 {
		return fmt.Errorf("%w: remote key says %d packed bytes, has %d", ErrInvalid, n, len(body)-remoteKeyHeader)
	}
	ln := binary.LittleEndian.Uint64(body[12:20])
	if ln > 1<<62 {
		return fmt.Errorf("%w: remote key length %d", ErrInvalid, ln)
	}
	k.Rank = int(binary.LittleEndian.Uint32(body[0:4]))
	k.Addr = binary.LittleEndian.Uint64(body[4:12])
	k.Len = int(ln)
	k.Packed = append([]byte(nil), body[remoteKeyHeader:]...)
	return nil
}

// fnv1a is the 64-bit FNV-1a hash of b.
func fnv1a(b []byte) uint64 {
	h := fnv.New64a()
	h.Write(b)
	return h.Sum64()
}

// rma starts a Put (write) or Get; the remote range is checked against the key.
func (t *Transport) rma(op string, key RemoteKey, off int, local []byte) (*Request, error) {
	if err := t.checkRank(key.Rank, op); err != nil {
		return nil, err
	}
	if off < 0 || off > key.Len || len(local) > key.Len-off {
		return nil, &BoundsError{Op: op, Offset: off, Length: len(local), RegionLen: key.Len}
	}
	r := t.newRequest(op, key.Rank, 0, len(local))
	t.exec(func() {
		p, err := t.peerLocked(key.Rank, op)
		if err != nil {
			t.fail(r, err)
			return
		}
		rk := p.rkeys[string(key.Packed)]
		if rk == nil {
			if rk, err = p.ep.UnpackRkey(key.Packed); err != nil {
				t.fail(r, fmt.Errorf("transport: %s rank %d: %w", op, key.Rank, err))
				return
			}
			p.rkeys[string(key.Packed)] = rk
		}
		raddr := key.Addr + uint64(off)
		var ureq ucx.Request
		if op == "put" {
			ureq, err = t.w.Put(p.ep, bytesPtr(local), len(local), raddr, rk)
		} else {
			ureq, err = t.w.Get(p.ep, bytesPtr(local), len(local), raddr, rk)
		}
		t.settle(r, ureq, err, bytesPtr(local))
	})
	return r, nil
}

// Iput starts writing src into the remote region at byte offset off. Its
// completion means src may be reused; Flush makes the data visible remotely.
func (t *Transport) Iput(key RemoteKey, off int, src []byte) (*Request, error) {
	return t.rma("put", key, off, src)
}

// Iget starts reading len(dst) bytes of the remote region at offset off.
func (t *Transport) Iget(key RemoteKey, off int, dst []byte) (*Request, error) {
	return t.rma("get", key, off, dst)
}

// Put writes src into the remote region and waits for local completion.
func (t *Transport) Put(ctx context.Context, key RemoteKey, off int, src []byte) error {
	r, err := t.Iput(key, off, src)
	if err != nil {
		return err
	}
	_, err = r.Wait(ctx)
	return err
}

// Get reads from the remote region into dst and waits until dst holds it.
func (t *Transport) Get(ctx context.Context, key RemoteKey, off int, dst []byte) error {
	if err := t.waitInHandler("get", -1, 0); err != nil {
		return err
	}
	r, err := t.Iget(key, off, dst)
	if err != nil {
		return err
	}
	_, err = r.Wait(ctx)
	return err
}

// Flush waits until every RMA operation issued to rank dst has completed remotely.
func (t *Transport) Flush(ctx context.Context, dst int) error {
	if err := t.checkRank(dst, "flush"); err != nil {
		return err
	}
	r := t.newRequest("flush", dst, 0, 0)
	t.exec(func() {
		p, err := t.peerLocked(dst, "flush")
		if err != nil {
			t.fail(r, err)
			return
		}
		ureq, err := t.w.Flush(p.ep)
		t.settle(r, ureq, err)
	})
	_, err := r.Wait(ctx)
	return err
}
