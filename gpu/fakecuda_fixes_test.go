//go:build cgo && linux

package gpu

import (
	"fmt"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"
	"weak"

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

// TestFakeDriverDestroyKeepsGoMemory: Stream.Destroy returns at once and the
// work already enqueued still runs, so the Go memory of a CopyAsync queued
// behind a wait must stay alive after Destroy until the copy has run, and
// be released then; so must System.Close's, which destroys live streams.
// Destroy dropped the stream's hold on the memory with the stream: the
// collector freed the source of a copy still queued.
func TestFakeDriverDestroyKeepsGoMemory(t *testing.T) {
	onFakeDriver(t, "TestFakeDestroyKeepsGoMemoryChild")
}

// queueGoCopy enqueues on a new stream of d, behind a wait for gate >= 1, a
// copy of fresh Go memory holding pattern(n, seed) into dst, destroys the
// stream unless close is set (System.Close then does) and returns a weak
// pointer to that memory: nothing else references it or the stream.
//
//go:noinline
func queueGoCopy(t *testing.T, d *Device, gate, dst Buffer, seed byte, destroy bool) weak.Pointer[[4096]byte] {
	t.Helper()
	st, err := d.NewStream()
	require.NoError(t, err)
	require.NoError(t, WaitValue64(st, gate, 1, GEQ))
	src := new([4096]byte)
	copy(src[:], pattern(len(src), seed))
	require.NoError(t, CopyAsync(st, dst, d.sys.HostBuffer(src[:])))
	if destroy {
		require.NoError(t, st.Destroy())
	}
	return weak.Make(src)
}

// collected runs the collector a few times and reports whether p's object
// is gone.
func collected(p weak.Pointer[[4096]byte]) bool {
	for range 5 {
		runtime.GC()
	}
	return p.Value() == nil
}

// TestFakeDestroyKeepsGoMemoryChild is TestFakeDriverDestroyKeepsGoMemory's
// child.
func TestFakeDestroyKeepsGoMemoryChild(t *testing.T) {
	s := fakeDriverSystem(t)
	d := s.Devices()[0]
	const n = 4096

	// Stream.Destroy.
	dev, err := d.Alloc(n)
	require.NoError(t, err)
	require.NoError(t, Memset(dev, 0))
	gate, err := s.AllocHost(8)
	require.NoError(t, err)
	src := queueGoCopy(t, d, gate, dev, 5, true)
	require.False(t, collected(src), "a destroyed stream's queued copy lost its source to the collector")
	require.NoError(t, WriteValue64Host(gate, 1))
	got := make([]byte, n)
	eventually(t, func() bool {
		require.NoError(t, CopyToHost(got, dev))
		return string(got) == string(pattern(n, 5))
	}, "the destroyed stream's copy never landed")
	eventually(t, func() bool { return collected(src) }, "the destroyed stream's Go memory was never released")

	// System.Close destroys the live stream and waits for its work; the Go
	// destination stays with the test, the source only with the stream.
	gate2, err := s.AllocHost(8)
	require.NoError(t, err)
	word, err := gate2.Bytes()
	require.NoError(t, err)
	dst := make([]byte, n)
	src = queueGoCopy(t, d, gate2, s.HostBuffer(dst), 6, false)
	closed := make(chan error, 1)
	go func() { closed <- s.Close() }()
	select {
	case err := <-closed:
		require.NoError(t, err)
		require.False(t, collected(src), "Close let the collector take a queued copy's source")
		t.Fatal("Close returned before the queued copy ran")
	case <-time.After(50 * time.Millisecond):
	}
	require.False(t, collected(src), "Close let the collector take a queued copy's source")
	// The system is closing: write the gate from the host directly (the
	// fake driver polls it).
	atomic.StoreUint64((*uint64)(unsafe.Pointer(&word[0])), 1)
	select {
	case err := <-closed:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return after the gate opened")
	}
	require.Equal(t, pattern(n, 6), dst)
	eventually(t, func() bool { return collected(src) }, "Close never released the queued copy's Go memory")
}

// TestFakeDriverFreeWaitsForDevice: the test driver's cuMemFree,
// cuMemFreeHost and cuIpcCloseMemHandle wait until the device's streams
// have run their work, stream waits included, as the real driver's do (on
// an H100 a pinned pool's Put deadlocked against a stream waiting for the
// caller's counter; docs/gpu.md). They released the memory at once, so
// code that frees memory a stream is still waiting to use, or frees from
// what a stream waits for, passed on the fake and deadlocked on a GPU.
func TestFakeDriverFreeWaitsForDevice(t *testing.T) {
	onFakeDriver(t, "TestFakeFreeWaitsForDeviceChild", "FAKECUDA_IPC=1")
}

// TestFakeFreeWaitsForDeviceChild is TestFakeDriverFreeWaitsForDevice's
// child.
func TestFakeFreeWaitsForDeviceChild(t *testing.T) {
	s := fakeDriverSystem(t)
	d := s.Devices()[0]
	gate, err := s.AllocHost(8)
	require.NoError(t, err)
	defer WriteValue64Host(gate, 3) // on failure too: Close waits for st
	st, err := d.NewStream()
	require.NoError(t, err)
	defer st.Destroy()
	exported, err := d.Alloc(64)
	require.NoError(t, err)
	h, err := s.IPCGetHandle(exported)
	require.NoError(t, err)
	for i, release := range []struct {
		name string
		mk   func() (Buffer, error)
		free func(Buffer) error
	}{
		{"cuMemFree", func() (Buffer, error) { return d.Alloc(64) }, Free},
		{"cuMemFreeHost", func() (Buffer, error) { return s.AllocHost(64) }, Free},
		{"cuIpcCloseMemHandle", func() (Buffer, error) { return d.IPCOpen(h) }, IPCClose},
	} {
		buf, err := release.mk()
		require.NoError(t, err, release.name)
		out, err := s.AllocHost(64)
		require.NoError(t, err)
		// The stream waits for the gate, then reads buf.
		require.NoError(t, WaitValue64(st, gate, uint64(i+1), GEQ))
		require.NoError(t, CopyAsync(st, out, buf))
		freed := make(chan error, 1)
		go func() { freed <- release.free(buf) }()
		select {
		case err := <-freed:
			t.Fatalf("%s returned (%v) while a stream still waited to read the memory", release.name, err)
		case <-time.After(50 * time.Millisecond):
		}
		require.NoError(t, WriteValue64Host(gate, uint64(i+1)))
		require.NoError(t, <-freed, release.name)
		require.NoError(t, st.Synchronize())
		require.NoError(t, Free(out))
	}
	require.NoError(t, Free(exported))
	require.NoError(t, Free(gate))
}

// TestFakeDriverEventWaitSnapshot: a stream's WaitEvent waits for the
// record the event had when it was called, even when the event is recorded
// again on another stream whose work completes first. The test driver kept
// one completion counter per event, so the later record's completion
// released the waiter early (a wait whose real counterpart blocks, or
// deadlocks, went on).
func TestFakeDriverEventWaitSnapshot(t *testing.T) {
	onFakeDriver(t, "TestFakeEventWaitSnapshotChild")
}

// TestFakeEventWaitSnapshotChild is TestFakeDriverEventWaitSnapshot's child.
func TestFakeEventWaitSnapshotChild(t *testing.T) {
	testEventWaitSnapshot(t, fakeDriverSystem(t))
}

func testEventWaitSnapshot(t *testing.T, s *System) {
	d := s.Devices()[0]
	var sts [3]*Stream
	for i := range sts {
		st, err := d.NewStream()
		require.NoError(t, err)
		defer st.Destroy()
		sts[i] = st
	}
	a, b, c := sts[0], sts[1], sts[2]
	ev, err := d.NewEvent()
	require.NoError(t, err)
	defer ev.Destroy()
	gate, err := s.AllocHost(8)
	require.NoError(t, err)
	defer WriteValue64Host(gate, 1) // on failure too: Close waits for a
	marker, err := s.AllocHost(8)
	require.NoError(t, err)

	require.NoError(t, WaitValue64(a, gate, 1, GEQ))
	require.NoError(t, ev.Record(a))
	require.NoError(t, b.WaitEvent(ev)) // waits for a's gate
	require.NoError(t, WriteValue64(b, marker, 1))
	require.NoError(t, ev.Record(c)) // c has no work: completes at once
	require.NoError(t, c.Synchronize())
	require.NoError(t, ev.Synchronize())
	done, err := ev.Query()
	require.NoError(t, err)
	require.True(t, done, "the event's latest record has completed")
	time.Sleep(20 * time.Millisecond)
	m, err := ReadValue64(marker)
	require.NoError(t, err)
	require.Zero(t, m, "WaitEvent was released by a later record of the event")
	done, err = b.Query()
	require.NoError(t, err)
	require.False(t, done)

	require.NoError(t, WriteValue64Host(gate, 1))
	require.NoError(t, b.Synchronize())
	m, err = ReadValue64(marker)
	require.NoError(t, err)
	require.Equal(t, uint64(1), m)
	require.NoError(t, a.Synchronize())
}
