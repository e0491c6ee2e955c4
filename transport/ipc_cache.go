package transport

import (
	"errors"
	"sync"

	"github.com/troupe-hpc/troupe/gpu"
)

// ipcCache keeps CUDA IPC mappings of another process's allocations open
// between transfers: one reference per mapped allocation (the transfer's
// own reference comes from gpu.Device.IPCOpen and is closed by the
// caller). A channel has one; so has each peer of the device import path
// (device_ipc.go).
//
// A cached mapping is closed when a descriptor shows that the exporter's
// allocation range now belongs to another allocation (it was freed and the
// range reused), when more than ipcCacheMax are cached (least recently used
// first), and by release.
type ipcCache struct {
	st *gpuIPCState // counters (hits, misses, evictions)

	mu     sync.Mutex
	closed bool // released: nothing more is cached
	tick   uint64
	m      map[ipcKey]*ipcEntry
}

// ipcKey names a cached mapping.
type ipcKey struct {
	dev    *gpu.Device
	handle [64]byte
}

// ipcEntry is a cached mapping: one reference to it.
type ipcEntry struct {
	whole      gpu.Buffer
	base, size uint64 // the exporter's allocation range
	used       uint64 // last use (LRU)
}

// cached returns a reference to the part of the exporter's allocation that
// d describes when its mapping is cached (ok), as open would, without
// opening anything or counting a hit; the caller closes it with
// gpu.IPCClose.
func (c *ipcCache) cached(dev *gpu.Device, d ipcDesc) (gpu.Buffer, bool) {
	key := ipcKey{dev, d.h.Handle}
	c.mu.Lock()
	ent := c.m[key]
	if c.closed || ent == nil || ent.base != d.base || ent.size != d.h.Size {
		c.mu.Unlock()
		return gpu.Buffer{}, false
	}
	c.tick++
	ent.used = c.tick
	c.mu.Unlock()
	ref, err := dev.IPCOpen(d.h) // the cache's reference keeps it open: no driver call
	return ref, err == nil
}

// open returns a reference to the part of the exporter's allocation that d
// describes, mapped on dev; the caller closes it with gpu.IPCClose. The
// cache keeps the mapping open for later transfers.
func (c *ipcCache) open(dev *gpu.Device, d ipcDesc) (gpu.Buffer, error) {
	key := ipcKey{dev, d.h.Handle}
	var stale []gpu.Buffer
	c.mu.Lock()
	cached := false
	if !c.closed {
		c.tick++
		for k, ent := range c.m {
			if k != key && d.base < ent.base+ent.size && ent.base < d.base+d.h.Size {
				// The exporter freed that allocation and reused its range.
				stale = append(stale, ent.whole)
				delete(c.m, k)
			}
		}
		if ent := c.m[key]; ent != nil {
			ent.used = c.tick
			cached = true
		}
	}
	c.mu.Unlock()
	c.closeMappings(stale)
	ref, err := dev.IPCOpen(d.h)
	if err != nil {
		return gpu.Buffer{}, err
	}
	if cached {
		c.st.hits.Add(1)
		return ref, nil
	}
	c.st.misses.Add(1)
	whole, err := dev.IPCOpen(gpu.IPCHandle{Handle: d.h.Handle, Length: d.h.Size, Size: d.h.Size})
	if err != nil {
		return ref, nil // not cached: the next transfer opens it again
	}
	stale = stale[:0]
	c.mu.Lock()
	switch {
	case c.closed || c.m[key] != nil:
		stale = append(stale, whole)
	default:
		if c.m == nil {
			c.m = map[ipcKey]*ipcEntry{}
		}
		c.m[key] = &ipcEntry{whole: whole, base: d.base, size: d.h.Size, used: c.tick}
		if len(c.m) > ipcCacheMax {
			var oldest ipcKey
			first := true
			for k, ent := range c.m {
				if first || ent.used < c.m[oldest].used {
					oldest, first = k, false
				}
			}
			stale = append(stale, c.m[oldest].whole)
			delete(c.m, oldest)
		}
	}
	c.mu.Unlock()
	c.closeMappings(stale)
	return ref, nil
}

// closeMappings drops cached mapping references; a mapping closes with its
// last reference. Errors of systems already closed are ignored.
func (c *ipcCache) closeMappings(bs []gpu.Buffer) error {
	var errs []error
	for _, b := range bs {
		c.st.evicted.Add(1)
		if err := gpu.IPCClose(b); err != nil && !errors.Is(err, gpu.ErrFreed) && !errors.Is(err, gpu.ErrClosed) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// release closes the cached mappings; nothing is cached afterwards.
func (c *ipcCache) release() error {
	c.mu.Lock()
	c.closed = true
	bs := make([]gpu.Buffer, 0, len(c.m))
	for _, ent := range c.m {
		bs = append(bs, ent.whole)
	}
	c.m = nil
	c.mu.Unlock()
	n := int64(len(bs))
	err := c.closeMappings(bs)
	c.st.evicted.Add(-n) // closing is not an eviction
	return err
}
