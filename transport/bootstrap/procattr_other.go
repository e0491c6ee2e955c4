//go:build unix && !linux

package bootstrap

import (
	"syscall"
	"time"
)

// rankProcAttr puts each rank in its own process group; see procattr_linux.go.
func rankProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true}
}

// waitGroupDead polls until the group can no longer be signalled (zombies
// included: there is no portable /proc to tell them apart).
func waitGroupDead(pgid int, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for syscall.Kill(-pgid, 0) == nil {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(time.Millisecond)
	}
	return true
}
