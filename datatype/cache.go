package datatype

import (
	"container/list"
	"sync"
	"weak"
)

// IOV is one block of a flattened layout at an absolute address.
type IOV struct {
	Addr uintptr
	Len  int64
}

// Stats summarises a flattened layout: what a transfer-scheme selector
// needs (papers on layout-aware schemes pick host packing, scatter/gather
// lists or zero-copy windows from the block count and lengths).
type Stats struct {
	Segments int64   // number of merged segments
	Bytes    int64   // data bytes, count*Size
	MinBlock int64   // shortest segment, 0 when empty
	MaxBlock int64   // longest segment
	AvgBlock float64 // Bytes / Segments, 0 when empty
}

// ComputeStats returns the statistics of a list of segments.
func ComputeStats(segs []Segment) Stats {
	var s Stats
	for i, g := range segs {
		s.Segments++
		s.Bytes += g.Len
		if i == 0 || g.Len < s.MinBlock {
			s.MinBlock = g.Len
		}
		if g.Len > s.MaxBlock {
			s.MaxBlock = g.Len
		}
	}
	if s.Segments > 0 {
		s.AvgBlock = float64(s.Bytes) / float64(s.Segments)
	}
	return s
}

// Layout is a flattened layout: the blocks of count elements of a type at a
// base address, with their statistics. It is immutable and shared between
// callers; do not modify IOVs.
type Layout struct {
	Type  *Type
	Base  uintptr
	Count int64
	IOVs  []IOV
	Stats Stats
}

type cacheKey struct {
	t     *Type
	base  uintptr
	count int64
}

type cacheEntry struct {
	key    cacheKey
	done   chan struct{} // closed when layout or err is set
	layout *Layout
	err    error
	elem   *list.Element // in the LRU list once complete; nil while computing
}

// LayoutCache maps (type, base address, count) to the flattened layout and
// its statistics, computed once per key. It is safe for concurrent use;
// concurrent misses on one key compute it once. It holds at most maxSegments
// segments in total, a layout with none counting as one, evicting least
// recently used layouts; a layout larger than the bound is returned but not
// kept. Entries of a type are evicted when
// the type is freed.
type LayoutCache struct {
	mu          sync.Mutex
	maxSegments int64
	segments    int64 // segments of the layouts held
	charged     int64 // what they count against maxSegments (cacheCost)
	entries     map[cacheKey]*cacheEntry
	lru         list.List // front = most recent; values *cacheEntry
	hits, miss  int64
}

// NewLayoutCache returns a cache bounded to maxSegments segments in total
// (each costs 16 bytes); maxSegments <= 0 selects 1<<20.
func NewLayoutCache(maxSegments int64) *LayoutCache {
	if maxSegments <= 0 {
		maxSegments = 1 << 20
	}
	return &LayoutCache{maxSegments: maxSegments, entries: make(map[cacheKey]*cacheEntry)}
}

// Flatten computes the layout of count elements of t at base without a cache.
func Flatten(t *Type, base uintptr, count int64) (*Layout, error) {
	seq, err := t.Segments(count, 0, -1)
	if err != nil {
		return nil, err
	}
	l := &Layout{Type: t, Base: base, Count: count}
	var segs []Segment
	for s := range seq {
		segs = append(segs, s)
	}
	l.Stats = ComputeStats(segs)
	l.IOVs = make([]IOV, len(segs))
	for i, s := range segs {
		l.IOVs[i] = IOV{Addr: base + uintptr(s.Off), Len: s.Len}
	}
	return l, nil
}

// Get returns the layout of count elements of t at base address base,
// flattening it on a miss.
func (c *LayoutCache) Get(t *Type, base uintptr, count int64) (*Layout, error) {
	if err := usable(t, "LayoutCache.Get: type"); err != nil {
		return nil, err
	}
	if count < 0 {
		return nil, invalid("LayoutCache.Get: negative count %d", count)
	}
	k := cacheKey{t, base, count}
	c.mu.Lock()
	if e, ok := c.entries[k]; ok {
		c.hits++
		if e.elem != nil {
			c.lru.MoveToFront(e.elem)
		}
		c.mu.Unlock()
		<-e.done
		return e.layout, e.err
	}
	c.miss++
	e := &cacheEntry{key: k, done: make(chan struct{})}
	c.entries[k] = e
	c.mu.Unlock()

	// Register for eviction on Free before checking freed (see Type.Free).
	// The type holds the cache weakly: a cache nobody uses any more must
	// not live on in the types it served (named types live for ever).
	wc := weak.Make(c)
	t.mu.Lock()
	if _, ok := t.caches[wc]; !ok {
		if t.caches == nil {
			t.caches = make(map[weak.Pointer[LayoutCache]]struct{})
		}
		for k := range t.caches {
			if k.Value() == nil {
				delete(t.caches, k) // a collected cache
			}
		}
		t.caches[wc] = struct{}{}
	}
	t.mu.Unlock()

	l, err := Flatten(t, base, count)
	c.mu.Lock()
	e.layout, e.err = l, err
	close(e.done)
	switch {
	case c.entries[k] != e:
		// Evicted (type freed) while computing.
	case err != nil || t.freed.Load() || cacheCost(l) > c.maxSegments:
		delete(c.entries, k)
	default:
		e.elem = c.lru.PushFront(e)
		c.segments += l.Stats.Segments
		c.charged += cacheCost(l)
		for c.charged > c.maxSegments {
			c.removeLocked(c.lru.Back().Value.(*cacheEntry))
		}
	}
	c.mu.Unlock()
	return l, err
}

func (c *LayoutCache) removeLocked(e *cacheEntry) {
	delete(c.entries, e.key)
	if e.elem != nil {
		c.lru.Remove(e.elem)
		c.segments -= e.layout.Stats.Segments
		c.charged -= cacheCost(e.layout)
		e.elem = nil
	}
}

// cacheCost is what a layout counts against the bound: its segments, and
// at least one, so that layouts with no data (count 0, empty types) cannot
// grow the cache without bound.
func cacheCost(l *Layout) int64 { return max(l.Stats.Segments, 1) }

// evictType drops every entry of t; called by Type.Free.
func (c *LayoutCache) evictType(t *Type) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for k, e := range c.entries {
		if k.t == t {
			c.removeLocked(e)
		}
	}
}

// CacheStats reports the occupancy and effectiveness of a LayoutCache.
type CacheStats struct {
	Entries  int   // cached layouts (including ones being computed)
	Segments int64 // segments held
	Hits     int64 // lookups answered from the cache
	Misses   int64 // lookups that flattened
}

// Stats returns the cache's counters.
func (c *LayoutCache) Stats() CacheStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	return CacheStats{Entries: len(c.entries), Segments: c.segments, Hits: c.hits, Misses: c.miss}
}
