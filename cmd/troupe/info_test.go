package main

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/troupe-hpc/troupe/transport/metrics"
)

// TestInfoJobs: troupe info says whether the PMIx client loads (here with a
// library that does not exist, so that the answer does not depend on the
// machine) and whether metrics are served.
func TestInfoJobs(t *testing.T) {
	cmd := exec.Command(os.Args[0], "info")
	cmd.Env = append(os.Environ(), envTestMain+"=1", "TROUPE_PMIX_LIB=libtroupe-no-such-pmix.so", metrics.AddrEnv+"=127.0.0.1:9400")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("troupe info: %v\n%s", err, out)
	}
	for _, want := range []string{
		"\nJobs:\n",
		"  pmix          unavailable (mpirun and srun launches fail; troupe run works): bootstrap: pmix:",
		"libtroupe-no-such-pmix.so",
		"  metrics       TROUPE_METRICS_ADDR=127.0.0.1:9400: rank r serves",
	} {
		if !strings.Contains(string(out), want) {
			t.Errorf("troupe info has no %q:\n%s", want, out)
		}
	}
}
