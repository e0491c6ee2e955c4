//go:build cgo && linux

package gpu

import (
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// onFakeDriver runs child, a test of this binary, in a child process against
// the fake driver (with the extra environment env) and fails unless it
// passes. It skips when this process already runs against an overridden
// driver.
func onFakeDriver(t *testing.T, child string, env ...string) {
	t.Helper()
	if os.Getenv(EnvCUDALibrary) != "" {
		t.Skip("already running against an overridden driver")
	}
	lib := buildFakeDriver(t, "testdata/fakecuda/fakecuda.c", testKernelSource)
	out := runSelf(t, append([]string{EnvCUDALibrary + "=" + lib}, env...), "-test.run=^"+child+"$")
	require.Contains(t, out, "--- PASS: "+child+" ", out)
}

// fakeDriverSystem opens the cuda backend in a child process started by
// onFakeDriver, and skips anywhere else.
func fakeDriverSystem(t *testing.T) *System {
	t.Helper()
	if os.Getenv(EnvCUDALibrary) == "" {
		t.Skip("run by its parent test against the fake driver")
	}
	s, err := OpenBackend(BackendCUDA)
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// atDepth calls f with d frames of padding below it on a fresh goroutine's
// stack, so that some depth d leaves f's callees just short of stack.
func atDepth(d int, f func()) {
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		recurse(d, f)
	}()
	wg.Wait()
}

//go:noinline
func recurse(d int, f func()) uint64 {
	var pad [4]uint64
	if d == 0 {
		f()
		return 0
	}
	pad[d%4] = uint64(d)
	return recurse(d-1, f) + pad[0]*0
}

// TestFakeDriverValue64StackGrowth: ReadValue64 and WriteValue64Host on
// device memory hand the driver the address of an 8-byte host word. Called
// at every stack depth from 0 to 400 on a fresh goroutine, some call grows
// the stack between taking that address and the driver call; the word must
// not move. It moved: the word was a stack slice passed as a uintptr, so
// ReadValue64 returned 0 at some depths (the driver wrote the freed stack);
// WriteValue64Host read the freed stack, which usually still held the value.
func TestFakeDriverValue64StackGrowth(t *testing.T) {
	onFakeDriver(t, "TestFakeValue64StackGrowthChild")
}

// TestFakeValue64StackGrowthChild is TestFakeDriverValue64StackGrowth's
// child.
func TestFakeValue64StackGrowthChild(t *testing.T) {
	s := fakeDriverSystem(t)
	buf, err := s.Devices()[0].Alloc(8)
	require.NoError(t, err)
	const v = 0x1122334455667788
	var bad []string
	for depth := range 400 {
		require.NoError(t, WriteValue64Host(buf, v))
		var got uint64
		var err error
		atDepth(depth, func() { got, err = ReadValue64(buf) })
		require.NoError(t, err)
		if got != v {
			bad = append(bad, fmt.Sprintf("ReadValue64 at depth %d: %#x", depth, got))
		}
		w := v ^ uint64(depth+1)
		atDepth(depth, func() { err = WriteValue64Host(buf, w) })
		require.NoError(t, err)
		if got, err = ReadValue64(buf); err != nil || got != w {
			bad = append(bad, fmt.Sprintf("WriteValue64Host at depth %d: read back %#x (%v)", depth, got, err))
		}
	}
	require.Empty(t, bad, strings.Join(bad, "\n"))
}

// TestFakeDriverStreamValueOpsManaged: the fake driver, like the real one,
// refuses managed memory in cuStreamWriteValue64 and cuStreamWaitValue64, so
// the cuda leg of the suite would catch a backend passing it on.
func TestFakeDriverStreamValueOpsManaged(t *testing.T) {
	onFakeDriver(t, "TestFakeStreamValueOpsManagedChild")
}

// TestFakeStreamValueOpsManagedChild is TestFakeDriverStreamValueOpsManaged's
// child: it calls the loader directly, below the checks of WriteValue64.
func TestFakeStreamValueOpsManagedChild(t *testing.T) {
	s := fakeDriverSystem(t)
	d := s.Devices()[0]
	m, err := d.AllocManaged(8)
	require.NoError(t, err)
	st, err := d.NewStream()
	require.NoError(t, err)
	cs := st.impl.(*cudaStream)
	var ce *CUDAError
	require.ErrorAs(t, cs.b.l.streamWriteValue64(cs.ctx, cs.s, uint64(m.Ptr()), 1), &ce)
	require.Equal(t, 1, ce.Result) // CUDA_ERROR_INVALID_VALUE
	require.ErrorAs(t, cs.b.l.streamWaitValue64(cs.ctx, cs.s, uint64(m.Ptr()), 1, uint32(GEQ)), &ce)
	require.Equal(t, 1, ce.Result)
	require.NoError(t, st.Synchronize())
}

// TestFakeDriverIPCOpenPerDevice: opening one IPC handle on two devices
// gives each device its own mapping (the driver maps an allocation once per
// context); the cache was keyed by the handle alone and gave device 1
// device 0's mapping.
func TestFakeDriverIPCOpenPerDevice(t *testing.T) {
	onFakeDriver(t, "TestFakeIPCOpenPerDeviceChild", "FAKECUDA_IPC=1", "FAKECUDA_DEVICES=2")
}

// TestFakeIPCOpenPerDeviceChild is TestFakeDriverIPCOpenPerDevice's child.
func TestFakeIPCOpenPerDeviceChild(t *testing.T) {
	s := fakeDriverSystem(t)
	require.Len(t, s.Devices(), 2)
	d0, d1 := s.Devices()[0], s.Devices()[1]
	buf, err := d0.Alloc(64)
	require.NoError(t, err)
	defer Free(buf)
	require.NoError(t, CopyFromHost(buf, pattern(64, 3)))
	h, err := s.IPCGetHandle(buf)
	require.NoError(t, err)
	x, err := d0.IPCOpen(h)
	require.NoError(t, err)
	y, err := d1.IPCOpen(h)
	require.NoError(t, err)
	y2, err := d1.IPCOpen(h)
	require.NoError(t, err)
	require.Same(t, d0, x.Device())
	require.Same(t, d1, y.Device(), "IPCOpen on device 1 returned device 0's mapping")
	require.NotEqual(t, x.Ptr(), y.Ptr())
	require.Equal(t, y.Ptr(), y2.Ptr())
	require.Equal(t, IPCStats{Opened: 2, Hits: 1, Open: 2, Refs: 3}, s.IPCStats())
	got := make([]byte, 64)
	require.NoError(t, CopyToHost(got, y))
	require.Equal(t, pattern(64, 3), got)
	for _, b := range []Buffer{x, y, y2} {
		require.NoError(t, IPCClose(b))
	}
	require.Equal(t, IPCStats{Opened: 2, Closed: 2, Hits: 1}, s.IPCStats())
}

// TestFakeDriverMemOpsNotSupported: a stream memory operation the driver
// refuses with CUDA_ERROR_NOT_SUPPORTED (801) reports a *CUDAError that
// matches ErrNotSupported (it matched nothing but its own type).
func TestFakeDriverMemOpsNotSupported(t *testing.T) {
	onFakeDriver(t, "TestFakeMemOpsNotSupportedChild", "FAKECUDA_MEMOPS=801")
}

// TestFakeMemOpsNotSupportedChild is TestFakeDriverMemOpsNotSupported's
// child.
func TestFakeMemOpsNotSupportedChild(t *testing.T) {
	s := fakeDriverSystem(t)
	d := s.Devices()[0]
	w, err := d.Alloc(8)
	require.NoError(t, err)
	st, err := d.NewStream()
	require.NoError(t, err)
	for _, err := range []error{WriteValue64(st, w, 1), WaitValue64(st, w, 1, GEQ)} {
		require.ErrorIs(t, err, ErrNotSupported)
		var ce *CUDAError
		require.ErrorAs(t, err, &ce)
		require.Equal(t, 801, ce.Result)
		require.Equal(t, "CUDA_ERROR_NOT_SUPPORTED", ce.Name)
	}
	require.NotErrorIs(t, &CUDAError{Call: "cuMemAlloc_v2", Result: 2}, ErrNotSupported)
	require.ErrorIs(t, fmt.Errorf("wrapped: %w", &CUDAError{Result: 801}), ErrNotSupported)
	require.NoError(t, st.Synchronize())
}

// TestFakeDriverKeptGoMemoryReleased: the Go memory a cuda stream keeps for
// a CopyAsync is released once the copy is known to have completed, whether
// through Stream.Query, Event.Synchronize or Event.Query, and not before:
// an event recorded before the copy does not release it. It was released
// only by Stream.Synchronize, so a stream observed through events or Query
// kept every buffer it ever copied.
func TestFakeDriverKeptGoMemoryReleased(t *testing.T) {
	onFakeDriver(t, "TestFakeKeptGoMemoryReleasedChild")
}

// keptBuffers reports how many Go buffers s keeps alive.
func keptBuffers(s *Stream) int {
	cs := s.impl.(*cudaStream)
	cs.mu.Lock()
	defer cs.mu.Unlock()
	return len(cs.kept)
}

// TestFakeKeptGoMemoryReleasedChild is TestFakeDriverKeptGoMemoryReleased's
// child.
func TestFakeKeptGoMemoryReleasedChild(t *testing.T) {
	s := fakeDriverSystem(t)
	d := s.Devices()[0]
	dev, err := d.Alloc(64)
	require.NoError(t, err)
	gate, err := s.AllocHost(8)
	require.NoError(t, err)
	st, err := d.NewStream()
	require.NoError(t, err)
	ev, err := d.NewEvent()
	require.NoError(t, err)
	copyGo := func() {
		t.Helper()
		require.NoError(t, CopyAsync(st, dev, s.HostBuffer(pattern(64, 1))))
	}

	// The driver's own synchronize calls (no release of their own) make
	// the copy complete before Query is asked, so that it answers idle.
	cs := st.impl.(*cudaStream)
	copyGo()
	require.NoError(t, cs.b.l.streamSynchronize(cs.ctx, cs.s))
	require.NotZero(t, keptBuffers(st), "before Stream.Query")
	idle, err := st.Query()
	require.NoError(t, err)
	require.True(t, idle, "Stream.Query after the stream synchronized")
	require.Zero(t, keptBuffers(st), "after Stream.Query reported idle")

	for range 100 {
		copyGo()
		require.NoError(t, ev.Record(st))
		require.NoError(t, ev.Synchronize())
	}
	require.Zero(t, keptBuffers(st), "after Event.Synchronize")

	copyGo()
	require.NoError(t, ev.Record(st))
	ce := ev.impl.(*cudaEvent)
	require.NoError(t, ce.b.l.eventSynchronize(ce.ctx, ce.e))
	require.NotZero(t, keptBuffers(st), "before Event.Query")
	done, err := ev.Query()
	require.NoError(t, err)
	require.True(t, done, "Event.Query after the event synchronized")
	require.Zero(t, keptBuffers(st), "after Event.Query reported completion")

	// Not before: an event recorded ahead of a gated copy completes, and
	// the copy's memory stays kept until the copy has run.
	before, err := d.NewEvent()
	require.NoError(t, err)
	require.NoError(t, before.Record(st))
	require.NoError(t, WaitValue64(st, gate, 1, GEQ))
	copyGo()
	require.NoError(t, ev.Record(st))
	require.NoError(t, before.Synchronize())
	done, err = before.Query()
	require.NoError(t, err)
	require.True(t, done)
	idle, err = st.Query()
	require.NoError(t, err)
	require.False(t, idle)
	done, err = ev.Query()
	require.NoError(t, err)
	require.False(t, done)
	require.Equal(t, 1, keptBuffers(st), "released before the copy ran")
	require.NoError(t, WriteValue64Host(gate, 1))
	require.NoError(t, ev.Synchronize())
	require.Zero(t, keptBuffers(st))
	require.NoError(t, st.Synchronize())
}
