package main

import (
	"strings"
	"testing"
)

// An argument that is not a flag is refused: the flag package stops
// there, and every flag after it was ignored.
func TestStrayArgument(t *testing.T) {
	var stderr strings.Builder
	f, status := parseFlags([]string{"-L", "4", "stray", "-iters", "1"}, &stderr)
	if status != 2 || !strings.Contains(stderr.String(), `unexpected argument "stray"`) {
		t.Fatalf("status %d, flags %+v, stderr %q", status, f, stderr.String())
	}
}

func TestFlags(t *testing.T) {
	var stderr strings.Builder
	f, status := parseFlags([]string{"-L", "4", "-iters", "1", "-mode", "plain"}, &stderr)
	if status != -1 || f != (flags{L: 4, iters: 1, mode: "plain"}) || stderr.Len() != 0 {
		t.Fatalf("status %d, flags %+v, stderr %q", status, f, stderr.String())
	}
	if _, status := parseFlags([]string{"-h"}, &stderr); status != 0 {
		t.Fatalf("-h: status %d", status)
	}
	if _, status := parseFlags([]string{"-L", "x"}, &stderr); status != 2 {
		t.Fatalf("-L x: status %d", status)
	}
}
