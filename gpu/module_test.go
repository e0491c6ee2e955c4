package gpu

import (
	"encoding/binary"
	"errors"
	"math"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/troupe-hpc/troupe/internal/cudatest"
)

// The module tests' kernels: CUDA source and the PTX generated from it.
const (
	testKernelSource = "testdata/kernels/test.cu"
	testKernelPTX    = "testdata/kernels/test.ptx"
)

// TestPTXUpToDate: the committed PTX is what clang makes of the source now
// (skipped without clang; `make ptx` regenerates it).
func TestPTXUpToDate(t *testing.T) {
	for src, ptx := range map[string]string{testKernelSource: testKernelPTX, "agent.cu": "agent.ptx"} {
		err := cudatest.CheckPTX(src, ptx)
		if errors.Is(err, cudatest.ErrNoClang) {
			t.Skipf("PTX not checked: %v", err)
		}
		require.NoError(t, err)
	}
}

// args8 lays out a kernel's by-value struct of 8-byte fields.
func args8(fields ...uint64) []byte {
	out := make([]byte, 0, 8*len(fields))
	for _, f := range fields {
		out = binary.LittleEndian.AppendUint64(out, f)
	}
	return out
}

// testModules: load the test kernels, run them with 1-D and 3-D launches
// and check every element; bad launches fail with errors. On the host
// backend loading a module is not supported.
func testModules(t *testing.T, s *System) {
	d := dev0(t, s)
	ptx, err := os.ReadFile(testKernelPTX)
	require.NoError(t, err)
	if s.Backend() == BackendHost {
		_, err := d.LoadModule(ptx)
		require.ErrorIs(t, err, ErrNotSupported)
		return
	}
	_, err = d.LoadModule(nil)
	require.Error(t, err)
	_, err = d.LoadModule([]byte("not ptx"))
	require.Error(t, err, "an image without entries must not load")

	m, err := d.LoadModule(ptx)
	require.NoError(t, err)
	axpy, err := m.Function("troupe_axpy")
	require.NoError(t, err)
	again, err := m.Function("troupe_axpy")
	require.NoError(t, err)
	require.Same(t, axpy, again, "functions are cached")
	_, err = m.Function("troupe_nope")
	require.Error(t, err)

	st, err := d.NewStream()
	require.NoError(t, err)
	defer st.Destroy()

	// axpy over n = 1000 elements with 4 blocks of 256 threads (24 idle).
	const n = 1000
	x, y := make([]float64, n), make([]float64, n)
	for i := range x {
		x[i], y[i] = float64(i)/7, float64(3*i)+0.25
	}
	dx, err := d.Alloc(8 * n)
	require.NoError(t, err)
	dy, err := d.Alloc(8 * n)
	require.NoError(t, err)
	require.NoError(t, CopyFromHost(dx, f64bytes(x)))
	require.NoError(t, CopyFromHost(dy, f64bytes(y)))
	const a = 2.5
	require.NoError(t, Launch(st, axpy, Dim3{X: 4}, Dim3{X: 256},
		args8(uint64(dx.Ptr()), uint64(dy.Ptr()), math.Float64bits(a), n)))
	require.NoError(t, st.Synchronize())
	got := make([]byte, 8*n)
	require.NoError(t, CopyToHost(got, dy))
	for i := range y {
		want := a*x[i] + y[i]
		require.Equal(t, want, math.Float64frombits(binary.LittleEndian.Uint64(got[8*i:])), "y[%d]", i)
	}

	// ids: a 3-D grid of 3-D blocks covers every id exactly once, in order
	// with the CUDA index convention, and the atomic max sees the last one.
	ids, err := m.Function("troupe_ids")
	require.NoError(t, err)
	grid, block := Dim3{X: 3, Y: 2, Z: 2}, Dim3{X: 4, Y: 2, Z: 3}
	const total = 3 * 2 * 2 * 4 * 2 * 3
	out, err := d.Alloc(8 * total)
	require.NoError(t, err)
	mx, err := d.Alloc(8)
	require.NoError(t, err)
	require.NoError(t, MemsetAsync(st, out, 0))
	require.NoError(t, MemsetAsync(st, mx, 0))
	require.NoError(t, Launch(st, ids, grid, block, args8(uint64(out.Ptr()), uint64(mx.Ptr()))))
	require.NoError(t, st.Synchronize())
	got = make([]byte, 8*total)
	require.NoError(t, CopyToHost(got, out))
	for i := range total {
		require.Equal(t, uint64(i+1), binary.LittleEndian.Uint64(got[8*i:]), "out[%d]", i)
	}
	v, err := ReadValue64(mx)
	if errors.Is(err, ErrNotHostMemory) || errors.Is(err, ErrUnsupportedKind) {
		var b [8]byte
		require.NoError(t, CopyToHost(b[:], mx))
		v, err = binary.LittleEndian.Uint64(b[:]), nil
	}
	require.NoError(t, err)
	require.Equal(t, uint64(total), v)

	// Bad launches: errors, nothing enqueued.
	require.Error(t, Launch(st, axpy, Dim3{X: 1}, Dim3{X: 2048}, args8(0, 0, 0, 0)), "too many threads")
	require.Error(t, Launch(st, axpy, Dim3{X: -1}, Dim3{X: 1}, args8(0, 0, 0, 0)), "negative grid")
	require.Error(t, Launch(st, axpy, Dim3{X: 1}, Dim3{X: 1}, 7), "plain int")
	require.Error(t, Launch(st, axpy, Dim3{X: 1}, Dim3{X: 1}, s.HostBuffer(make([]byte, 8))), "Go memory")
	require.Error(t, Launch(st, axpy, Dim3{X: 1}, Dim3{X: 1}, []byte{}), "empty struct")
	require.Error(t, Launch(st, nil, Dim3{X: 1}, Dim3{X: 1}))
	require.NoError(t, st.Synchronize())

	require.NoError(t, m.Unload())
	require.ErrorIs(t, Launch(st, axpy, Dim3{X: 1}, Dim3{X: 1}, args8(0, 0, 0, 0)), ErrDestroyed)
	_, err = m.Function("troupe_ids")
	require.ErrorIs(t, err, ErrDestroyed)
	require.ErrorIs(t, m.Unload(), ErrDestroyed)
	for _, b := range []Buffer{dx, dy, out, mx} {
		require.NoError(t, Free(b))
	}
}

func f64bytes(v []float64) []byte {
	out := make([]byte, 0, 8*len(v))
	for _, x := range v {
		out = binary.LittleEndian.AppendUint64(out, math.Float64bits(x))
	}
	return out
}

// A block whose dimensions multiply past the int range is refused: the
// product wrapped (2^31 * 2^31 * 4 = 2^64 -> 0) and passed the 1024-thread
// check, leaving the refusal to the driver.
func TestLaunchDimsBlockOverflow(t *testing.T) {
	for _, block := range []Dim3{
		{X: 1 << 31, Y: 1 << 31, Z: 4},
		{X: math.MaxUint32, Y: math.MaxUint32, Z: math.MaxUint32},
		{X: 1025},
		{X: 32, Y: 33},
	} {
		_, err := launchDims(Dim3{}, block)
		require.Error(t, err, "block %+v", block)
	}
	dims, err := launchDims(Dim3{X: 1 << 31, Y: 65535, Z: 65535}, Dim3{X: 8, Y: 8, Z: 16})
	require.NoError(t, err)
	require.Equal(t, [6]uint32{1 << 31, 65535, 65535, 8, 8, 16}, dims)
}
