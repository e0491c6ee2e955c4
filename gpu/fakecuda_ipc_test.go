//go:build cgo && linux

package gpu

import (
	"encoding/hex"
	"encoding/json"
	"os"
	"strings"
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
