package gpu

import (
	"encoding/binary"
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// testLaunchHost is the suite's kernel test. On the host backend a kernel
// runs in stream order with the copies around it; on cuda it is refused
// with ErrNotSupported.
func testLaunchHost(t *testing.T, s *System) {
	d := dev0(t, s)
	st, err := d.NewStream()
	require.NoError(t, err)
	defer st.Destroy()
	buf := allocKind(t, s, KindDevice, 8)
	noop := func([][]byte) error { return nil }
	if s.Backend() == BackendCUDA {
		err := LaunchHost(st, noop, buf)
		require.ErrorIs(t, err, ErrNotSupported)
		assert.Contains(t, err.Error(), "Device.LoadModule")
		return
	}
	t.Run("OrderedWithCopies", func(t *testing.T) { testLaunchOrdering(t, s, st) })
	t.Run("Errors", func(t *testing.T) { testLaunchErrors(t, s, st) })
}

// testLaunchOrdering interleaves copies and kernels on one stream; each
// reads what the previous operation wrote, so any reordering shows.
func testLaunchOrdering(t *testing.T, s *System, st *Stream) {
	const rounds = 200
	word := allocKind(t, s, KindDevice, 8)
	tmp := allocKind(t, s, KindDevice, 8)
	out := allocKind(t, s, KindPinned, 8*rounds)
	// add adds v to the first word of its buffer.
	add := func(v uint64) HostKernel {
		return func(mem [][]byte) error {
			binary.LittleEndian.PutUint64(mem[0], binary.LittleEndian.Uint64(mem[0])+v)
			return nil
		}
	}
	require.NoError(t, Memset(word, 0))
	for i := range rounds {
		// word += 1 (kernel); tmp = word (copy); tmp *= 2 (kernel); out[i] = tmp.
		require.NoError(t, LaunchHost(st, add(1), word))
		require.NoError(t, CopyAsync(st, tmp, word))
		require.NoError(t, LaunchHost(st, func(mem [][]byte) error {
			binary.LittleEndian.PutUint64(mem[0], 2*binary.LittleEndian.Uint64(mem[0]))
			return nil
		}, tmp))
		slot, err := out.Slice(8*i, 8)
		require.NoError(t, err)
		require.NoError(t, CopyAsync(st, slot, tmp))
	}
	// A kernel over two buffers sees them in argument order, slices included.
	pair := allocKind(t, s, KindDevice, 16)
	hi, err := pair.Slice(8, 8)
	require.NoError(t, err)
	require.NoError(t, LaunchHost(st, func(mem [][]byte) error {
		if len(mem) != 2 || len(mem[0]) != 8 || len(mem[1]) != 8 {
			return errors.New("wrong views")
		}
		copy(mem[1], mem[0])
		return nil
	}, word, hi))
	got := allocKind(t, s, KindPinned, 8)
	require.NoError(t, CopyAsync(st, got, hi))
	require.NoError(t, st.Synchronize())
	for i := range rounds {
		slot, _ := out.Slice(8*i, 8)
		v, err := ReadValue64(slot)
		require.NoError(t, err)
		require.Equal(t, uint64(2*(i+1)), v, "slot %d", i)
	}
	v, err := ReadValue64(got)
	require.NoError(t, err)
	assert.Equal(t, uint64(rounds), v)
}

func testLaunchErrors(t *testing.T, s *System, st *Stream) {
	d := dev0(t, s)
	noop := func([][]byte) error { return nil }

	// Freed buffers, and slices of them, are refused.
	b, err := d.Alloc(64)
	require.NoError(t, err)
	sl, _ := b.Slice(8, 8)
	require.NoError(t, Free(b))
	assert.ErrorIs(t, LaunchHost(st, noop, b), ErrFreed)
	assert.ErrorIs(t, LaunchHost(st, noop, sl), ErrFreed)

	// Buffers of another system, and a stream of another system.
	other, err := OpenBackend(BackendHost)
	require.NoError(t, err)
	defer other.Close()
	ob, err := other.Devices()[0].Alloc(8)
	require.NoError(t, err)
	assert.ErrorIs(t, LaunchHost(st, noop, ob), ErrForeign)
	ost, err := other.Devices()[0].NewStream()
	require.NoError(t, err)
	mine := allocKind(t, s, KindDevice, 8)
	assert.ErrorIs(t, LaunchHost(ost, noop, mine), ErrForeign)

	// Go memory, the zero Buffer, a nil kernel, a destroyed stream.
	assert.ErrorIs(t, LaunchHost(st, noop, s.HostBuffer(make([]byte, 8))), ErrUnsupportedKind)
	assert.ErrorIs(t, LaunchHost(st, noop, Buffer{}), ErrZeroBuffer)
	assert.Error(t, LaunchHost(st, nil, mine))
	dead, err := d.NewStream()
	require.NoError(t, err)
	require.NoError(t, dead.Destroy())
	assert.ErrorIs(t, LaunchHost(dead, noop, mine), ErrDestroyed)

	// Freeing after the launch is safe: the kernel still sees the memory.
	gate := allocKind(t, s, KindPinned, 8)
	late, err := d.Alloc(8)
	require.NoError(t, err)
	require.NoError(t, CopyFromHost(late, []byte("latefree")))
	st2, err := d.NewStream()
	require.NoError(t, err)
	defer st2.Destroy()
	seen := make([]byte, 8)
	require.NoError(t, WaitValue64(st2, gate, 1, GEQ))
	require.NoError(t, LaunchHost(st2, func(mem [][]byte) error {
		copy(seen, mem[0])
		return nil
	}, late))
	require.NoError(t, Free(late))
	require.NoError(t, WriteValue64Host(gate, 1))
	require.NoError(t, st2.Synchronize())
	assert.Equal(t, "latefree", string(seen))

	// A kernel's error and a kernel's panic become the stream's sticky
	// error; later work on the stream does not run (as after a faulting
	// kernel on a GPU).
	st3, err := d.NewStream()
	require.NoError(t, err)
	defer st3.Destroy()
	boom := errors.New("boom")
	require.NoError(t, LaunchHost(st3, func([][]byte) error { return boom }, mine))
	require.NoError(t, LaunchHost(st3, func(mem [][]byte) error {
		_ = mem[5] // out of range: only one buffer
		return nil
	}, mine))
	ran := false
	require.NoError(t, LaunchHost(st3, func([][]byte) error { ran = true; return nil }))
	err = st3.Synchronize()
	assert.ErrorIs(t, err, boom)
	assert.False(t, ran, "a kernel enqueued after a failed one ran")
	st4, err := d.NewStream()
	require.NoError(t, err)
	defer st4.Destroy()
	require.NoError(t, LaunchHost(st4, func(mem [][]byte) error {
		_ = mem[5]
		return nil
	}, mine))
	err = st4.Synchronize()
	require.Error(t, err)
	assert.True(t, strings.Contains(err.Error(), "host kernel panicked"), err.Error())
}
