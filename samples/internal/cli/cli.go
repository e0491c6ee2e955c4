// Package cli holds what the sample programs share in parsing their
// command lines.
package cli

import (
	"errors"
	"flag"
	"fmt"
	"io"
)

// Parse parses args with fs, whose errors go to stderr, and returns -1
// when the program should run, else its exit status: 0 after -h, 2 after
// a usage error. An argument that is not a flag is a usage error: the
// flag package stops at it, and every flag after it would be ignored.
func Parse(fs *flag.FlagSet, args []string, stderr io.Writer) int {
	fs.SetOutput(stderr)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "%s: unexpected argument %q (%s takes flags only; see -h)\n", fs.Name(), fs.Arg(0), fs.Name())
		return 2
	}
	return -1
}
