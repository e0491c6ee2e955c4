package transport

import (
	"fmt"
	"runtime"
	"strings"

	"golang.org/x/sys/unix"
)

// CPUYield says whether the progress goroutine, while it polls briefly
// before sleeping on the event fd, also gives the processor to the
// machine's other threads (sched_yield) on each idle poll.
//
// On a host with more ranks than processors, a rank polling for its
// neighbour's message otherwise keeps the processor that neighbour needs to
// send it, until the kernel preempts one of them; yielding hands it over,
// as Open MPI's yield_when_idle does. The polls stay bounded by
// Options.Spin: a rank with nothing to do still sleeps.
type CPUYield int

const (
	// CPUYieldAuto yields when the host is oversubscribed: more ranks on
	// it than processors its ranks may run on together (the union of
	// their affinity masks, exchanged at start-up, so that ranks pinned
	// one to a core are not taken for sixteen ranks on one processor).
	// Counting GOMAXPROCS too made two ranks of two processors on two
	// cores yield, and an actor round trip went from 2.4-4.1 to 4.1-5.9
	// µs. The default.
	CPUYieldAuto CPUYield = iota
	// CPUYieldOn always yields on idle polls.
	CPUYieldOn
	// CPUYieldOff never does.
	CPUYieldOff
)

// EnvCPUYield names the environment variable that overrides
// Options.CPUYield: auto, on or off.
const EnvCPUYield = "TROUPE_CPU_YIELD"

// String returns auto, on or off.
func (y CPUYield) String() string {
	switch y {
	case CPUYieldOn:
		return "on"
	case CPUYieldOff:
		return "off"
	default:
		return "auto"
	}
}

// ParseCPUYield parses auto, on or off.
func ParseCPUYield(s string) (CPUYield, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "auto":
		return CPUYieldAuto, nil
	case "on", "1", "y", "yes":
		return CPUYieldOn, nil
	case "off", "0", "n", "no":
		return CPUYieldOff, nil
	}
	return CPUYieldAuto, fmt.Errorf("%w: %s=%q is not auto, on or off", ErrInvalid, EnvCPUYield, s)
}

// cpuYieldWanted resolves mode (the environment first) for a rank with
// hostRanks ranks on its host and cpus the processors those ranks may use
// together, and says why.
func cpuYieldWanted(mode CPUYield, env string, haveEnv bool, hostRanks, cpus int) (bool, string, error) {
	if haveEnv {
		m, err := ParseCPUYield(env)
		if err != nil {
			return false, "", err
		}
		mode = m
	}
	switch mode {
	case CPUYieldOn:
		return true, "asked for", nil
	case CPUYieldOff:
		return false, "", nil
	}
	if hostRanks > cpus {
		return true, fmt.Sprintf("%d ranks on %d processors", hostRanks, cpus), nil
	}
	return false, "", nil
}

// setupCPUYield decides t.cpuYield once the ranks sharing this host are
// known (cmaSetup).
func (t *Transport) setupCPUYield() error {
	host := 0
	for _, same := range t.sameHost {
		if same {
			host++
		}
	}
	env, haveEnv := syscallGetenv(EnvCPUYield)
	cpus := t.hostCPUs
	if cpus == 0 {
		cpus = runtime.NumCPU() // the kernel did not say: this rank's own count
	}
	on, why, err := cpuYieldWanted(t.opts.CPUYield, env, haveEnv, host, cpus)
	if err != nil {
		return err
	}
	t.cpuYield = on
	if on {
		t.log.Info("idle polls yield the processor (sched_yield): " + why)
	}
	return nil
}

// yieldCPU gives the processor to another runnable thread, if any.
func yieldCPU() { _, _, _ = unix.Syscall(unix.SYS_SCHED_YIELD, 0, 0, 0) }
