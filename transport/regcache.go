package transport

import (
	"container/list"
	"os"
	"sort"
)

var pageSize = uintptr(os.Getpagesize())

const defaultRegCacheUnused = 256

// regEntry is one registration: a page-aligned address range.
type regEntry struct {
	start, end uintptr
	refs       int
	invalid    bool
	handle     any // what the map function returned
	lru        *list.Element
}

// RegCacheStats counts registration cache activity.
type RegCacheStats struct {
	Hits, Misses, Evictions, Invalidations int
	Entries, Unused                        int `metric:",gauge"`
}

// regCache is an address-ordered, page-granular, reference-counted cache of
// memory registrations. Unused registrations stay cached (for reuse by a
// later registration of the same memory) up to maxUnused, evicted least
// recently used first; invalidate drops every registration that overlaps a
// range. Not safe for concurrent use: the transport holds its worker lock.
type regCache struct {
	entries   []*regEntry // sorted by start
	unused    *list.List  // of *regEntry with refs == 0, front = most recent
	maxUnused int
	maxLen    uintptr // longest registration: bounds the backward scan
	mapFn     func(start, end uintptr) (any, error)
	unmapFn   func(handle any)
	stats     RegCacheStats
}

func newRegCache(maxUnused int, mapFn func(start, end uintptr) (any, error), unmapFn func(any)) *regCache {
	return &regCache{unused: list.New(), maxUnused: maxUnused, mapFn: mapFn, unmapFn: unmapFn}
}

func pageRange(addr uintptr, n int) (uintptr, uintptr) {
	start := addr &^ (pageSize - 1)
	end := (addr + uintptr(n) + pageSize - 1) &^ (pageSize - 1)
	if end == start {
		end = start + pageSize
	}
	return start, end
}

// acquire returns a registration covering [addr, addr+n), reusing a cached one
// when one covers the range.
func (c *regCache) acquire(addr uintptr, n int) (*regEntry, error) {
	start, end := pageRange(addr, n)
	// Entries are sorted by start: candidates start at or before start.
	i := sort.Search(len(c.entries), func(i int) bool { return c.entries[i].start > start })
	for j := i - 1; j >= 0 && c.entries[j].start+c.maxLen >= end; j-- {
		e := c.entries[j]
		if e.end >= end && !e.invalid {
			c.stats.Hits++
			c.ref(e)
			return e, nil
		}
	}
	c.stats.Misses++
	h, err := c.mapFn(start, end)
	if err != nil {
		return nil, err
	}
	e := &regEntry{start: start, end: end, handle: h}
	c.maxLen = max(c.maxLen, end-start)
	c.entries = append(c.entries, nil)
	copy(c.entries[i+1:], c.entries[i:])
	c.entries[i] = e
	c.ref(e)
	return e, nil
}

func (c *regCache) ref(e *regEntry) {
	if e.lru != nil {
		c.unused.Remove(e.lru)
		e.lru = nil
	}
	e.refs++
}

// release drops one reference; an unused valid entry stays cached.
func (c *regCache) release(e *regEntry) {
	if e.refs <= 0 {
		return
	}
	e.refs--
	if e.refs > 0 {
		return
	}
	if e.invalid {
		c.drop(e)
		return
	}
	e.lru = c.unused.PushFront(e)
	for c.unused.Len() > c.maxUnused {
		old := c.unused.Back().Value.(*regEntry)
		c.stats.Evictions++
		c.drop(old)
	}
}

// invalidate marks every registration overlapping [addr, addr+n) invalid:
// unused ones are unmapped now, used ones when their last user releases them.
func (c *regCache) invalidate(addr uintptr, n int) int {
	start, end := pageRange(addr, n)
	var hit []*regEntry
	for _, e := range c.entries {
		if e.start < end && start < e.end && !e.invalid {
			hit = append(hit, e)
		}
	}
	for _, e := range hit {
		e.invalid = true
		c.stats.Invalidations++
		if e.refs == 0 {
			c.drop(e)
		}
	}
	return len(hit)
}

func (c *regCache) drop(e *regEntry) {
	if e.lru != nil {
		c.unused.Remove(e.lru)
		e.lru = nil
	}
	for i, x := range c.entries {
		if x == e {
			c.entries = append(c.entries[:i], c.entries[i+1:]...)
			break
		}
	}
	c.unmapFn(e.handle)
}

func (c *regCache) closeAll() {
	for _, e := range c.entries {
		c.unmapFn(e.handle)
	}
	c.entries = nil
	c.unused.Init()
}

func (c *regCache) snapshot() RegCacheStats {
	s := c.stats
	s.Entries = len(c.entries)
	s.Unused = c.unused.Len()
	return s
}
