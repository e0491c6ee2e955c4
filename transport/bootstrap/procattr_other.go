//go:build unix && !linux

package bootstrap

import "syscall"

// rankProcAttr puts each rank in its own process group; see procattr_linux.go.
func rankProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true}
}
