//go:build cgo && linux

package bootstrap

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
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

// TestPMIxCollectiveTurns: a collective whose context ends while it waits
// returns at once and keeps its turn until it is over; Close gives up
// after pmixCloseWait while one still runs, without finalizing PMIx (the
// client here has no PMIx behind it: nothing may reach libpmix).
func TestPMIxCollectiveTurns(t *testing.T) {
	c := &pmixClient{rounds: map[string]int{}, turn: make(chan struct{}, 1)}
	release := make(chan struct{})
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		errc <- c.collective(ctx, "stuck", func() error { <-release; return nil })
	}()
	for len(c.turn) == 0 { // the stuck collective has its turn
		runtime.Gosched()
	}
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), `"stuck"`) {
		t.Fatalf("ended collective: %v", err)
	}
	ran := make(chan struct{})
	next := make(chan error, 1)
	go func() {
		next <- c.collective(context.Background(), "next", func() error { close(ran); return nil })
	}()
	if err := c.Close(); err == nil || !strings.Contains(err.Error(), "still waiting") {
		t.Fatalf("Close with a collective running: %v", err)
	}
	select {
	case <-ran:
		t.Fatal("the next collective ran before the stuck one was over")
	default:
	}
	close(release)
	if err := <-next; err != nil {
		t.Fatal(err)
	}
	<-ran
	c.closed = true // as Close would once PMIx is finalized
	if err := c.Barrier(context.Background(), "after"); !errors.Is(err, ErrClosed) {
		t.Fatalf("collective after Close: %v", err)
	}
}

// TestPMIxVersion: with libpmix installed, PMIxVersion names the library
// it loaded and PMIx's version.
func TestPMIxVersion(t *testing.T) {
	if !pmixInstalled() || os.Getenv(EnvPMIxLib) != "" {
		t.Skip("libpmix is not installed (or TROUPE_PMIX_LIB names another): nothing to report")
	}
	lib, v, err := PMIxVersion()
	if err != nil || !strings.HasPrefix(lib, "libpmix.so") || !strings.Contains(v, "PMIx") {
		t.Fatalf("PMIxVersion: %q, %q, %v", lib, v, err)
	}
	t.Logf("%s: %s", lib, v)
}
