//go:build cgo && linux

package gpu

import (
	"encoding/hex"
	"encoding/json"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Environment of the two halves of TestFakeDriverIPCAcrossProcesses.
const (
	envIPCRole   = "TROUPE_GPU_TEST_IPC_ROLE"   // "exporter" or "importer"
	envIPCHandle = "TROUPE_GPU_TEST_IPC_HANDLE" // JSON: the handle to open
	envIPCFreed  = "TROUPE_GPU_TEST_IPC_FREED"  // JSON: a handle whose allocation was freed
)

// TestFakeDriverIPCAcrossProcesses: a device buffer exported by one process
// is mapped by another through the fake driver (memfd-backed allocations),
// read and written there, and the writes are seen by the exporter. Opening
// a handle whose allocation was freed fails, and the importer's second open
// of one handle is served by the mapping cache.
func TestFakeDriverIPCAcrossProcesses(t *testing.T) {
	if os.Getenv(EnvCUDALibrary) != "" {
		t.Skip("already running against an overridden driver")
	}
	const src = "testdata/fakecuda/fakecuda.c"
	if _, err := os.Stat(src); err != nil {
		t.Skipf("fake driver source not found (run from the gpu package directory): %v", err)
	}
	lib := buildFakeDriver(t, src)
	out := runSelf(t, []string{EnvCUDALibrary + "=" + lib, envIPCRole + "=exporter"}, "-test.run=^TestFakeIPCHalf$")
	require.Contains(t, out, "--- PASS: TestFakeIPCHalf ", out)
	require.Contains(t, out, "importer: --- PASS: TestFakeIPCHalf ", out)
	require.NotContains(t, out, "FAIL", out)
}

// TestFakeIPCHalf is one process of TestFakeDriverIPCAcrossProcesses.
func TestFakeIPCHalf(t *testing.T) {
	role := os.Getenv(envIPCRole)
	if role == "" {
		t.Skip("run by TestFakeDriverIPCAcrossProcesses")
	}
	s, err := OpenBackend(BackendCUDA)
	require.NoError(t, err)
	defer s.Close()
	d := s.Devices()[0]
	if role == "importer" {
		var h, freed IPCHandle
		require.NoError(t, json.Unmarshal([]byte(os.Getenv(envIPCHandle)), &h))
		require.NoError(t, json.Unmarshal([]byte(os.Getenv(envIPCFreed)), &freed))
		_, err := d.IPCOpen(freed)
		require.Error(t, err, "a freed allocation's handle must not open")
		assert.Contains(t, err.Error(), "cuIpcOpenMemHandle")
		x, err := d.IPCOpen(h)
		require.NoError(t, err)
		y, err := d.IPCOpen(h)
		require.NoError(t, err)
		st := s.IPCStats()
		assert.Equal(t, IPCStats{Opened: 1, Hits: 1, Open: 1, Refs: 2}, st)
		got := make([]byte, x.Len())
		require.NoError(t, CopyToHost(got, x))
		require.Equal(t, pattern(x.Len(), 5), got)
		require.NoError(t, CopyFromHost(y, pattern(y.Len(), 6)))
		require.NoError(t, IPCClose(x))
		require.NoError(t, IPCClose(y))
		assert.Equal(t, IPCStats{Opened: 1, Closed: 1, Hits: 1}, s.IPCStats())
		return
	}
	a, err := d.Alloc(1 << 16)
	require.NoError(t, err)
	b, err := a.Slice(4096, 8192)
	require.NoError(t, err)
	require.NoError(t, CopyFromHost(b, pattern(b.Len(), 5)))
	h, err := s.IPCGetHandle(b)
	require.NoError(t, err)
	assert.Equal(t, uint64(1<<16), h.Size)
	gone, err := d.Alloc(4096)
	require.NoError(t, err)
	fh, err := s.IPCGetHandle(gone)
	require.NoError(t, err)
	require.NoError(t, Free(gone))
	hj, _ := json.Marshal(h)
	fj, _ := json.Marshal(fh)
	t.Logf("handle %s", hex.EncodeToString(h.Handle[:32]))
	out := runSelf(t, []string{envIPCRole + "=importer", envIPCHandle + "=" + string(hj), envIPCFreed + "=" + string(fj)}, "-test.run=^TestFakeIPCHalf$")
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		t.Logf("importer: %s", l)
	}
	got := make([]byte, b.Len())
	require.NoError(t, CopyToHost(got, b))
	assert.Equal(t, pattern(b.Len(), 6), got, "the importer's writes are visible to the exporter")
	require.NoError(t, Free(a))
}

// blockFreeInQuiesce holds the device's copy agent lock so that a Free or
// IPCClose of the system stops in quiesceAgents: after it has dropped the
// allocation from the registry, the KindOf cache and the IPC cache, before
// the driver releases the memory. It returns the function that lets it go on.
func blockFreeInQuiesce(s *System) (unblock func()) {
	s.agentOn = true // quiesceAgents looks at the agents (none is set up)
	d := s.devices[0]
	d.agent.mu.Lock()
	return d.agent.mu.Unlock
}

// waitUnregistered waits until ptr is no longer in s's registry (Free or
// IPCClose has reached the point blockFreeInQuiesce holds it at).
func waitUnregistered(s *System, ptr uintptr) {
	for {
		s.mu.Lock()
		a := s.reg.find(ptr)
		s.mu.Unlock()
		if a == nil {
			return
		}
		runtime.Gosched()
	}
}

// TestCUDAKindOfAfterFree: KindOf of an address asked while Free or
// IPCClose runs (the driver still has the memory) leaves no stale kind in
// the cache once it has returned (docs: "a freed or reused address is never
// reported with a stale kind"); it cached pinned or device for the freed
// address until 2026-12-07 (found by review).
func TestCUDAKindOfAfterFree(t *testing.T) {
	onFakeDriver(t, "TestCUDAKindOfAfterFreeChild", "FAKECUDA_IPC=1")
}

func TestCUDAKindOfAfterFreeChild(t *testing.T) {
	s := fakeDriverSystem(t)
	d := s.Devices()[0]
	for _, kind := range []Kind{KindPinned, KindDevice} {
		var b Buffer
		var err error
		if kind == KindPinned {
			b, err = s.AllocHost(4096)
		} else {
			b, err = d.Alloc(4096)
		}
		require.NoError(t, err)
		ptr := b.Ptr()

		unblock := blockFreeInQuiesce(s)
		done := make(chan error, 1)
		go func() { done <- Free(b) }()
		waitUnregistered(s, ptr)
		during, _ := s.KindOf(ptr) // the driver still has the memory
		unblock()
		require.NoError(t, <-done)
		s.agentOn = false

		after, _ := s.KindOf(ptr)
		_, _, known := s.be.pointerKind(ptr)
		require.False(t, known, "the driver no longer knows %#x", ptr)
		assert.Equal(t, KindHost, after,
			"KindOf(%#x) after Free of %v memory: cached %v, asked while Free ran", ptr, kind, during)
	}

	// The same through IPCClose of the last reference to a mapping.
	src, err := d.Alloc(1 << 16)
	require.NoError(t, err)
	h, err := s.IPCGetHandle(src)
	require.NoError(t, err)
	m, err := d.IPCOpen(h)
	require.NoError(t, err)
	ptr := m.Ptr()
	unblock := blockFreeInQuiesce(s)
	done := make(chan error, 1)
	go func() { done <- IPCClose(m) }()
	waitUnregistered(s, ptr)
	during, _ := s.KindOf(ptr)
	unblock()
	require.NoError(t, <-done)
	s.agentOn = false
	after, _ := s.KindOf(ptr)
	_, _, known := s.be.pointerKind(ptr)
	require.False(t, known, "the driver no longer maps %#x", ptr)
	assert.Equal(t, KindHost, after,
		"KindOf(%#x) after IPCClose of its mapping: cached %v, asked while IPCClose ran", ptr, during)
}

// TestCUDAIPCReopenWhileClosing: an IPCOpen of a handle whose last
// reference another goroutine is closing waits for the unmapping, then maps
// it anew. It found no cached mapping and asked the driver while the
// driver still mapped the allocation: CUDA_ERROR_ALREADY_MAPPED, as the
// real driver answers (found by review).
func TestCUDAIPCReopenWhileClosing(t *testing.T) {
	onFakeDriver(t, "TestCUDAIPCReopenWhileClosingChild", "FAKECUDA_IPC=1")
}

func TestCUDAIPCReopenWhileClosingChild(t *testing.T) {
	s, d, h := exportedAlloc(t)
	m, err := d.IPCOpen(h)
	require.NoError(t, err)

	unblock := blockFreeInQuiesce(s)
	closed := make(chan error, 1)
	go func() { closed <- IPCClose(m) }() // the last reference
	waitUnregistered(s, m.Ptr())
	type opened struct {
		b   Buffer
		err error
	}
	reopened := make(chan opened, 1)
	go func() {
		b, err := d.IPCOpen(h)
		reopened <- opened{b, err}
	}()
	for s.ipcOpening.Load() == 0 && len(reopened) == 0 { // the opener waits for the close, or is done
		runtime.Gosched()
	}
	unblock()
	require.NoError(t, <-closed)
	s.agentOn = false
	o := <-reopened
	require.NoError(t, o.err, "IPCOpen while the previous mapping of the handle was being closed")
	require.NoError(t, IPCClose(o.b))
}

// TestCUDAIPCOpenConcurrent: goroutines opening one handle on one device at
// once all get the mapping (one driver mapping, shared); those that missed
// the cache together each asked the driver, and all but one got
// CUDA_ERROR_ALREADY_MAPPED (found by review).
func TestCUDAIPCOpenConcurrent(t *testing.T) {
	onFakeDriver(t, "TestCUDAIPCOpenConcurrentChild", "FAKECUDA_IPC=1")
}

func TestCUDAIPCOpenConcurrentChild(t *testing.T) {
	s, d, h := exportedAlloc(t)
	for i := range 200 {
		var wg sync.WaitGroup
		var bufs [4]Buffer
		var errs [4]error
		start := make(chan struct{})
		for j := range bufs {
			wg.Go(func() {
				<-start
				bufs[j], errs[j] = d.IPCOpen(h)
			})
		}
		close(start)
		wg.Wait()
		for j := range bufs {
			if errs[j] == nil {
				require.NoError(t, IPCClose(bufs[j]))
			}
		}
		for j := range errs {
			require.NoError(t, errs[j], "round %d: concurrent IPCOpen %d of one handle", i, j)
		}
		require.Zero(t, s.IPCStats().Open)
	}
}

// exportedAlloc opens the fake driver's system and returns it, its first
// device and the IPC handle of 64 KiB allocated there.
func exportedAlloc(t *testing.T) (*System, *Device, IPCHandle) {
	t.Helper()
	s := fakeDriverSystem(t)
	d := s.Devices()[0]
	src, err := d.Alloc(1 << 16)
	require.NoError(t, err)
	h, err := s.IPCGetHandle(src)
	require.NoError(t, err)
	return s, d, h
}
