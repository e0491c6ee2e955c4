package main

import (
	"strings"
	"testing"
	"time"
)

// An argument that is not a flag is refused: the flag package stops
// there, and every flag after it was ignored.
func TestStrayArgument(t *testing.T) {
	var stderr strings.Builder
	f, status := parseFlags([]string{"-max", "64", "stray", "-scale", "0.5"}, &stderr)
	if status != 2 || !strings.Contains(stderr.String(), `unexpected argument "stray"`) {
		t.Fatalf("status %d, flags %+v, stderr %q", status, f, stderr.String())
	}
}

func TestFlags(t *testing.T) {
	var stderr strings.Builder
	f, status := parseFlags([]string{"-max", "64", "-scale", "0.5", "-progress", "queue", "-idle", "1s"}, &stderr)
	if status != -1 || f != (flags{maxSize: 64, scale: 0.5, progress: "queue", idle: time.Second}) || stderr.Len() != 0 {
		t.Fatalf("status %d, flags %+v, stderr %q", status, f, stderr.String())
	}
	if _, status := parseFlags([]string{"-h"}, &stderr); status != 0 {
		t.Fatalf("-h: status %d", status)
	}
	if _, status := parseFlags([]string{"-max", "x"}, &stderr); status != 2 {
		t.Fatalf("-max x: status %d", status)
	}
}
