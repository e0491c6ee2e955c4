package bootstrap

import "syscall"

// rankProcAttr puts each rank in its own process group (so the launcher can
// signal the rank and everything it forked, and a terminal's Ctrl-C reaches
// only the launcher, which forwards it) and asks the kernel to SIGKILL the
// rank if the launcher's spawning thread dies (the launcher was killed).
func rankProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}
