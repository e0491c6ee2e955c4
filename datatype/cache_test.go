package datatype_test

import (
	"runtime"
	"sync"
	"testing"
	"unsafe"
	"weak"

	"github.com/stretchr/testify/require"

	dt "github.com/troupe-hpc/troupe/datatype"
)

func TestLayoutCache(t *testing.T) {
	v := must(t)(dt.Vector(4, 2, 3, dt.Float32)) // 8 bytes every 12
	c := dt.NewLayoutCache(100)
	l, err := c.Get(v, 1000, 2)
	require.NoError(t, err)
	// count 2: the second element starts at the extent, 3*4*3+8 = 44, which
	// touches the first element's last block (36..44): they merge, so 7
	// segments, one of 16 bytes.
	require.Equal(t, dt.Stats{Segments: 7, Bytes: 64, MinBlock: 8, MaxBlock: 16, AvgBlock: 64.0 / 7}, l.Stats)
	require.Equal(t, dt.IOV{Addr: 1000, Len: 8}, l.IOVs[0])
	require.Equal(t, dt.IOV{Addr: 1000 + 36, Len: 16}, l.IOVs[3])
	require.Equal(t, dt.IOV{Addr: 1000 + 44 + 36, Len: 8}, l.IOVs[6])
	l2, err := c.Get(v, 1000, 2)
	require.NoError(t, err)
	require.Same(t, l, l2)
	s := c.Stats()
	require.Equal(t, dt.CacheStats{Entries: 1, Segments: 7, Hits: 1, Misses: 1}, s)

	// Different base or count: different entries.
	_, err = c.Get(v, 2000, 2)
	require.NoError(t, err)
	_, err = c.Get(v, 1000, 1)
	require.NoError(t, err)
	require.Equal(t, 3, c.Stats().Entries)

	// Freeing the type evicts its entries.
	require.NoError(t, v.Free())
	require.Equal(t, 0, c.Stats().Entries)
	require.Equal(t, int64(0), c.Stats().Segments)
	_, err = c.Get(v, 1000, 2)
	require.ErrorIs(t, err, dt.ErrFreed)
}

func TestLayoutCacheLRU(t *testing.T) {
	v := must(t)(dt.Vector(10, 1, 2, dt.Int8)) // 10 segments per element
	c := dt.NewLayoutCache(25)
	for base := uintptr(0); base < 3; base++ {
		_, err := c.Get(v, base, 1)
		require.NoError(t, err)
	}
	// Only two layouts of 10 segments fit in 25; the oldest was evicted.
	require.Equal(t, 2, c.Stats().Entries)
	require.Equal(t, int64(20), c.Stats().Segments)
	_, err := c.Get(v, 0, 1)
	require.NoError(t, err)
	require.Equal(t, int64(4), c.Stats().Misses)
	// A layout larger than the bound is returned but not kept (3 elements:
	// 30 blocks, two pairs touch across element boundaries).
	l, err := c.Get(v, 9, 3)
	require.NoError(t, err)
	require.Equal(t, int64(28), l.Stats.Segments)
	require.Equal(t, int64(20), c.Stats().Segments)
}

// TestLayoutCacheEmptyLayouts: layouts with no segments count as one
// against the bound, so that they cannot grow the cache without limit.
func TestLayoutCacheEmptyLayouts(t *testing.T) {
	empty := must(t)(dt.Contiguous(0, dt.Int32))
	c := dt.NewLayoutCache(4)
	for base := uintptr(0); base < 1000; base++ {
		l, err := c.Get(empty, base, 1)
		require.NoError(t, err)
		require.Zero(t, l.Stats.Segments)
	}
	require.Equal(t, 4, c.Stats().Entries)
	require.Zero(t, c.Stats().Segments)
	// They give their share back when evicted: a layout of 4 segments
	// then fits alone.
	v := must(t)(dt.Vector(4, 1, 2, dt.Int8))
	_, err := c.Get(v, 0, 1)
	require.NoError(t, err)
	require.Equal(t, dt.CacheStats{Entries: 1, Segments: 4, Hits: 0, Misses: 1001}, c.Stats())
}

func TestLayoutCacheConcurrent(t *testing.T) {
	c := dt.NewLayoutCache(1 << 12)
	types := make([]*dt.Type, 4)
	for i := range types {
		types[i] = must(t)(dt.Vector(int64(8+i), 1, 2, dt.Int32))
	}
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < 200; i++ {
				x := types[(g+i)%len(types)]
				l, err := c.Get(x, uintptr(i%5), 1)
				if err == nil && l.Stats.Segments != x.Size()/4 {
					t.Errorf("segments %d", l.Stats.Segments)
				}
			}
		}(g)
	}
	// Free one type while others use it.
	require.NoError(t, types[3].Free())
	wg.Wait()
	for _, e := range []uintptr{0, 1, 2, 3, 4} {
		_, err := c.Get(types[3], e, 1)
		require.ErrorIs(t, err, dt.ErrFreed)
	}
}

func TestRawPackUnpack(t *testing.T) {
	v := must(t)(dt.Vector(3, 1, -2, dt.Int32)) // data at 0, -8, -16
	src := make([]byte, 24)
	for i := range src {
		src[i] = byte(i)
	}
	dst := make([]byte, 12)
	n, err := v.PackRaw(dt.Region{Ptr: unsafe.Pointer(&dst[0]), Len: 12}, dt.SliceRegion(src), 16, 1, 0)
	require.NoError(t, err)
	require.Equal(t, int64(12), n)
	require.Equal(t, []byte{16, 17, 18, 19, 8, 9, 10, 11, 0, 1, 2, 3}, dst)
	// A partial raw pack from packed offset 5.
	part := make([]byte, 4)
	n, err = v.PackRaw(dt.SliceRegion(part), dt.SliceRegion(src), 16, 1, 5)
	require.NoError(t, err)
	require.Equal(t, int64(4), n)
	require.Equal(t, []byte{9, 10, 11, 0}, part)
	back := make([]byte, 24)
	n, err = v.UnpackRaw(dt.SliceRegion(back), dt.SliceRegion(dst), 16, 1, 0)
	require.NoError(t, err)
	require.Equal(t, int64(12), n)
	require.Equal(t, []byte{0, 1, 2, 3, 0, 0, 0, 0, 8, 9, 10, 11, 0, 0, 0, 0, 16, 17, 18, 19, 0, 0, 0, 0}, back)
	// The user region must contain the data.
	_, err = v.PackRaw(dt.SliceRegion(dst), dt.SliceRegion(src), 8, 1, 0)
	require.ErrorIs(t, err, dt.ErrInvalidArgument)
}

// TestLayoutCacheCollectable: a cache that is no longer referenced can be
// collected with its layouts, even after serving a named type (never freed)
// or a derived type that lives on; the types must not keep it alive.
func TestLayoutCacheCollectable(t *testing.T) {
	v := must(t)(dt.Vector(1000, 1, 2, dt.Float64))
	use := func(x *dt.Type) weak.Pointer[dt.LayoutCache] {
		c := dt.NewLayoutCache(1 << 20)
		if _, err := c.Get(x, 4096, 100); err != nil {
			t.Fatal(err)
		}
		return weak.Make(c)
	}
	for _, x := range []*dt.Type{dt.Float64, v} {
		w := use(x)
		runtime.GC()
		runtime.GC()
		if w.Value() != nil {
			t.Fatalf("a dropped LayoutCache that served %s is still reachable", x)
		}
	}
	runtime.KeepAlive(v)
	// Freeing a type still evicts its entries from the caches alive.
	c := dt.NewLayoutCache(1 << 20)
	_, err := c.Get(v, 4096, 1)
	require.NoError(t, err)
	runtime.GC()
	require.NoError(t, v.Free())
	require.Equal(t, 0, c.Stats().Entries)
}
