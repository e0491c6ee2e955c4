package cli

import (
	"flag"
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	for _, c := range []struct {
		args   []string
		status int
		want   string
	}{
		{[]string{"-n", "3"}, -1, ""},
		{[]string{"-h"}, 0, "Usage"},
		{[]string{"-n", "x"}, 2, "invalid value"},
		{[]string{"-n", "3", "stray", "-n", "4"}, 2, `prog: unexpected argument "stray"`},
	} {
		fs := flag.NewFlagSet("prog", flag.ContinueOnError)
		n := fs.Int("n", 1, "a number")
		var stderr strings.Builder
		if status := Parse(fs, c.args, &stderr); status != c.status || !strings.Contains(stderr.String(), c.want) {
			t.Errorf("%q: status %d, stderr %q; want %d and %q", c.args, status, stderr.String(), c.status, c.want)
		}
		if c.status == -1 && *n != 3 {
			t.Errorf("%q: n = %d", c.args, *n)
		}
	}
}

func ExampleParse() {
	fs := flag.NewFlagSet("prog", flag.ContinueOnError)
	iters := fs.Int("iters", 10, "iterations")
	if status := Parse(fs, []string{"-iters", "5"}, nil); status >= 0 {
		return // exit with status
	}
	_ = *iters // run
	// Output:
}
