//go:build unix && !linux

package bootstrap

import (
	"errors"
	"os"
)

// pipeBytes returns how many bytes the pipe holds unread: not known here
// (drain then waits for the rank's output for outputDrain at most).
func pipeBytes(*os.File) (int, error) { return 0, errors.ErrUnsupported }
