package bootstrap

import (
	"bytes"
	"os"
	"strconv"
	"syscall"
	"time"
)

// rankProcAttr puts each rank in its own process group (so the launcher can
// signal the rank and everything it forked, and a terminal's Ctrl-C reaches
// only the launcher, which forwards it) and asks the kernel to SIGKILL the
// rank if the launcher's spawning thread dies (the launcher was killed).
func rankProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}

// waitGroupDead waits, at most timeout, until no live (non-zombie) process is
// left in process group pgid. The caller has SIGKILLed the group; this turns
// "signal sent" into "processes gone" (zombies whose parent died wait for
// init to reap them and are harmless).
func waitGroupDead(pgid int, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for delay := 100 * time.Microsecond; ; delay = min(2*delay, 10*time.Millisecond) {
		if !groupHasLive(pgid) {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(delay)
	}
}

func groupHasLive(pgid int) bool {
	d, err := os.Open("/proc")
	if err != nil {
		return false
	}
	defer d.Close()
	names, err := d.Readdirnames(-1)
	if err != nil {
		return false
	}
	for _, name := range names {
		if name[0] < '0' || name[0] > '9' {
			continue
		}
		stat, err := os.ReadFile("/proc/" + name + "/stat")
		if err != nil {
			continue
		}
		// After "pid (comm) ": state ppid pgrp ...
		i := bytes.LastIndexByte(stat, ')')
		if i < 0 {
			continue
		}
		f := bytes.Fields(stat[i+1:])
		if len(f) < 3 || string(f[0]) == "Z" || string(f[0]) == "X" {
			continue
		}
		if pg, err := strconv.Atoi(string(f[2])); err == nil && pg == pgid {
			return true
		}
	}
	return false
}
