package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/troupe-hpc/troupe/samples/jacobi3d/jacobi"
)

// TestMPIReference checks the MPI version of the problem
// (mpiref/jacobi3d_mpi.c, what `make bench-jacobi-mpi` compares troupe with)
// against the serial reference bit for bit: residual and field hash on a
// cubic and a non-cubic grid, as a singleton and on 2 and 3 ranks, with and
// without -overlap, built as compare.sh builds it (scalar with -O2, and
// vectorised with -O3 -march=native -ffinite-math-only -fno-signed-zeros).
// It runs for each MPI whose compiler and headers are installed (CI
// installs Open MPI's, `make test-deps`) and is skipped where there is none.
func TestMPIReference(t *testing.T) {
	found := false
	builds := map[string][]string{
		"scalar": {"-O2"},
		"vec":    {"-O3", "-march=native", "-ffinite-math-only", "-fno-signed-zeros"},
	}
	for _, impl := range []string{"openmpi", "mpich"} {
		cc, err := exec.LookPath("mpicc." + impl)
		if err != nil {
			continue
		}
		if out, err := mpiHeaderCheck(t, cc); err != nil {
			// openmpi-bin installs mpicc.openmpi without mpi.h, which
			// comes with libopenmpi-dev.
			t.Logf("%s cannot compile an MPI program (no MPI headers?), %s skipped: %v\n%s", cc, impl, err, out)
			continue
		}
		found = true
		for name, flags := range builds {
			t.Run(impl+"/"+name, func(t *testing.T) { testMPIReference(t, impl, cc, flags) })
		}
	}
	if !found {
		t.Skip("no MPI compiler with its headers (mpicc.openmpi, mpicc.mpich): `make bench-jacobi-mpi` installs both")
	}
}

// mpiHeaderCheck compiles a program that only includes mpi.h with cc.
func mpiHeaderCheck(t *testing.T, cc string) ([]byte, error) {
	src := filepath.Join(t.TempDir(), "probe.c")
	if err := os.WriteFile(src, []byte("#include <mpi.h>\nint main(void) { return MPI_SUCCESS; }\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return exec.Command(cc, "-fsyntax-only", src).CombinedOutput()
}

func testMPIReference(t *testing.T, impl, cc string, flags []string) {
	bin := filepath.Join(t.TempDir(), "jacobi3d_mpi")
	args := append(append([]string{}, flags...), "-ffp-contract=off", "-Wno-stringop-overflow", "-o", bin, "mpiref/jacobi3d_mpi.c", "-lm")
	if out, err := exec.Command(cc, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", cc, err, out)
	}
	grids := [][3]int{{24, 24, 24}, {20, 12, 16}}
	const warmup, iters = 4, 16
	for _, g := range grids {
		field, residual := jacobi.Serial(g[0], g[1], g[2], warmup+iters)
		want := fmt.Sprintf("residual %s field_hash %d", strconv.FormatFloat(residual, 'g', -1, 64), jacobi.HashField(field))
		for _, ranks := range []int{1, 2, 3} {
			for _, overlap := range []bool{false, true} {
				args := []string{"-nx", fmt.Sprint(g[0]), "-ny", fmt.Sprint(g[1]), "-nz", fmt.Sprint(g[2]),
					"-warmup", fmt.Sprint(warmup), "-iters", fmt.Sprint(iters)}
				if overlap {
					args = append(args, "-overlap")
				}
				cmd := exec.Command(bin, args...)
				if ranks > 1 {
					cmd = exec.Command("mpirun."+impl, append([]string{"-n", fmt.Sprint(ranks), bin}, args...)...)
					if impl == "openmpi" {
						cmd = exec.Command("mpirun.openmpi", append([]string{"--oversubscribe", "-n", fmt.Sprint(ranks), bin}, args...)...)
					}
				}
				cmd.Env = append(os.Environ(), "OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
				out, err := cmd.CombinedOutput()
				if err != nil {
					t.Fatalf("grid %v, %d ranks, overlap %v: %v\n%s", g, ranks, overlap, err, out)
				}
				if got := mpiResult(t, string(out)); got != want {
					t.Errorf("grid %v, %d ranks, overlap %v: %s, want %s", g, ranks, overlap, got, want)
				}
			}
		}
	}
}

// mpiResult returns "residual R field_hash H" from the MPI program's output,
// the residual reprinted as Go's shortest form.
func mpiResult(t *testing.T, out string) string {
	t.Helper()
	var res, hash string
	for _, l := range strings.Split(out, "\n") {
		f := strings.Fields(l)
		if len(f) != 2 {
			continue
		}
		switch f[0] {
		case "residual":
			r, err := strconv.ParseFloat(f[1], 64)
			if err != nil {
				t.Fatalf("residual %q: %v", f[1], err)
			}
			res = strconv.FormatFloat(r, 'g', -1, 64)
		case "field_hash":
			hash = f[1]
		}
	}
	if res == "" || hash == "" {
		t.Fatalf("no residual or field_hash in:\n%s", out)
	}
	return "residual " + res + " field_hash " + hash
}
