package datatype

import (
	"errors"
	"fmt"
	"math/bits"
)

// ErrInvalidArgument is wrapped by every error caused by a bad argument: a
// negative count, mismatched slice lengths, a subarray out of range, a nil or
// freed type, a buffer too small for the data the type describes.
var ErrInvalidArgument = errors.New("datatype: invalid argument")

// ErrOverflow is wrapped (together with ErrInvalidArgument) when a size,
// extent or displacement does not fit in 64 bits.
var ErrOverflow = errors.New("datatype: 64-bit overflow")

// ErrFreed is wrapped (together with ErrInvalidArgument) when a freed type is
// used.
var ErrFreed = errors.New("datatype: type has been freed")

func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrInvalidArgument}, args...)...)
}

func overflow(what string) error {
	return fmt.Errorf("%w: %w: %s", ErrInvalidArgument, ErrOverflow, what)
}

// arith does checked 64-bit arithmetic; the first overflow is remembered and
// every later result is meaningless until err is checked.
type arith struct {
	bad  bool
	what string
}

func (a *arith) fail(what string) {
	if !a.bad {
		a.bad, a.what = true, what
	}
}

func (a *arith) add(x, y int64, what string) int64 {
	s := x + y
	if (x > 0 && y > 0 && s < 0) || (x < 0 && y < 0 && s >= 0) {
		a.fail(what)
	}
	return s
}

func (a *arith) sub(x, y int64, what string) int64 {
	d := x - y
	if (y < 0 && d < x) || (y > 0 && d > x) {
		a.fail(what)
	}
	return d
}

func (a *arith) mul(x, y int64, what string) int64 {
	if x == 0 || y == 0 {
		return 0
	}
	neg := (x < 0) != (y < 0)
	ux, uy := abs64(x), abs64(y)
	hi, lo := bits.Mul64(ux, uy)
	if hi != 0 || (!neg && lo > 1<<63-1) || (neg && lo > 1<<63) {
		a.fail(what)
		return 0
	}
	if neg {
		return -int64(lo)
	}
	return int64(lo)
}

func (a *arith) err() error {
	if a.bad {
		return overflow(a.what)
	}
	return nil
}

func abs64(x int64) uint64 {
	if x < 0 {
		return uint64(-x) // -MinInt64 wraps to 1<<63, which is right as uint64
	}
	return uint64(x)
}
