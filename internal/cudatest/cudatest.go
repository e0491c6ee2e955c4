// Package cudatest supports testing CUDA code on machines without a GPU.
//
// It builds the test driver of gpu/testdata/fakecuda: a libcuda.so.1
// stand-in on host memory that lets the gpu package's loader and cuda
// backend, and code above them, run without a GPU (select it with
// gpu.EnvCUDALibrary). Kernels written in the dialect of gpu/troupe_kernel.h
// can be compiled into it for the host, so that launches run the kernels'
// own source. It also generates the PTX of such kernels with clang, and
// checks that committed PTX is up to date.
//
// It is for tests only and works from a source tree: it finds the driver's
// source relative to this file.
package cudatest

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
)

// ErrNoCompiler: no C compiler to build the driver with ($CC, else cc).
var ErrNoCompiler = errors.New("cudatest: no C compiler")

// root is the module's root directory in the source tree.
func root() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..")
}

// Source is the path of the driver's C source.
func Source() string { return filepath.Join(root(), "gpu", "testdata", "fakecuda", "fakecuda.c") }

// AgentSource is the CUDA source of the gpu package's copy agent.
func AgentSource() string { return filepath.Join(root(), "gpu", "agent.cu") }

// IncludeDir holds troupe_kernel.h, which kernel sources include.
func IncludeDir() string { return filepath.Join(root(), "gpu") }

// Compile builds the shared library lib from the driver source src and the
// kernel sources (CUDA files in the troupe_kernel.h dialect, compiled as
// C++ for the host, without floating-point contraction so that results are
// those of the PTX, which clang emits without it too).
func Compile(lib, src string, kernels ...string) error {
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "cc"
	}
	if _, err := exec.LookPath(cc); err != nil {
		return fmt.Errorf("%w (%s): %v", ErrNoCompiler, cc, err)
	}
	args := []string{"-shared", "-fPIC", "-O1", "-o", lib, src}
	// troupe's own kernels (the gpu package's copy agent) come with the
	// fake driver, as the runtime loads them on any device.
	if abs, err := filepath.Abs(src); err == nil && abs == filepath.Clean(Source()) {
		kernels = append([]string{AgentSource()}, kernels...)
	}
	if len(kernels) > 0 {
		args = append(args, "-x", "c++", "-fno-exceptions", "-ffp-contract=off", "-I", IncludeDir())
		args = append(args, kernels...)
		args = append(args, "-x", "none")
	}
	args = append(args, "-lpthread", "-ldl")
	if out, err := exec.Command(cc, args...).CombinedOutput(); err != nil {
		return fmt.Errorf("cudatest: building %s: %v\n%s", lib, err, out)
	}
	return nil
}

// Build compiles the driver with the given kernel sources into
// dir/libcuda.so.1 and returns that path.
func Build(dir string, kernels ...string) (string, error) {
	lib := filepath.Join(dir, "libcuda.so.1")
	return lib, Compile(lib, Source(), kernels...)
}

// EnvUpdatePTX, set to 1, makes CheckPTX rewrite stale PTX files instead of
// failing (`make ptx`).
const EnvUpdatePTX = "TROUPE_UPDATE_PTX"

// ErrNoClang: no clang to generate PTX with.
var ErrNoClang = errors.New("cudatest: no clang")

// PTX compiles the kernel source src for the GPU with clang and returns the
// PTX text: device code only, no CUDA headers or libraries (the dialect
// needs none), sm_70 (the driver JIT-compiles it for newer GPUs), no
// floating-point contraction (so results match the host build bit for bit).
func PTX(src string) ([]byte, error) {
	if _, err := exec.LookPath("clang"); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrNoClang, err)
	}
	out, err := os.CreateTemp("", "troupe-*.ptx")
	if err != nil {
		return nil, err
	}
	out.Close()
	defer os.Remove(out.Name())
	cmd := exec.Command("clang", "-x", "cuda", "--cuda-device-only", "--cuda-gpu-arch=sm_70",
		"-nocudainc", "-nocudalib", "-O2", "-ffp-contract=off", "-I", IncludeDir(),
		"-S", "-o", out.Name(), src)
	if msg, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("cudatest: clang %s: %v\n%s", src, err, msg)
	}
	return os.ReadFile(out.Name())
}

// CheckPTX reports whether the committed PTX file ptx is what PTX(src)
// generates now. With TROUPE_UPDATE_PTX=1 it rewrites a stale file and
// reports nil.
func CheckPTX(src, ptx string) error {
	want, err := PTX(src)
	if err != nil {
		return err
	}
	have, err := os.ReadFile(ptx)
	if err == nil && string(have) == string(want) {
		return nil
	}
	if os.Getenv(EnvUpdatePTX) == "1" {
		return os.WriteFile(ptx, want, 0o644)
	}
	if err != nil {
		return err
	}
	return fmt.Errorf("cudatest: %s is stale: regenerate it from %s with `make ptx`", ptx, src)
}

// RequirePTX fails t unless the committed PTX file ptx is what clang makes
// of src now, and skips it without clang.
func RequirePTX(t testing.TB, src, ptx string) {
	t.Helper()
	err := CheckPTX(src, ptx)
	if errors.Is(err, ErrNoClang) {
		t.Skipf("PTX not checked: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
}
