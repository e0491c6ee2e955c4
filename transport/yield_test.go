package transport

import (
	"errors"
	"os"
	"runtime"
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

// TestHostInfoCPUs: the host entry a rank publishes carries its affinity
// mask, which reads back whole; short entries are refused; the processors
// of a host are the union of its ranks' masks.
func TestHostInfoCPUs(t *testing.T) {
	b := hostInfo(true, false)
	p, ok := parseHostInfo(b)
	if !ok {
		t.Fatalf("own entry %x refused", b)
	}
	if p.pid != uint64(os.Getpid()) || p.node != nodeID() || p.flags != infoCMA {
		t.Fatalf("read back pid %d node %q flags %#x", p.pid, p.node, p.flags)
	}
	if got := unionCPUs([][]byte{p.cpus}); got != runtime.NumCPU() {
		t.Fatalf("own mask has %d processors, runtime.NumCPU %d", got, runtime.NumCPU())
	}
	for n := 0; n < 27+len(p.cpus); n++ {
		if _, ok := parseHostInfo(b[:n]); ok {
			t.Fatalf("entry cut to %d of %d bytes accepted", n, len(b))
		}
	}
	one := func(cpu int) []byte { // a rank pinned to one processor
		m := make([]byte, cpu/8+1)
		m[cpu/8] = 1 << (cpu % 8)
		return m
	}
	var pinned [][]byte
	for cpu := range 16 {
		pinned = append(pinned, one(cpu))
	}
	for _, c := range []struct {
		masks [][]byte
		want  int
	}{
		{nil, 0},
		{pinned, 16},                              // sixteen ranks, one core each
		{[][]byte{one(3), one(3), one(3)}, 1},     // three ranks on one core
		{[][]byte{{0x0f}, {0x3c}}, 6},             // overlapping masks count once
		{[][]byte{{0x01}, {0x00, 0x00, 0x80}}, 2}, // masks of different lengths
	} {
		if got := unionCPUs(c.masks); got != c.want {
			t.Errorf("unionCPUs(%x) = %d, want %d", c.masks, got, c.want)
		}
	}
	// Sixteen ranks pinned one to a core do not yield; sixteen ranks on
	// their sixteen processors' union less one do.
	if on, _, _ := cpuYieldWanted(CPUYieldAuto, "", false, 16, unionCPUs(pinned)); on {
		t.Error("ranks pinned one per core yield")
	}
	if on, _, _ := cpuYieldWanted(CPUYieldAuto, "", false, 16, unionCPUs(pinned[1:])); !on {
		t.Error("sixteen ranks on fifteen processors do not yield")
	}
}
