package main

import (
	"bytes"
	"context"
	"io"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/internal/cudatest"
	"github.com/troupe-hpc/troupe/transport/bootstrap"
)

// asMainEnv makes a re-executed test binary run the program instead of the
// tests, so the launcher can start it as real rank processes.
const asMainEnv = "JACOBI3D_TEST_AS_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(asMainEnv) != "" {
		os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
	}
	os.Exit(m.Run())
}

// launch runs the program on n real processes through the embedded
// launcher and returns the combined output.
func launch(t *testing.T, n int, args ...string) (string, error) {
	t.Helper()
	return launchEnv(t, n, nil, args...)
}

// launchEnv is launch with extra environment variables for the ranks.
func launchEnv(t *testing.T, n int, env []string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var out bytes.Buffer
	err := bootstrap.Launch(ctx, bootstrap.LaunchConfig{
		N:       n,
		Program: os.Args[0],
		Args:    args,
		Env:     append([]string{asMainEnv + "=1", "UCX_LOG_LEVEL=error"}, env...),
		TLS:     "shm",
		Stdout:  &out,
		Stderr:  &out,
	})
	return out.String(), err
}

// TestProcesses runs Jacobi3D as 2 and 4 real processes over UCX shared
// memory and checks rank 0's report: the serial check passes and the
// residual and field hash are the published grid-24 values.
func TestProcesses(t *testing.T) {
	for _, n := range []int{2, 4} {
		out, err := launch(t, n, "-grid", "24", "-blocks", "2x2x3", "-warmup", "10", "-iters", "20")
		if err != nil {
			t.Fatalf("%d ranks: %v\n%s", n, err, out)
		}
		for _, want := range []string{
			"[0] residual 0.008044795268676186\n",
			"[0] field_hash 3139269223917833\n",
			"[0] check PASS max_abs_diff 0 ",
			"[0] iter_ms ",
			"[0] comm_ms ",
		} {
			if !strings.Contains(out, want) {
				t.Fatalf("%d ranks: no %q in the output:\n%s", n, want, out)
			}
		}
		for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
			if !strings.HasPrefix(l, "[0] ") {
				t.Fatalf("%d ranks: unexpected output line %q:\n%s", n, l, out)
			}
		}
	}
}

// TestProcessesGPU runs -gpu with both halo APIs as 2 and 4 real processes
// on the host gpu backend (device memory separate from Go memory; faces
// between processes take the channels' staged path or the actor runtime's
// device landing) and on the cuda backend (the stencil as device code: on
// a GPU when there is one, else on the test CUDA driver with kernels.cu
// compiled in), and requires the published grid-24 values and the serial
// check to pass bit for bit.
func TestProcessesGPU(t *testing.T) {
	cudaEnv := []string{"TROUPE_GPU=cuda"}
	if err := gpu.CUDAAvailable(); err != nil {
		lib, err := cudatest.Build(t.TempDir(), "jacobi/kernels.cu")
		if err != nil {
			t.Logf("cuda backend not run: no GPU and no test driver: %v", err)
			cudaEnv = nil
		} else {
			cudaEnv = append(cudaEnv, gpu.EnvCUDALibrary+"="+lib)
		}
	}
	for _, backend := range []string{"host", "cuda"} {
		env := []string{"TROUPE_GPU=host"}
		if backend == "cuda" {
			if env = cudaEnv; env == nil {
				continue
			}
		}
		for _, n := range []int{2, 4} {
			for _, api := range []string{"messaging", "channel"} {
				out, err := launchEnv(t, n, env,
					"-gpu", "-gpu-api", api, "-grid", "24", "-blocks", "2x2x3", "-warmup", "10", "-iters", "20")
				if err != nil {
					t.Fatalf("%s, %d ranks, %s: %v\n%s", backend, n, api, err, out)
				}
				for _, want := range []string{
					"[0] gpu_api " + api + "\n",
					"[0] gpu_backend " + backend + "\n",
					"[0] residual 0.008044795268676186\n",
					"[0] field_hash 3139269223917833\n",
					"[0] check PASS max_abs_diff 0 ",
				} {
					if !strings.Contains(out, want) {
						t.Fatalf("%s, %d ranks, %s: no %q in the output:\n%s", backend, n, api, want, out)
					}
				}
				// Between processes of this host on the cuda backend, halos
				// from other ranks go by CUDA IPC; never on the host backend.
				ipc := !strings.Contains(out, "[0] gpu_ipc_halos 0\n")
				if !strings.Contains(out, "[0] gpu_ipc_halos ") || ipc != (backend == "cuda") {
					t.Fatalf("%s, %d ranks, %s: halos by CUDA IPC: want %v:\n%s", backend, n, api, backend == "cuda", out)
				}
			}
		}
	}
}

// A rank whose jacobi3d process dies mid-run while its wrapper exits 0 (so
// the launcher sees no failure): the survivors must fail promptly, naming
// the lost rank, not wait for -timeout. The script plays the dying rank:
// it kills its jacobi3d 1.5 s after starting it, well into the run (started
// within about 0.5 s here; a kill before the run would fail the survivors
// in a collective, without the message checked for).
func TestPeerLostMidRun(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var out bytes.Buffer
	script := `if [ "$TROUPE_RANK" = 1 ]; then "$0" "$@" & p=$!; sleep 1.5; kill -9 $p; exit 0; fi; exec "$0" "$@"`
	start := time.Now()
	err := bootstrap.Launch(ctx, bootstrap.LaunchConfig{
		N: 3, Program: "sh",
		Args: []string{"-c", script, os.Args[0], "-grid", "48", "-iters", "1000000", "-timeout", "30s"},
		Env:  []string{asMainEnv + "=1", "UCX_LOG_LEVEL=error"},
		TLS:  "shm", Stdout: &out, Stderr: &out,
	})
	took := time.Since(start)
	if err == nil || took > 10*time.Second ||
		!strings.Contains(out.String(), "[0] jacobi3d: rank 0: jacobi: the run cannot go on: transport: actor: peer rank 1 lost") {
		t.Fatalf("rank 1 lost: Launch returned %v after %v\n%s", err, took.Round(time.Millisecond), out.String())
	}
}

func TestBadFlags(t *testing.T) {
	out, err := launch(t, 2, "-blocks", "2x2")
	if err == nil || !strings.Contains(out, "want AxBxC") {
		t.Fatalf("bad -blocks: err %v\n%s", err, out)
	}
	for _, tc := range []struct{ args, want []string }{
		{[]string{"-gpu-api", "channel"}, []string{"needs -gpu"}},
		{[]string{"-gpu", "-gpu-api", "pigeon"}, []string{"want messaging or channel"}},
		{[]string{"-timeout", "0"}, []string{"-timeout 0s"}}, // failed later, as a rendezvous timeout
		// A grid without points: every rank panicked choosing the default
		// blocks (a division by zero) once the job had started.
		{[]string{"-grid", "0"}, []string{"grid 0x0x0"}},
		{[]string{"-grid", "8", "-nz", "-5"}, []string{"grid 8x8x-5"}},
	} {
		var stderr strings.Builder
		if status := run(tc.args, io.Discard, &stderr); status != 2 || !strings.Contains(stderr.String(), tc.want[0]) {
			t.Errorf("%v: status %d, stderr %q", tc.args, status, stderr.String())
		}
	}
}

// An argument that is not a flag is refused: the flag package stops
// there, and every flag after it was ignored (-iters 1 ran 100 sweeps).
func TestStrayArgument(t *testing.T) {
	var stderr strings.Builder
	status := run([]string{"-grid", "8", "stray", "-iters", "1"}, io.Discard, &stderr)
	if status != 2 || !strings.Contains(stderr.String(), `unexpected argument "stray"`) {
		t.Fatalf("status %d, stderr %q", status, stderr.String())
	}
}

func TestParseBlocks(t *testing.T) {
	if b, err := parseBlocks("4x3x2"); err != nil || b != [3]int{4, 3, 2} {
		t.Fatalf("parseBlocks: %v %v", b, err)
	}
	for _, s := range []string{"", "4x4", "4x0x1", "axbxc", "1x2x3x4"} {
		if _, err := parseBlocks(s); err == nil {
			t.Errorf("parseBlocks(%q) accepted", s)
		}
	}
}
