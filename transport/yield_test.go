package transport

import (
	"errors"
	"testing"
)

// TestCPUYieldWanted checks when idle polls yield the processor: by the
// option, by the environment (which wins), and in auto mode by whether the
// host has more ranks than processors.
func TestCPUYieldWanted(t *testing.T) {
	for _, c := range []struct {
		mode      CPUYield
		env       string
		haveEnv   bool
		ranks, cp int
		want      bool
	}{
		{CPUYieldAuto, "", false, 4, 2, true},  // four ranks on two cores
		{CPUYieldAuto, "", false, 2, 2, false}, // one core each
		{CPUYieldAuto, "", false, 1, 2, false},
		{CPUYieldAuto, "", false, 3, 2, true},
		{CPUYieldOn, "", false, 1, 16, true},
		{CPUYieldOff, "", false, 8, 2, false},
		{CPUYieldAuto, "off", true, 8, 2, false},
		{CPUYieldOff, "on", true, 1, 16, true},
		{CPUYieldOn, "auto", true, 1, 16, false},
		{CPUYieldOn, "", true, 1, 16, false}, // set but empty: auto
	} {
		got, why, err := cpuYieldWanted(c.mode, c.env, c.haveEnv, c.ranks, c.cp)
		if err != nil || got != c.want || got && why == "" {
			t.Errorf("cpuYieldWanted(%v, %q/%v, %d ranks on %d cpus) = %v %q %v, want %v",
				c.mode, c.env, c.haveEnv, c.ranks, c.cp, got, why, err, c.want)
		}
	}
	if _, _, err := cpuYieldWanted(CPUYieldAuto, "sometimes", true, 1, 1); !errors.Is(err, ErrInvalid) {
		t.Errorf("TROUPE_CPU_YIELD=sometimes: err %v, want ErrInvalid", err)
	}
	for _, y := range []CPUYield{CPUYieldAuto, CPUYieldOn, CPUYieldOff} {
		if p, err := ParseCPUYield(y.String()); err != nil || p != y {
			t.Errorf("ParseCPUYield(%q) = %v, %v", y.String(), p, err)
		}
	}
}
