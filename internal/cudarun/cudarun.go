// Package cudarun runs tests on the cuda backend on machines without a GPU:
// on the test driver of internal/cudatest, in a child process of the test
// binary. It is for tests only.
package cudarun

import (
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/internal/cudatest"
)

// OnTestDriver lets test run on the cuda backend where there is no GPU.
// With a usable driver it returns false and the test goes on, on the GPU.
// Otherwise it builds the test driver with kernels compiled in, runs test
// (the calling test's name) again in a child process of this test binary
// with the driver selected, fails t unless the child passed without
// skipping, and returns true: the caller returns. It skips t without a C
// compiler, and fails it when gpu.EnvCUDALibrary already names a driver
// that does not work (that child's own run).
func OnTestDriver(t testing.TB, test string, timeout time.Duration, kernels ...string) bool {
	t.Helper()
	if err := gpu.CUDAAvailable(); err == nil {
		return false
	} else if lib := os.Getenv(gpu.EnvCUDALibrary); lib != "" {
		t.Fatalf("cuda backend unavailable with driver %s: %v", lib, err)
	}
	lib, err := cudatest.Build(t.TempDir(), kernels...)
	if errors.Is(err, cudatest.ErrNoCompiler) {
		t.Skipf("no GPU (%v) and no C compiler for the test driver: %v", gpu.CUDAAvailable(), err)
	}
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^"+test+"$", "-test.count=1", "-test.v", "-test.timeout="+timeout.String())
	cmd.Env = append(os.Environ(), gpu.EnvCUDALibrary+"="+lib)
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: "+test) || strings.Contains(string(out), "--- SKIP") {
		t.Fatalf("on the test driver: %v\n%s", err, out)
	}
	return true
}
