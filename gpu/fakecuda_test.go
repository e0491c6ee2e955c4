//go:build cgo && linux

package gpu

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/troupe-hpc/troupe/internal/cudatest"
)

// buildFakeDriver compiles src (the fake driver, or a stand-in) into a
// libcuda.so.1 with the given kernel sources compiled in.
func buildFakeDriver(t *testing.T, src string, kernels ...string) string {
	t.Helper()
	lib := filepath.Join(t.TempDir(), "libcuda.so.1")
	err := cudatest.Compile(lib, src, kernels...)
	if errors.Is(err, cudatest.ErrNoCompiler) {
		t.Skipf("cannot build the fake CUDA driver: %v", err)
	}
	require.NoError(t, err)
	return lib
}

// runSelf runs this test binary with extra environment and arguments.
func runSelf(t *testing.T, env []string, args ...string) string {
	t.Helper()
	cmd := exec.Command(os.Args[0], append([]string{"-test.count=1", "-test.timeout=120s", "-test.v"}, args...)...)
	cmd.Env = append(os.Environ(), env...)
	out, _ := cmd.CombinedOutput()
	return string(out)
}

// TestCUDABackendOnFakeDriver runs the shared suite's cuda leg through the
// real loader and cuda backend against a fake driver built from
// testdata/fakecuda, so the cgo and driver-call paths are exercised on
// machines without a GPU. It does not replace a run on a real GPU.
func TestCUDABackendOnFakeDriver(t *testing.T) {
	if os.Getenv(EnvCUDALibrary) != "" {
		t.Skip("already running against an overridden driver")
	}
	const src = "testdata/fakecuda/fakecuda.c"
	if _, err := os.Stat(src); err != nil {
		t.Skipf("fake driver source not found (run from the gpu package directory): %v", err)
	}
	lib := buildFakeDriver(t, src, testKernelSource)

	out := runSelf(t, []string{EnvCUDALibrary + "=" + lib}, "-test.run=^TestSuite$/^cuda$")
	require.Contains(t, out, "--- PASS: TestSuite/cuda ", out)
	require.NotContains(t, out, "--- SKIP: TestSuite/cuda", out)
	require.NotContains(t, out, "FAIL", out)

	// IPC handle cache (the fake lets a process open its own handles).
	out = runSelf(t, []string{EnvCUDALibrary + "=" + lib, "FAKECUDA_IPC=1"}, "-test.run=^TestSuite$/^cuda$/^IPC$")
	require.Contains(t, out, "--- PASS: TestSuite/cuda/IPC ", out)
	require.NotContains(t, out, "FAIL", out)

	// A failing driver call is named with its CUresult and error name.
	out = runSelf(t, []string{EnvCUDALibrary + "=" + lib, "FAKECUDA_INIT=100", EnvBackend + "=cuda"}, "-test.run=^TestSelectionByEnv$")
	require.Contains(t, out, "cuInit failed: CUresult 100 (CUDA_ERROR_NO_DEVICE", out)

	// No devices: auto falls back to host, cuda names the call.
	out = runSelf(t, []string{EnvCUDALibrary + "=" + lib, "FAKECUDA_DEVICES=0"}, "-test.run=^TestSelectionByEnv$")
	require.Contains(t, out, "cuDeviceGetCount: no CUDA device", out)
	require.Contains(t, out, "--- PASS: TestSelectionByEnv", out)
}

// TestCUDALoaderMissingSymbol: a library without the driver's entry points
// is refused with the symbol named.
func TestCUDALoaderMissingSymbol(t *testing.T) {
	if os.Getenv(EnvCUDALibrary) != "" {
		t.Skip("already running against an overridden driver")
	}
	src := filepath.Join(t.TempDir(), "partial.c")
	require.NoError(t, os.WriteFile(src, []byte("int cuInit(unsigned f) { (void)f; return 0; }\n"), 0o644))
	lib := buildFakeDriver(t, src)
	out := runSelf(t, []string{EnvCUDALibrary + "=" + lib}, "-test.run=^TestSelectionByEnv$")
	require.True(t, strings.Contains(out, "dlsym(cuDriverGetVersion)"), out)

	out = runSelf(t, []string{EnvCUDALibrary + "=" + filepath.Join(t.TempDir(), "nope.so")}, "-test.run=^TestSelectionByEnv$")
	require.Contains(t, out, "no CUDA driver: dlopen(", out)
}
