package bootstrap

import (
	"os"

	"golang.org/x/sys/unix"
)

// pipeBytes returns how many bytes the pipe holds unread.
func pipeBytes(f *os.File) (int, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return 0, err
	}
	var n int
	var ierr error
	if err := rc.Control(func(fd uintptr) { n, ierr = unix.IoctlGetInt(int(fd), unix.TIOCINQ) }); err != nil {
		return 0, err
	}
	return n, ierr
}
