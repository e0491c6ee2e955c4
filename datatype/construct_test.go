package datatype_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	dt "github.com/troupe-hpc/troupe/datatype"
)

func must(t *testing.T) func(*dt.Type, error) *dt.Type {
	return func(x *dt.Type, err error) *dt.Type {
		t.Helper()
		require.NoError(t, err)
		return x
	}
}

func segs(pairs ...int64) []dt.Segment {
	var s []dt.Segment
	for i := 0; i < len(pairs); i += 2 {
		s = append(s, dt.Segment{Off: pairs[i], Len: pairs[i+1]})
	}
	return s
}

// TestHandChecked compares every constructor and query with values derived
// by hand from the MPI-4 definitions (section 5.1). For a typemap
// {(type_j, disp_j)}: lb = min disp_j (+ old lb for derived old types),
// ub = max(disp_j + ub of the copy), extent = ub - lb, true lb/ub ignore
// Resized bounds; size = sum of basic sizes.
func TestHandChecked(t *testing.T) {
	m := must(t)
	i32r := m(dt.Resized(dt.Int32, -4, 12))
	cases := []struct {
		name                   string
		t                      *dt.Type
		size, lb, ub, tlb, tub int64
		typemap                []dt.Segment // one element, merged
	}{
		// Named: {(int32, 0)}, lb 0, ub 4.
		{"int32", dt.Int32, 4, 0, 4, 0, 4, segs(0, 4)},
		{"complex128", dt.Complex128, 16, 0, 16, 0, 16, segs(0, 16)},
		// contiguous(3, int32) = {(int32,0),(int32,4),(int32,8)}.
		{"contiguous", m(dt.Contiguous(3, dt.Int32)), 12, 0, 12, 0, 12, segs(0, 12)},
		// contiguous(0, x): empty typemap, lb = ub = 0.
		{"contiguous0", m(dt.Contiguous(0, dt.Int32)), 0, 0, 0, 0, 0, nil},
		// vector(3, 2, 4, f64): blocks of 2 at 0, 4*8=32, 64 bytes: ub = 64+16.
		{"vector", m(dt.Vector(3, 2, 4, dt.Float64)), 48, 0, 80, 0, 80, segs(0, 16, 32, 16, 64, 16)},
		// vector(3, 1, -2, int32): blocks at 0, -8, -16 in typemap order.
		{"vector-neg", m(dt.Vector(3, 1, -2, dt.Int32)), 12, -16, 4, -16, 4, segs(0, 4, -8, 4, -16, 4)},
		{"vector-zero-blocklen", m(dt.Vector(5, 0, 3, dt.Int32)), 0, 0, 0, 0, 0, nil},
		// hvector(2, 3, 100, int16): 6 bytes at 0 and at 100.
		{"hvector", m(dt.HVector(2, 3, 100, dt.Int16)), 12, 0, 106, 0, 106, segs(0, 6, 100, 6)},
		// indexed({2,1}, {4,0}, int32): 8 bytes at 16, then 4 at 0.
		{"indexed", m(dt.Indexed([]int64{2, 1}, []int64{4, 0}, dt.Int32)), 12, 0, 24, 0, 24, segs(16, 8, 0, 4)},
		// indexed with a zero block: it contributes no bounds.
		{"indexed-zero", m(dt.Indexed([]int64{0, 1}, []int64{-10, 2}, dt.Int32)), 4, 8, 12, 8, 12, segs(8, 4)},
		// hindexed({1,1}, {-8, 8}, f64).
		{"hindexed", m(dt.HIndexed([]int64{1, 1}, []int64{-8, 8}, dt.Float64)), 16, -8, 16, -8, 16, segs(-8, 8, 8, 8)},
		// indexed_block(2, {0, 3}, int16): 4 bytes at 0 and at 6 (touching: 4 < 6).
		{"indexed_block", m(dt.IndexedBlock(2, []int64{0, 3}, dt.Int16)), 8, 0, 10, 0, 10, segs(0, 4, 6, 4)},
		// hindexed_block(1, {5, 0, 1}, byte): 0 and 1 touch and merge.
		{"hindexed_block", m(dt.HIndexedBlock(1, []int64{5, 0, 1}, dt.Byte)), 3, 0, 6, 0, 6, segs(5, 1, 0, 2)},
		// struct({1,2}, {0,8}, {int32, f64}): no alignment epsilon.
		{"struct", m(dt.Struct([]int64{1, 2}, []int64{0, 8}, []*dt.Type{dt.Int32, dt.Float64})), 20, 0, 24, 0, 24, segs(0, 4, 8, 16)},
		// struct{f64 at 0, int8 at 8}: extent 9 (MPI with alignment epsilon would say 16).
		{"struct-noeps", m(dt.Struct([]int64{1, 1}, []int64{0, 8}, []*dt.Type{dt.Float64, dt.Int8})), 9, 0, 9, 0, 9, segs(0, 9)},
		// struct with a zero-count field far away: ignored for bounds.
		{"struct-zero", m(dt.Struct([]int64{0, 1}, []int64{-100, 8}, []*dt.Type{dt.Int32, dt.Int32})), 4, 8, 12, 8, 12, segs(8, 4)},
		// resized(int32, -4, 12): lb -4, ub 8; true bounds stay 0, 4.
		{"resized", i32r, 4, -4, 8, 0, 4, segs(0, 4)},
		// contiguous(2, resized): copies at 0 and 12; lb -4, ub 8+12.
		{"contiguous-resized", m(dt.Contiguous(2, i32r)), 8, -4, 20, 0, 16, segs(0, 4, 12, 4)},
		// vector(2, 1, 3, resized(int32, 0, 8)): extent(old) 8, blocks at 0, 24.
		{"vector-resized", m(dt.Vector(2, 1, 3, m(dt.Resized(dt.Int32, 0, 8)))), 8, 0, 32, 0, 28, segs(0, 4, 24, 4)},
		// subarray C {4,5} sub {2,3} start {1,2} int32: rows of 20 bytes;
		// data at 1*20+2*4 = 28 and 48, 12 bytes each; lb 0, ub 80.
		{"subarray-c", m(dt.Subarray([]int64{4, 5}, []int64{2, 3}, []int64{1, 2}, dt.OrderC, dt.Int32)), 24, 0, 80, 28, 60, segs(28, 12, 48, 12)},
		// Fortran order: element (i,j) at (i + 4j)*4: data at 36, 52, 68.
		{"subarray-f", m(dt.Subarray([]int64{4, 5}, []int64{2, 3}, []int64{1, 2}, dt.OrderFortran, dt.Int32)), 24, 0, 80, 36, 76, segs(36, 8, 52, 8, 68, 8)},
		// An empty subarray keeps the array's extent.
		{"subarray-empty", m(dt.Subarray([]int64{4}, []int64{0}, []int64{4}, dt.OrderC, dt.Int32)), 0, 0, 16, 0, 0, nil},
		{"dup", m(dt.Dup(i32r)), 4, -4, 8, 0, 4, segs(0, 4)},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			x := c.t
			require.Equal(t, c.size, x.Size(), "size")
			require.Equal(t, c.lb, x.LB(), "lb")
			require.Equal(t, c.ub, x.UB(), "ub")
			require.Equal(t, c.ub-c.lb, x.Extent(), "extent")
			require.Equal(t, c.tlb, x.TrueLB(), "true lb")
			require.Equal(t, c.tub-c.tlb, x.TrueExtent(), "true extent")
			tm, err := x.Typemap(1)
			require.NoError(t, err)
			require.Equal(t, c.typemap, tm, "typemap")
			require.NoError(t, x.Commit())
		})
	}
}

func TestDupIdentity(t *testing.T) {
	v := must(t)(dt.Vector(2, 1, 2, dt.Int32))
	d := must(t)(dt.Dup(v))
	require.NotSame(t, v, d)
	require.Equal(t, dt.CombinerDup, d.Combiner())
	require.NoError(t, v.Free())
	// A type built from a freed type stays valid (MPI semantics).
	tm, err := d.Typemap(1)
	require.NoError(t, err)
	require.Equal(t, segs(0, 4, 8, 4), tm)
}

func TestErrors(t *testing.T) {
	m := must(t)
	freed := m(dt.Contiguous(2, dt.Int8))
	require.NoError(t, freed.Free())
	cases := []struct {
		name string
		err  error
		is   error
	}{
		{"negative count", second(dt.Contiguous(-1, dt.Int32)), dt.ErrInvalidArgument},
		{"negative blocklen", second(dt.Vector(1, -1, 1, dt.Int32)), dt.ErrInvalidArgument},
		{"nil type", second(dt.Contiguous(1, nil)), dt.ErrInvalidArgument},
		{"freed type", second(dt.Contiguous(1, freed)), dt.ErrFreed},
		{"double free", freed.Free(), dt.ErrFreed},
		{"free named", dt.Int32.Free(), dt.ErrInvalidArgument},
		{"indexed lengths", second(dt.Indexed([]int64{1}, []int64{1, 2}, dt.Int32)), dt.ErrInvalidArgument},
		{"struct lengths", second(dt.Struct([]int64{1}, []int64{0}, nil)), dt.ErrInvalidArgument},
		{"struct nil", second(dt.Struct([]int64{1}, []int64{0}, []*dt.Type{nil})), dt.ErrInvalidArgument},
		{"subarray range", second(dt.Subarray([]int64{4}, []int64{3}, []int64{2}, dt.OrderC, dt.Int32)), dt.ErrInvalidArgument},
		{"subarray dims", second(dt.Subarray(nil, nil, nil, dt.OrderC, dt.Int32)), dt.ErrInvalidArgument},
		{"subarray order", second(dt.Subarray([]int64{1}, []int64{1}, []int64{0}, 7, dt.Int32)), dt.ErrInvalidArgument},
		{"resized extent", second(dt.Resized(dt.Int32, 0, -1)), dt.ErrInvalidArgument},
		{"size overflow", second(dt.Contiguous(1<<61, dt.Float64)), dt.ErrOverflow},
		{"stride overflow", second(dt.Vector(2, 1, 1<<62, dt.Float64)), dt.ErrOverflow},
		{"nested overflow", second(dt.Contiguous(1<<40, m(dt.Contiguous(1<<30, dt.Byte)))), dt.ErrOverflow},
		{"resized overflow", second(dt.Resized(dt.Int32, 1<<62, 1<<62)), dt.ErrOverflow},
		{"struct freed member", second(dt.Struct([]int64{1}, []int64{0}, []*dt.Type{freed})), dt.ErrFreed},
		{"indexed block negative, no blocks", second(dt.IndexedBlock(-1, nil, dt.Int32)), dt.ErrInvalidArgument},
		{"hindexed block negative, no blocks", second(dt.HIndexedBlock(-1, []int64{}, dt.Int32)), dt.ErrInvalidArgument},
		{"count overflow", second(dt.Int64.PackedSize(1 << 61)), dt.ErrOverflow},
		// Extent 0 members whose data lie 2^62 bytes either side of the
		// origin: the extent fits, the true extent (2^63+1) does not.
		{"true extent overflow", second(dt.Struct([]int64{1, 1}, []int64{0, 0}, []*dt.Type{
			m(dt.Resized(m(dt.HIndexed([]int64{1, 1}, []int64{-1 << 62, 0}, dt.Byte)), 0, 0)),
			m(dt.Resized(m(dt.HIndexed([]int64{1, 1}, []int64{0, 1 << 62}, dt.Byte)), 0, 0)),
		})), dt.ErrOverflow},
		// Data at -2^62 and 2^62-2 (true extent 2^63-1, the most there
		// is) and extent 1: two elements span 2^63 bytes.
		{"true extent overflow over a count", second(m(dt.Resized(m(dt.HIndexed([]int64{1, 1}, []int64{-1 << 62, 1<<62 - 2}, dt.Byte)), 0, 1)).Segments(2, 0, -1)), dt.ErrOverflow},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			require.Error(t, c.err)
			require.True(t, errors.Is(c.err, c.is), "%v is not %v", c.err, c.is)
			require.True(t, errors.Is(c.err, dt.ErrInvalidArgument), "%v", c.err)
		})
	}
	// Buffers too small or origins outside them.
	v := m(dt.Vector(2, 1, 2, dt.Int32)) // data at 0 and 8
	_, err := v.Pack(make([]byte, 8), make([]byte, 11), 0, 1)
	require.ErrorIs(t, err, dt.ErrInvalidArgument)
	_, err = v.Pack(make([]byte, 4), make([]byte, 12), 0, 1)
	require.ErrorIs(t, err, dt.ErrInvalidArgument)
	_, err = v.Pack(make([]byte, 8), make([]byte, 12), -1, 1)
	require.ErrorIs(t, err, dt.ErrInvalidArgument)
	_, err = v.PackRange(make([]byte, 8), make([]byte, 12), 0, 1, 9)
	require.ErrorIs(t, err, dt.ErrInvalidArgument)
	_, err = v.Unpack(make([]byte, 12), make([]byte, 8), 0, -1)
	require.ErrorIs(t, err, dt.ErrInvalidArgument)
}

func second[T any](_ T, err error) error { return err }

func TestSignature(t *testing.T) {
	m := must(t)
	s := m(dt.Struct([]int64{1, 2}, []int64{0, 8}, []*dt.Type{dt.Int32, dt.Float64}))
	runs, err := s.TypeSignature(10)
	require.NoError(t, err)
	require.Equal(t, "[{int32 1} {float64 2}]", fmt.Sprint(runs))
	c2 := m(dt.Contiguous(2, s))
	runs, err = c2.TypeSignature(10)
	require.NoError(t, err)
	require.Equal(t, "[{int32 1} {float64 2} {int32 1} {float64 2}]", fmt.Sprint(runs))
	_, err = c2.TypeSignature(3)
	require.ErrorIs(t, err, dt.ErrInvalidArgument)

	hash := func(x *dt.Type, count int64) dt.Signature {
		h, err := x.SignatureHash(count)
		require.NoError(t, err)
		return h
	}
	// Same sequence of four float64, four different layouts.
	a := hash(m(dt.Contiguous(4, dt.Float64)), 1)
	require.Equal(t, a, hash(m(dt.Vector(2, 2, 5, dt.Float64)), 1))
	require.Equal(t, a, hash(m(dt.HIndexed([]int64{3, 1}, []int64{100, 0}, dt.Float64)), 1))
	require.Equal(t, a, hash(m(dt.Contiguous(2, dt.Float64)), 2))
	require.Equal(t, a, hash(dt.Float64, 4))
	// Different basic types or order differ, even with equal sizes.
	require.NotEqual(t, a, hash(m(dt.Contiguous(4, dt.Int64)), 1))
	require.NotEqual(t, a, hash(m(dt.Contiguous(8, dt.Float32)), 1))
	require.NotEqual(t, hash(s, 1), hash(m(dt.Struct([]int64{2, 1}, []int64{0, 16}, []*dt.Type{dt.Float64, dt.Int32})), 1))
	// A billion blocks hash in O(log n).
	big := hash(m(dt.Vector(1_000_000_000, 1, 2, dt.Float64)), 3)
	require.Equal(t, big, hash(m(dt.Contiguous(3_000_000_000, dt.Float64)), 1))
	require.Equal(t, int64(3_000_000_000), big.Elements)
}

// TestSignatureOfSharedParts: a type that uses another twice at every
// level of a 40-level nesting (a struct of a type and its dup) has a
// signature of 2^40 int32 in one run. Expanding every use anew took
// 2^depth steps (a second at 24 levels); each type is expanded once.
func TestSignatureOfSharedParts(t *testing.T) {
	m := must(t)
	x := dt.Int32
	for range 40 {
		x = m(dt.Struct([]int64{1, 1}, []int64{0, x.Extent()}, []*dt.Type{x, m(dt.Dup(x))}))
	}
	runs, err := x.TypeSignature(4)
	require.NoError(t, err)
	require.Equal(t, []dt.SigRun{{Type: dt.Int32, Count: 1 << 40}}, runs)
	y := m(dt.Struct([]int64{1, 1}, []int64{0, 4}, []*dt.Type{dt.Int32, dt.Float32}))
	for range 40 {
		y = m(dt.Struct([]int64{1, 1}, []int64{0, y.Extent()}, []*dt.Type{y, m(dt.Dup(y))}))
	}
	_, err = y.TypeSignature(64)
	require.ErrorIs(t, err, dt.ErrInvalidArgument) // 2^41 runs alternate
}

func TestHugeVectorIsCompact(t *testing.T) {
	v := must(t)(dt.Vector(1_000_000_000, 1, 3, dt.Float64))
	it, err := v.NewIterator(1)
	require.NoError(t, err)
	require.NoError(t, it.SetPos(8*999_999_998))
	buf := make([]dt.Segment, 8)
	got, n := it.Next(buf, 100)
	require.Equal(t, int64(16), n)
	require.Equal(t, segs(24*999_999_998, 8, 24*999_999_999, 8), got)
	require.True(t, it.Done())
}

// Resized puts lb and ub markers in the typemap (MPI-4 section 5.1.7:
// "Any previous lb and ub markers are erased, and a new pair ... are put
// in the positions indicated by the lb and extent arguments"), and where a
// typemap holds markers, lb is the lowest lb marker and ub the highest ub
// marker, whatever the data. So in a Struct of a resized type and a plain
// one, the plain member's data do not move the bounds:
//
//	r = Resized(int32, 0, 4)           = {(lb,0), (int32,0), (ub,4)}
//	Struct({1,1}, {0,-4}, {r, int32})  = {(lb,0), (int32,0), (ub,4), (int32,-4)}: lb 0, ub 4
//	Struct({1,1}, {0,8}, {r, int32})   = {(lb,0), (int32,0), (ub,4), (int32,8)}:  lb 0, ub 4
//
// (true bounds ignore markers: -4..4 and 0..12). Subarray is defined
// through Resized, so it carries markers too; a Contiguous of such a
// struct steps by the marked extent. Open MPI 4.1.4 gives every value
// checked here; MPICH 4.0.2 ignores the markers (extent 8 and 12 for the
// first two structs).
func TestBoundMarkers(t *testing.T) {
	m := must(t)
	r := m(dt.Resized(dt.Int32, 0, 4))
	below := m(dt.Struct([]int64{1, 1}, []int64{0, -4}, []*dt.Type{r, dt.Int32}))
	require.Equal(t, []int64{0, 4, 4, -4, 4}, []int64{below.LB(), below.UB(), below.Extent(), below.TrueLB(), below.TrueUB()})
	above := m(dt.Struct([]int64{1, 1}, []int64{0, 8}, []*dt.Type{r, dt.Int32}))
	require.Equal(t, []int64{0, 4, 4, 0, 12}, []int64{above.LB(), above.UB(), above.Extent(), above.TrueLB(), above.TrueUB()})
	two := m(dt.Contiguous(2, above))
	tm, err := two.Typemap(1)
	require.NoError(t, err)
	require.Equal(t, segs(0, 4, 8, 4, 4, 4, 12, 4), tm, "the second copy steps by the marked extent 4")
	require.Equal(t, []int64{0, 8, 0, 16}, []int64{two.LB(), two.UB(), two.TrueLB(), two.TrueUB()})
	// A subarray (4 int32, the middle two) next to a plain int32 at -8.
	sub := m(dt.Subarray([]int64{4}, []int64{2}, []int64{1}, dt.OrderC, dt.Int32))
	mixed := m(dt.Struct([]int64{1, 1}, []int64{0, -8}, []*dt.Type{sub, dt.Int32}))
	require.Equal(t, []int64{0, 16, -8, 12}, []int64{mixed.LB(), mixed.UB(), mixed.TrueLB(), mixed.TrueUB()})
	// Without markers the members' data set the bounds as before.
	plain := m(dt.Struct([]int64{1, 1}, []int64{0, -4}, []*dt.Type{dt.Int32, dt.Int32}))
	require.Equal(t, []int64{-4, 4}, []int64{plain.LB(), plain.UB()})
	// Dup keeps the markers.
	dup := m(dt.Dup(r))
	require.Equal(t, []int64{0, 4}, []int64{m(dt.Struct([]int64{1, 1}, []int64{0, 8}, []*dt.Type{dup, dt.Int32})).LB(),
		m(dt.Struct([]int64{1, 1}, []int64{0, 8}, []*dt.Type{dup, dt.Int32})).UB()})
}

// Any number of copies of an empty type is an empty type: no size,
// extent or displacement overflows, so no constructor reports ErrOverflow
// (they once multiplied the counts for the signature regardless).
func TestEmptyTypeHugeCounts(t *testing.T) {
	m := must(t)
	empty := m(dt.Contiguous(0, dt.Int32))
	for name, x := range map[string]*dt.Type{
		"Contiguous": m(dt.Contiguous(1<<62, empty)),
		"Vector":     m(dt.Vector(1<<62, 2, 1, empty)),
		"HIndexed":   m(dt.HIndexed([]int64{1 << 62, 1 << 62}, []int64{0, 0}, empty)),
		"Struct":     m(dt.Struct([]int64{1 << 62, 1 << 62}, []int64{0, 0}, []*dt.Type{empty, empty})),
		"Subarray":   m(dt.Subarray([]int64{1 << 40, 1 << 40}, []int64{1 << 40, 1 << 40}, []int64{0, 0}, dt.OrderC, empty)),
	} {
		require.Equal(t, []int64{0, 0, 0, 0}, []int64{x.Size(), x.LB(), x.UB(), x.Elements()}, name)
	}
	// A resized empty type has an extent: copies of it do overflow.
	wide := m(dt.Resized(empty, 0, 8))
	_, err := dt.Contiguous(1<<62, wide)
	require.ErrorIs(t, err, dt.ErrOverflow)
}
