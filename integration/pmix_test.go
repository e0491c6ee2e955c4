package integration

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// openMPIRun returns Open MPI's mpirun, whose ranks reach its PMIx server,
// or "" when there is none.
func openMPIRun() string {
	for _, name := range []string{"mpirun.openmpi", "mpirun"} {
		path, err := exec.LookPath(name)
		if err != nil {
			continue
		}
		out, err := exec.Command(path, "--version").CombinedOutput()
		if err == nil && strings.Contains(string(out), "Open MPI") {
			return path
		}
	}
	return ""
}

// runMPI runs n copies of this test binary as the ranks of role under
// mpirun, with UCX limited to tls, and requires each to succeed.
func runMPI(t *testing.T, mpirun, role string, n int, tls string) string {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), rankTimeout+20*time.Second)
	defer cancel()
	args := []string{"-n", fmt.Sprint(n), "--oversubscribe", "--bind-to", "none",
		"-x", roleEnv + "=" + role, "-x", progressEnv + "=direct", "-x", "UCX_TLS=" + tls,
		// The job's own launcher: no troupe run variables may leak in.
		"-x", "TROUPE_RDV=", "-x", "TROUPE_TOKEN=", "-x", "TROUPE_RANK=", "-x", "TROUPE_SIZE=",
		exe}
	if os.Geteuid() == 0 {
		args = append([]string{"--allow-run-as-root"}, args...)
	}
	cmd := exec.CommandContext(ctx, mpirun, args...)
	start := time.Now()
	out, err := cmd.CombinedOutput()
	t.Logf("%s under mpirun over %s: %d ranks, %v", role, tls, n, time.Since(start).Round(time.Millisecond))
	if err != nil {
		t.Fatalf("mpirun: %v\n%s", err, out)
	}
	for r := range n {
		if want := fmt.Sprintf("%s: rank %d OK", role, r); !strings.Contains(string(out), want) {
			t.Fatalf("no %q:\n%s", want, out)
		}
		if want := fmt.Sprintf("rank %d: UCX_TLS=%s", r, tls); !strings.Contains(string(out), want) {
			t.Fatalf("rank %d did not run with UCX_TLS=%s:\n%s", r, tls, out)
		}
		if want := fmt.Sprintf("rank %d: bootstrap=*bootstrap.pmixClient", r); !strings.Contains(string(out), want) {
			t.Fatalf("rank %d did not join through PMIx:\n%s", r, out)
		}
	}
	return string(out)
}

// TestPMIxLaunch starts jobs with Open MPI's mpirun instead of troupe run:
// the ranks join through mpirun's PMIx server (bootstrap.FromEnv's PMIx
// backend), exchange their UCX worker addresses with PMIx put, commit, fence
// and get, and then run the data-integrity and actor-request scenarios
// over shared memory and TCP.
func TestPMIxLaunch(t *testing.T) {
	mpirun := openMPIRun()
	if mpirun == "" {
		t.Skip("no Open MPI mpirun on PATH: install openmpi-bin to test the PMIx bootstrap")
	}
	for _, tls := range []string{"self,sm", "self,tcp"} {
		t.Run(tls, func(t *testing.T) {
			out := runMPI(t, mpirun, "integrity", 2, tls)
			for _, n := range integritySizes {
				if want := fmt.Sprintf("rank 0: %d B round trip ok", n); !strings.Contains(out, want) {
					t.Fatalf("no %q:\n%s", want, out)
				}
			}
			out = runMPI(t, mpirun, "actor-request", actorRanks, tls)
			for r := range actorRanks {
				if want := fmt.Sprintf("rank %d: requests, futures and timeouts ok with every other rank", r); !strings.Contains(out, want) {
					t.Fatalf("no %q:\n%s", want, out)
				}
			}
		})
	}
}
