package transport

// One-sided CUDA IPC copies of device memory for the layers above the
// transport (the actor runtime's GPU Messaging API, docs/gpu.md): the
// sender exports a device buffer as a descriptor and sends it however it
// likes; the receiver, another process on the same host, imports it: the
// exporter's allocation is mapped (cached per peer, as on a channel) and
// copied into the receiver's buffer. The sender must leave its buffer
// untouched until the receiver says it has copied.

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"

	"github.com/troupe-hpc/troupe/gpu"
)

// DeviceDescSize is the size of a descriptor made by ExportDevice.
const DeviceDescSize = ipcDescSize

// ErrIPCDeclined is wrapped by ImportDevice's error when this process
// cannot take the copy by CUDA IPC at all (the destination is not cuda
// memory, or the driver refuses the handle, as it does for a device this
// process cannot reach): nothing was copied, and the exporter's bytes may
// still be moved another way.
var ErrIPCDeclined = errors.New("transport: CUDA IPC declined")

// deviceImports is the transport's state for ImportDevice.
type deviceImports struct {
	mu      sync.Mutex
	closed  bool
	caches  map[int]*ipcCache // by peer
	streams map[*gpu.Device]*gpu.Stream
	retired []*gpu.Stream  // copy streams that failed (destroyed at close)
	users   sync.WaitGroup // imports in flight (close waits)
}

// DeviceIPCPeer reports whether device memory can go to rank peer by CUDA
// IPC: both ranks take part in CUDA IPC (as for channels: GPUIPCStats),
// share a host and are different processes.
func (t *Transport) DeviceIPCPeer(peer int) bool { return t.gpuIPCPeer(peer) }

// ExportDevice returns a descriptor (DeviceDescSize bytes) through which
// another process of this host can copy b: cuda device memory, not empty.
// Other memory gives an error wrapping gpu.ErrUnsupportedKind or
// gpu.ErrNotSupported; the caller then sends the bytes.
func (t *Transport) ExportDevice(b gpu.Buffer) ([]byte, error) {
	if b.IsZero() || b.Len() == 0 {
		return nil, fmt.Errorf("transport: exporting an empty device buffer: %w", gpu.ErrUnsupportedKind)
	}
	if s := b.System(); s == nil || s.Backend() != gpu.BackendCUDA || b.Kind() != gpu.KindDevice {
		return nil, fmt.Errorf("transport: exporting %s memory by CUDA IPC: %w", b.Kind(), gpu.ErrUnsupportedKind)
	}
	h, err := b.System().IPCGetHandle(b)
	if err != nil {
		return nil, fmt.Errorf("transport: exporting a device buffer: %w", err)
	}
	d := ipcDesc{kind: ctlIPC, length: uint64(b.Len()), h: h, base: uint64(b.Ptr() - uintptr(b.Offset()))}
	t.gipc.exported.Add(1)
	return d.encode(), nil
}

// DeviceDescLength returns the length of the buffer desc (from
// ExportDevice) describes, after checking that desc is well formed: a
// malformed one fails with an error wrapping ErrProtocol.
func DeviceDescLength(desc []byte) (int, error) {
	d, err := decodeIPCDesc(desc)
	if err == nil && d.kind != ctlIPC {
		err = fmt.Errorf("%w: descriptor of kind %d, not an IPC handle", ErrProtocol, d.kind)
	}
	if err != nil {
		return 0, fmt.Errorf("transport: device descriptor: %w", err)
	}
	return int(d.length), nil
}

// ImportDevice copies the device memory that desc (from ExportDevice on
// rank peer) describes into dst, cuda memory of exactly that size, and
// returns once the copy is done. A malformed descriptor, a size mismatch
// (ErrSizeMismatch), memory that cannot take the copy or a handle the
// driver will not open (both ErrIPCDeclined: dst is unchanged) and a
// failing copy are errors; dst is then unchanged or partly written, and
// the exporter's memory is untouched.
func (t *Transport) ImportDevice(peer int, desc []byte, dst gpu.Buffer) error {
	d, dev, err := t.importTarget(peer, desc, dst)
	if err != nil {
		return err
	}
	cache, s, err := t.dimp.use(t, peer, dev)
	if err != nil {
		return err
	}
	defer t.dimp.users.Done()
	src, err := cache.open(dev, d)
	if err != nil {
		return fmt.Errorf("transport: device import from rank %d: %w: %w", peer, ErrIPCDeclined, err)
	}
	err = copyAndWait(s, dst, src)
	if err != nil {
		// A stream's error is sticky: the device's next import gets a
		// new stream, as a channel's transfers do (retireFailed).
		retireFailed(&t.dimp.mu, &t.dimp.streams, dev, s, &t.dimp.retired)
	}
	// This import's reference; the cache keeps the mapping.
	if cerr := gpu.IPCClose(src); cerr != nil && err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("transport: device import from rank %d: CUDA IPC copy: %w", peer, err)
	}
	t.gipc.imported.Add(1)
	return nil
}

// ImportDeviceNow is ImportDevice for a caller that must not wait long (a
// message handler on the progress goroutine): it copies only when that is
// quick, the sender's allocation already mapped (cached) and the copy taken
// by the device's copy agent (gpu.AgentCopy, a few microseconds), and
// reports whether it did; err is then the copy's result. Otherwise it does
// nothing, and the caller imports with ImportDevice in a goroutine of its
// own: that hand-off, not the copy, is what a small import costs when the
// agent runs (docs/gpu.md, "Quick imports").
func (t *Transport) ImportDeviceNow(peer int, desc []byte, dst gpu.Buffer) (bool, error) {
	d, dev, err := t.importTarget(peer, desc, dst)
	if err != nil {
		return false, nil // ImportDevice reports it
	}
	cache, _, err := t.dimp.use(t, peer, dev)
	if err != nil {
		return false, nil
	}
	defer t.dimp.users.Done()
	src, ok := cache.cached(dev, d)
	if !ok {
		return false, nil
	}
	done := false
	if gpu.AgentReady(dst, src) {
		done, err = gpu.AgentCopy(dst, src)
	}
	if cerr := gpu.IPCClose(src); cerr != nil && err == nil {
		err = cerr
	}
	switch {
	case !done:
		return false, nil
	case err != nil:
		return true, fmt.Errorf("transport: device import from rank %d: CUDA IPC copy: %w", peer, err)
	}
	t.gipc.hits.Add(1)
	t.gipc.imported.Add(1)
	t.gipc.importedNow.Add(1)
	return true, nil
}

// importTarget checks an import of desc from rank peer into dst and returns
// the decoded descriptor and dst's device.
func (t *Transport) importTarget(peer int, desc []byte, dst gpu.Buffer) (ipcDesc, *gpu.Device, error) {
	d, err := decodeIPCDesc(desc)
	switch {
	case err != nil:
		return d, nil, fmt.Errorf("transport: device import from rank %d: %w", peer, err)
	case d.kind != ctlIPC:
		return d, nil, fmt.Errorf("transport: device import from rank %d: %w: descriptor of kind %d, not an IPC handle", peer, ErrProtocol, d.kind)
	case peer < 0 || peer >= t.size:
		return d, nil, fmt.Errorf("transport: device import from rank %d: %w", peer, ErrInvalid)
	case uint64(dst.Len()) != d.length:
		return d, nil, fmt.Errorf("transport: device import from rank %d: %d bytes exported, a buffer of %d to copy into: %w",
			peer, d.length, dst.Len(), ErrSizeMismatch)
	}
	dev := ipcDevice(endBuf{g: dst, isG: true})
	if dev == nil {
		return d, nil, fmt.Errorf("transport: device import from rank %d into %s memory: %w (%w)", peer, dst.Kind(), ErrIPCDeclined, gpu.ErrUnsupportedKind)
	}
	return d, dev, nil
}

// use registers an import in flight and returns the peer's mapping cache
// and dev's copy stream.
func (di *deviceImports) use(t *Transport, peer int, dev *gpu.Device) (*ipcCache, *gpu.Stream, error) {
	di.mu.Lock()
	defer di.mu.Unlock()
	if di.closed {
		return nil, nil, fmt.Errorf("transport: device import from rank %d: %w", peer, ErrClosed)
	}
	s := di.streams[dev]
	if s == nil {
		var err error
		if s, err = dev.NewStream(); err != nil {
			return nil, nil, fmt.Errorf("transport: device import from rank %d: copy stream: %w", peer, err)
		}
		if di.streams == nil {
			di.streams = map[*gpu.Device]*gpu.Stream{}
		}
		di.streams[dev] = s
	}
	c := di.caches[peer]
	if c == nil {
		c = &ipcCache{st: &t.gipc}
		if di.caches == nil {
			di.caches = map[int]*ipcCache{}
		}
		di.caches[peer] = c
	}
	di.users.Add(1)
	return c, s, nil
}

// close waits for the imports in flight, then closes the mappings and the
// streams (Transport.Close).
func (di *deviceImports) close() error {
	di.mu.Lock()
	if di.closed {
		di.mu.Unlock()
		return nil
	}
	di.closed = true
	di.mu.Unlock()
	di.users.Wait()
	var errs []error
	for _, c := range di.caches {
		errs = append(errs, c.release())
	}
	for _, s := range append(slices.Collect(maps.Values(di.streams)), di.retired...) {
		if err := s.Destroy(); err != nil && !errors.Is(err, gpu.ErrClosed) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// copyAndWait copies src into dst on s and waits for the stream (which may
// also wait for copies other transfers put on s just before; an event per
// copy cost more: creating and destroying one is about 6 us on an H100).
// A small copy goes to the device's copy agent instead when it runs
// (gpu.AgentCopy: 4 us against 11 for 8 bytes on an H100).
func copyAndWait(s *gpu.Stream, dst, src gpu.Buffer) error {
	if done, err := gpu.AgentCopy(dst, src); done || err != nil {
		return err
	}
	if err := gpu.CopyAsync(s, dst, src); err != nil {
		return err
	}
	return s.Synchronize()
}
