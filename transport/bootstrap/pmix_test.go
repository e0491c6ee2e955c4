//go:build cgo && linux

package bootstrap

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestPMIxABI compiles a C program against the installed pmix.h and
// compares its sizes, offsets and constants with the hand-made declarations
// of pmix.go.
func TestPMIxABI(t *testing.T) {
	cflags, err := exec.Command("pkg-config", "--cflags", "pmix").Output()
	if err != nil {
		t.Skip("no pmix.h to compare with (pkg-config pmix failed: install libpmix-dev to run this test)")
	}
	if _, err := exec.LookPath("gcc"); err != nil {
		t.Skip("no gcc to compile the comparison")
	}
	vals, jobSize, collect := pmixABI()
	var src strings.Builder
	src.WriteString("#include <pmix.h>\n#include <stdio.h>\n#include <stddef.h>\nint main(void) {\n")
	for _, e := range pmixABINames {
		fmt.Fprintf(&src, "\tprintf(\"%%llu\\n\", (unsigned long long)(%s));\n", e)
	}
	src.WriteString("\tprintf(\"%s\\n%s\\n\", PMIX_JOB_SIZE, PMIX_COLLECT_DATA);\n\treturn 0;\n}\n")
	dir := t.TempDir()
	c, bin := filepath.Join(dir, "abi.c"), filepath.Join(dir, "abi")
	if err := os.WriteFile(c, []byte(src.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	args := append(strings.Fields(string(cflags)), "-o", bin, c)
	if out, err := exec.Command("gcc", args...).CombinedOutput(); err != nil {
		t.Fatalf("compiling against pmix.h: %v\n%s", err, out)
	}
	out, err := exec.Command(bin).Output()
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if len(lines) != len(pmixABINames)+2 {
		t.Fatalf("%d lines from the comparison program:\n%s", len(lines), out)
	}
	for i, name := range pmixABINames {
		want, err := strconv.ParseUint(lines[i], 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		if vals[i] != want {
			t.Errorf("%s: pmix.h says %d, pmix.go declares %d", name, want, vals[i])
		}
	}
	if lines[len(pmixABINames)] != jobSize || lines[len(pmixABINames)+1] != collect {
		t.Errorf("keys: pmix.h %q %q, pmix.go %q %q", lines[len(pmixABINames)], lines[len(pmixABINames)+1], jobSize, collect)
	}
}

// pmixHelperEnv makes the test binary run TestPMIxHelper's body: join
// through FromEnv and print the error.
const pmixHelperEnv = "TROUPE_TEST_PMIX_HELPER"

func TestPMIxHelper(t *testing.T) {
	if os.Getenv(pmixHelperEnv) == "" {
		t.Skip("run by TestPMIxErrors in a process of its own")
	}
	b, err := FromEnv(context.Background())
	if err == nil {
		b.Close()
		fmt.Println("JOINED")
		return
	}
	fmt.Println("ERROR:", err)
}

// TestPMIxErrors: under an environment that advertises PMIx, a library
// that cannot be loaded and a server that cannot be reached give errors
// that say so (each in a process of its own: libpmix stays loaded once
// loaded).
func TestPMIxErrors(t *testing.T) {
	env := []string{pmixHelperEnv + "=1", "PMIX_RANK=0", EnvRdv + "=", EnvToken + "=", EnvRank + "=", EnvSize + "="}
	for _, c := range []struct {
		name  string
		env   []string
		wants []string
		skip  bool
	}{
		{"missing library", []string{EnvPMIxLib + "=libtroupe-no-such-pmix.so"},
			[]string{"libtroupe-no-such-pmix.so", "could not be loaded", "troupe run"}, false},
		{"no server", nil, []string{"PMIx_Init"}, !pmixInstalled()},
	} {
		t.Run(c.name, func(t *testing.T) {
			if c.skip {
				t.Skip("libpmix is not installed: nothing to reach a server with")
			}
			cmd := exec.Command(os.Args[0], "-test.run=^TestPMIxHelper$", "-test.count=1")
			cmd.Env = append(append(os.Environ(), env...), c.env...)
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("helper: %v\n%s", err, out)
			}
			for _, w := range c.wants {
				if !strings.Contains(string(out), "ERROR:") || !strings.Contains(string(out), w) {
					t.Fatalf("want an error with %q:\n%s", w, out)
				}
			}
		})
	}
}

// pmixInstalled reports whether libpmix can be found by the dynamic loader.
func pmixInstalled() bool {
	out, err := exec.Command("/sbin/ldconfig", "-p").Output()
	return err == nil && strings.Contains(string(out), "libpmix.so")
}
