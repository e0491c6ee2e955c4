package gpu

import "fmt"

// IPCHandle lets another process on the same node map a device Buffer (cuda
// backend): the driver's handle for the allocation plus the Buffer's offset
// and length within it, and the allocation's size.
type IPCHandle struct {
	Handle [64]byte
	Offset uint64
	Length uint64
	// Size is the size of the whole allocation (0 when unknown: IPCOpen
	// then does not check it). A receiver that wants to keep the whole
	// mapping open opens the handle with Offset 0 and Length Size.
	Size uint64
}

// IPCStats counts a System's IPC mappings (Device.IPCOpen, IPCClose).
type IPCStats struct {
	Opened uint64 // mappings the driver opened (cuIpcOpenMemHandle calls that succeeded)
	Closed uint64 // mappings the driver closed (cuIpcCloseMemHandle), Close included
	Hits   uint64 // IPCOpen calls served by an open mapping (no driver call)
	Open   int    // mappings open now
	Refs   int    // references to them (IPCOpen calls not yet closed)
}

// IPCStats reports the system's IPC mapping counters.
func (s *System) IPCStats() IPCStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.ipcStats
	st.Open = len(s.ipc)
	for _, m := range s.ipc {
		st.Refs += m.refs
	}
	return st
}

// ipcKey names a mapping: the driver maps an allocation once per context,
// so each device has its own mapping of a handle.
type ipcKey struct {
	h   [64]byte
	dev int
}

type ipcMapping struct {
	alloc *allocation
	refs  int
}

// IPCGetHandle returns a handle for device Buffer b (cuda backend only; the
// host backend reports ErrNotSupported: processes share data through UCX).
// The driver is asked once per allocation (cuIpcGetMemHandle); later calls
// return the cached handle.
func (s *System) IPCGetHandle(b Buffer) (IPCHandle, error) {
	if err := b.valid(); err != nil {
		return IPCHandle{}, err
	}
	if b.a.sys != s {
		return IPCHandle{}, ErrForeign
	}
	if b.a.kind != KindDevice || b.a.ipc {
		return IPCHandle{}, fmt.Errorf("gpu: IPC handle of %s buffer: %w", b.a.origin(), ErrUnsupportedKind)
	}
	// An allocation's handle never changes: the driver is asked once.
	b.a.mu.Lock()
	hp := b.a.ipcH
	b.a.mu.Unlock()
	if hp == nil {
		h, err := s.be.ipcGet(Buffer{a: b.a, ptr: b.a.base, n: b.a.size})
		if err != nil {
			return IPCHandle{}, err
		}
		hp = &h
		b.a.mu.Lock()
		b.a.ipcH = hp
		b.a.mu.Unlock()
	}
	return IPCHandle{Handle: *hp, Offset: uint64(b.Offset()), Length: uint64(b.n), Size: uint64(b.a.size)}, nil
}

// IPCOpen maps the memory behind h on device d and returns the Buffer it
// describes. Mappings are cached per handle and device, and reference
// counted: opening the same allocation again on the same device reuses that
// device's mapping (cuIpcOpenMemHandle may map an allocation only once per
// context); another device gets its own. Release each Buffer with IPCClose.
func (d *Device) IPCOpen(h IPCHandle) (Buffer, error) {
	s := d.sys
	if err := s.check(); err != nil {
		return Buffer{}, err
	}
	key := ipcKey{h: h.Handle, dev: d.ord}
	s.mu.Lock()
	m := s.ipc[key]
	if m != nil {
		m.refs++
		s.ipcStats.Hits++
	}
	s.mu.Unlock()
	if m == nil {
		var err error
		if m, err = s.ipcMap(d, key); err != nil {
			return Buffer{}, err
		}
	}
	whole := Buffer{a: m.alloc, ptr: m.alloc.base, n: m.alloc.size}
	if h.Size != 0 && h.Size != uint64(m.alloc.size) {
		_ = IPCClose(whole)
		return Buffer{}, fmt.Errorf("gpu: IPC handle of a %d-byte allocation mapped %d bytes: %w", h.Size, m.alloc.size, ErrOutOfBounds)
	}
	if h.Offset > uint64(m.alloc.size) {
		_ = IPCClose(whole)
		return Buffer{}, fmt.Errorf("gpu: IPC handle offset %d beyond %d-byte allocation: %w", h.Offset, m.alloc.size, ErrOutOfBounds)
	}
	b, err := whole.Slice(int(h.Offset), int(h.Length))
	if err != nil {
		_ = IPCClose(whole)
		return Buffer{}, err
	}
	return b, nil
}

// ipcMap returns key's mapping with a reference taken: the one another
// goroutine made meanwhile, or a new one. Mapping and unmapping go one at a
// time (ipcMu), so that the driver is never asked to map a handle it still
// maps (CUDA_ERROR_ALREADY_MAPPED).
func (s *System) ipcMap(d *Device, key ipcKey) (*ipcMapping, error) {
	s.ipcOpening.Add(1)
	defer s.ipcOpening.Add(-1)
	s.ipcMu.Lock()
	defer s.ipcMu.Unlock()
	s.mu.Lock()
	if m := s.ipc[key]; m != nil { // another opener mapped it meanwhile
		m.refs++
		s.ipcStats.Hits++
		s.mu.Unlock()
		return m, nil
	}
	s.mu.Unlock()
	a, err := s.be.ipcOpen(d.ord, key.h)
	if err != nil {
		return nil, err
	}
	a.sys, a.dev, a.kind, a.ipc = s, d, KindDevice, true
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ipcStats.Opened++
	if s.closed.Load() { // Close has run, or will not see this one
		_ = s.be.ipcClose(a)
		return nil, ErrClosed
	}
	m := &ipcMapping{alloc: a, refs: 1}
	s.ipc[key] = m
	s.reg.add(a)
	s.kcache.invalidate(a.base, a.size)
	return m, nil
}

// IPCClose drops one reference to the mapping behind b (from IPCOpen); the
// last one unmaps it.
func IPCClose(b Buffer) error {
	if err := b.valid(); err != nil {
		return err
	}
	if !b.a.ipc {
		return fmt.Errorf("gpu: IPCClose of %s buffer: %w", b.a.origin(), ErrNotAllocation)
	}
	s := b.a.sys
	s.ipcMu.Lock() // an opener of this handle waits until it is unmapped
	defer s.ipcMu.Unlock()
	s.mu.Lock()
	var key ipcKey
	var m *ipcMapping
	for k, x := range s.ipc {
		if x.alloc == b.a {
			key, m = k, x
			break
		}
	}
	if m == nil {
		s.mu.Unlock()
		return fmt.Errorf("gpu: IPCClose: %w", ErrFreed)
	}
	m.refs--
	if m.refs > 0 {
		s.mu.Unlock()
		return nil
	}
	delete(s.ipc, key)
	s.reg.remove(m.alloc)
	s.kcache.invalidate(m.alloc.base, m.alloc.size)
	m.alloc.freed.Store(true)
	s.ipcStats.Closed++
	s.mu.Unlock()
	s.quiesceAgents()
	err := s.be.ipcClose(m.alloc)
	s.mu.Lock() // a KindOf while it was being unmapped cached the mapping's kind
	s.kcache.invalidate(m.alloc.base, m.alloc.size)
	s.mu.Unlock()
	return err
}
