package transport

import (
	"errors"
	"fmt"
	"testing"
)

// span is one mapped range as the recording map function saw it.
type span struct{ start, end uintptr }

func (s span) String() string { return fmt.Sprintf("[%#x,%#x)", s.start, s.end) }

// recorder is a map/unmap function pair that records every call.
type recorder struct {
	t        *testing.T
	mapped   []span
	unmapped []span
	live     map[*span]bool
	failNext error
}

func newRecorder(t *testing.T, maxUnused int) (*regCache, *recorder) {
	rec := &recorder{t: t, live: map[*span]bool{}}
	c := newRegCache(maxUnused, func(start, end uintptr) (any, error) {
		if err := rec.failNext; err != nil {
			rec.failNext = nil
			return nil, err
		}
		if start%pageSize != 0 || end%pageSize != 0 || end <= start {
			t.Errorf("map of unaligned or empty range [%#x,%#x)", start, end)
		}
		s := &span{start, end}
		rec.mapped = append(rec.mapped, *s)
		rec.live[s] = true
		return s, nil
	}, func(h any) {
		s := h.(*span)
		if !rec.live[s] {
			t.Errorf("unmap of %v, which is not mapped (double unmap?)", *s)
		}
		delete(rec.live, s)
		rec.unmapped = append(rec.unmapped, *s)
	})
	return c, rec
}

// base is a page-aligned fake address; nothing is dereferenced.
var base = 1 << 30 / pageSize * pageSize

func pg(n int) uintptr { return uintptr(n) * pageSize }

func (r *recorder) expectMapped(want ...span) {
	r.t.Helper()
	if fmt.Sprint(r.mapped) != fmt.Sprint(want) {
		r.t.Fatalf("mapped %v, want %v", r.mapped, want)
	}
}

func (r *recorder) expectUnmapped(want ...span) {
	r.t.Helper()
	if fmt.Sprint(r.unmapped) != fmt.Sprint(want) {
		r.t.Fatalf("unmapped %v, want %v", r.unmapped, want)
	}
}

func acquire(t *testing.T, c *regCache, addr uintptr, n int) *regEntry {
	t.Helper()
	e, err := c.acquire(addr, n)
	if err != nil {
		t.Fatalf("acquire(%#x, %d): %v", addr, n, err)
	}
	if e.start > addr || e.end < addr+uintptr(n) {
		t.Fatalf("acquire(%#x, %d) returned [%#x,%#x), which does not cover it", addr, n, e.start, e.end)
	}
	return e
}

func expectStats(t *testing.T, c *regCache, want RegCacheStats) {
	t.Helper()
	if got := c.snapshot(); got != want {
		t.Fatalf("stats %+v, want %+v", got, want)
	}
}

func TestRegCachePageGranularity(t *testing.T) {
	c, rec := newRecorder(t, 8)
	acquire(t, c, base+5, 1)                 // one byte inside the first page
	acquire(t, c, base+pg(2)+pageSize-1, 2)  // straddles pages 2 and 3
	acquire(t, c, base+pg(5), 0)             // an empty range still maps a page
	acquire(t, c, base+pg(6), int(pageSize)) // exactly one page
	rec.expectMapped(
		span{base, base + pg(1)},
		span{base + pg(2), base + pg(4)},
		span{base + pg(5), base + pg(6)},
		span{base + pg(6), base + pg(7)},
	)
	expectStats(t, c, RegCacheStats{Misses: 4, Entries: 4})
	for i := 1; i < len(c.entries); i++ {
		if c.entries[i-1].start > c.entries[i].start {
			t.Fatalf("entries not address-ordered: %#x before %#x", c.entries[i-1].start, c.entries[i].start)
		}
	}
}

func TestRegCacheHitAndMiss(t *testing.T) {
	c, rec := newRecorder(t, 8)
	e := acquire(t, c, base+100, int(pg(3))-200) // pages 0..2
	rec.expectMapped(span{base, base + pg(3)})

	// Same page, a sub-range, the exact range: hits on the same entry.
	for _, r := range []struct {
		addr uintptr
		n    int
	}{{base + 1, 10}, {base + pg(1) + 5, int(pageSize)}, {base + 100, int(pg(3)) - 200}, {base, int(pg(3))}} {
		if got := acquire(t, c, r.addr, r.n); got != e {
			t.Fatalf("acquire(%#x, %d): not a hit on the covering registration", r.addr, r.n)
		}
	}
	if e.refs != 5 {
		t.Fatalf("refs %d after 5 acquires", e.refs)
	}
	expectStats(t, c, RegCacheStats{Hits: 4, Misses: 1, Entries: 1})

	// A larger range (past the end, or starting before) is a miss.
	big := acquire(t, c, base, int(pg(4)))
	before := acquire(t, c, base-pg(1), int(pg(2)))
	if big == e || before == e || big == before {
		t.Fatal("larger ranges reused a registration that does not cover them")
	}
	rec.expectMapped(span{base, base + pg(3)}, span{base, base + pg(4)}, span{base - pg(1), base + pg(1)})
	expectStats(t, c, RegCacheStats{Hits: 4, Misses: 3, Entries: 3})
	// The larger registration now serves the sub-ranges too.
	if got := acquire(t, c, base+pg(3)+7, 9); got != big {
		t.Fatal("page 3 not served by the 4-page registration")
	}
	rec.expectUnmapped()
}

func TestRegCacheRefCount(t *testing.T) {
	c, rec := newRecorder(t, 8)
	a := acquire(t, c, base, 64)
	if acquire(t, c, base+64, 64) != a {
		t.Fatal("second acquire of the same page missed")
	}
	c.release(a)
	expectStats(t, c, RegCacheStats{Hits: 1, Misses: 1, Entries: 1, Unused: 0})
	c.release(a)
	// Unused, but cached and still mapped.
	expectStats(t, c, RegCacheStats{Hits: 1, Misses: 1, Entries: 1, Unused: 1})
	rec.expectUnmapped()
	// Extra releases are ignored.
	c.release(a)
	if a.refs != 0 {
		t.Fatalf("refs %d after an extra release", a.refs)
	}
	// Reuse takes it off the unused list.
	if acquire(t, c, base, 1) != a {
		t.Fatal("unused cached registration not reused")
	}
	expectStats(t, c, RegCacheStats{Hits: 2, Misses: 1, Entries: 1, Unused: 0})
	rec.expectMapped(span{base, base + pg(1)})
	rec.expectUnmapped()
}

func TestRegCacheMapError(t *testing.T) {
	c, rec := newRecorder(t, 8)
	boom := errors.New("boom")
	rec.failNext = boom
	if _, err := c.acquire(base, 10); !errors.Is(err, boom) {
		t.Fatalf("acquire with failing map: %v", err)
	}
	expectStats(t, c, RegCacheStats{Misses: 1})
	acquire(t, c, base, 10)
	expectStats(t, c, RegCacheStats{Misses: 2, Entries: 1})
}

func TestRegCacheLRUEviction(t *testing.T) {
	c, rec := newRecorder(t, 2)
	A := acquire(t, c, base+pg(0), 1)
	B := acquire(t, c, base+pg(2), 1)
	C := acquire(t, c, base+pg(4), 1)
	D := acquire(t, c, base+pg(6), 1) // stays in use throughout
	sa, sb, sc := span{A.start, A.end}, span{B.start, B.end}, span{C.start, C.end}

	c.release(A)
	c.release(B)
	rec.expectUnmapped()
	expectStats(t, c, RegCacheStats{Misses: 4, Entries: 4, Unused: 2})
	c.release(C) // three unused > 2: the oldest (A) goes
	rec.expectUnmapped(sa)
	expectStats(t, c, RegCacheStats{Misses: 4, Evictions: 1, Entries: 3, Unused: 2})

	// Touching B makes C the oldest unused one.
	if acquire(t, c, base+pg(2)+3, 1) != B {
		t.Fatal("B not reused")
	}
	c.release(B)
	E := acquire(t, c, base+pg(8), 1)
	c.release(E)
	rec.expectUnmapped(sa, sc)
	// A was evicted: acquiring it again registers anew.
	A2 := acquire(t, c, base, 1)
	if A2 == A {
		t.Fatal("evicted registration came back")
	}
	c.release(A2) // now B is the oldest unused
	rec.expectUnmapped(sa, sc, sb)
	expectStats(t, c, RegCacheStats{Hits: 1, Misses: 6, Evictions: 3, Entries: 3, Unused: 2})
	// Used entries are never evicted.
	if D.refs != 1 || !containsEntry(c, D) {
		t.Fatal("in-use registration evicted")
	}
}

func containsEntry(c *regCache, e *regEntry) bool {
	for _, x := range c.entries {
		if x == e {
			return true
		}
	}
	return false
}

func TestRegCacheInvalidate(t *testing.T) {
	c, rec := newRecorder(t, 8)
	unused := acquire(t, c, base, int(pg(2)))      // pages 0-1, released below
	used := acquire(t, c, base+pg(2), int(pg(2)))  // pages 2-3, stays in use
	other := acquire(t, c, base+pg(5), int(pg(1))) // page 5, not overlapping
	c.release(unused)
	c.release(other)
	su, sused := span{unused.start, unused.end}, span{used.start, used.end}

	// A range touching page 1 and page 2 overlaps both the unused and the used entries.
	if n := c.invalidate(base+pg(1)+pageSize-1, 2); n != 2 {
		t.Fatalf("invalidate hit %d registrations, want 2", n)
	}
	rec.expectUnmapped(su) // the unused one at once
	expectStats(t, c, RegCacheStats{Misses: 3, Invalidations: 2, Entries: 2, Unused: 1})
	// Invalidating again does not count the used, already invalid entry twice.
	if n := c.invalidate(base+pg(2), 1); n != 0 {
		t.Fatalf("second invalidate hit %d, want 0", n)
	}
	// Adjacent but not overlapping: untouched.
	if n := c.invalidate(base+pg(4), int(pageSize)); n != 0 {
		t.Fatalf("invalidate of page 4 hit %d registrations", n)
	}

	// A later acquire of the invalidated memory registers anew...
	fresh := acquire(t, c, base+pg(2)+10, 10)
	if fresh == used {
		t.Fatal("acquire reused an invalidated registration")
	}
	rec.expectMapped(su, sused, span{other.start, other.end}, span{base + pg(2), base + pg(3)})
	// ...and the used one is unmapped at its last release, not cached.
	used.refs++ // a second user
	c.release(used)
	rec.expectUnmapped(su)
	c.release(used)
	rec.expectUnmapped(su, sused)
	if containsEntry(c, used) {
		t.Fatal("released invalid registration still cached")
	}
	expectStats(t, c, RegCacheStats{Misses: 4, Invalidations: 2, Entries: 2, Unused: 1})
	// The fresh registration behaves normally.
	if acquire(t, c, base+pg(2), 1) != fresh {
		t.Fatal("fresh registration not reused")
	}
}

func TestRegCacheCloseAll(t *testing.T) {
	c, rec := newRecorder(t, 8)
	a := acquire(t, c, base, 1)
	acquire(t, c, base+pg(3), 1) // in use
	acquire(t, c, base+pg(6), 1)
	c.release(a)
	inv := acquire(t, c, base+pg(9), 1)
	c.invalidate(base+pg(9), 1) // invalid but in use
	_ = inv
	c.closeAll()
	if len(rec.live) != 0 {
		t.Fatalf("%d registrations still mapped after closeAll", len(rec.live))
	}
	if len(rec.unmapped) != 4 {
		t.Fatalf("closeAll unmapped %d registrations, want 4", len(rec.unmapped))
	}
	s := c.snapshot()
	if s.Entries != 0 || s.Unused != 0 {
		t.Fatalf("after closeAll: %+v", s)
	}
}

// TestRegisterCacheThroughTransport drives the cache through the real
// Register/Deregister with UCX memory registration.
func TestRegisterCacheThroughTransport(t *testing.T) {
	ts := localJob(t, 1, ProgressDirect)
	tr := ts[0]
	// A page-aligned window inside a larger allocation, so that no other
	// registration shares its pages.
	raw := make([]byte, 8*int(pageSize))
	off := int(pageSize - uintptr(bytesPtr(raw))%pageSize)
	buf := raw[off : off+4*int(pageSize)]

	s0 := tr.RegCacheStats()
	r1, err := tr.Register(buf)
	if err != nil {
		t.Fatal(err)
	}
	k1 := r1.Key()
	if k1.Len != len(buf) || k1.Addr != uint64(uintptr(bytesPtr(buf))) || len(k1.Packed) == 0 {
		t.Fatalf("key %+v", k1)
	}
	r2, err := tr.Register(buf[10:100])
	if err != nil {
		t.Fatal(err)
	}
	s := tr.RegCacheStats()
	if s.Misses != s0.Misses+1 || s.Hits != s0.Hits+1 {
		t.Fatalf("two registrations of the same memory: %+v (before %+v), want one miss and one hit", s, s0)
	}
	r1.Release()
	r2.Release()
	if s = tr.RegCacheStats(); s.Unused != s0.Unused+1 {
		t.Fatalf("released registration not cached: %+v", s)
	}
	// Registering it again is a hit on the cached registration.
	r3, err := tr.Register(buf)
	if err != nil {
		t.Fatal(err)
	}
	if s = tr.RegCacheStats(); s.Hits != s0.Hits+2 || s.Misses != s0.Misses+1 {
		t.Fatalf("re-registration: %+v", s)
	}
	// Deregister invalidates it (still in use: unmapped at release).
	if n := tr.Deregister(buf); n != 1 {
		t.Fatalf("Deregister invalidated %d registrations, want 1", n)
	}
	r4, err := tr.Register(buf)
	if err != nil {
		t.Fatal(err)
	}
	if s = tr.RegCacheStats(); s.Misses != s0.Misses+2 || s.Invalidations != s0.Invalidations+1 {
		t.Fatalf("registration after Deregister: %+v, want a miss", s)
	}
	r3.Release()
	if s = tr.RegCacheStats(); s.Entries != s0.Entries+1 {
		t.Fatalf("invalidated registration still cached after release: %+v", s)
	}
	r4.Release()
	r4.Release() // idempotent
	if n := tr.Deregister(buf); n != 1 {
		t.Fatalf("Deregister of the unused registration: %d", n)
	}
	if s = tr.RegCacheStats(); s.Entries != s0.Entries || s.Unused != s0.Unused {
		t.Fatalf("after final Deregister: %+v (before %+v)", s, s0)
	}
	if _, err := tr.Register(nil); !errors.Is(err, ErrInvalid) {
		t.Fatalf("Register(nil): %v", err)
	}
}
