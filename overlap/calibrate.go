package overlap

import (
	"errors"
	"fmt"
	"math"
	"time"
)

// Sample is one calibration measurement: the one-way time to move Size
// bytes with the rendezvous protocol (half a ping-pong round trip).
type Sample struct {
	Size int64
	Time time.Duration
}

// Fit is the result of Calibrate: time(size) ~= Alpha*size + Beta.
type Fit struct {
	Alpha float64       // ns per byte
	Beta  time.Duration // per-message cost
	// R2 is the coefficient of determination of the fit (1 = perfect).
	R2 float64
	// BetaClamped is true when the least-squares intercept was negative
	// (noise on near-zero latencies) and Beta was set to 0.
	BetaClamped bool
}

// Calibration errors, wrapped with detail.
var (
	ErrTooFewSamples = errors.New("overlap: calibration needs at least 2 samples")
	ErrBadSample     = errors.New("overlap: invalid calibration sample")
	ErrDegenerate    = errors.New("overlap: calibration samples need at least 2 distinct sizes")
	ErrBadFit        = errors.New("overlap: calibration fit is not physical")
)

// Calibrate fits the LogGP-style cost model time = alpha*size + beta to
// samples by ordinary least squares. It is pure: the caller runs the
// ping-pong (paper 004 obtains alpha and beta offline; troupe measures them
// with a short ping-pong at start-up) and passes the one-way times.
//
// It rejects fewer than 2 samples, negative sizes, non-positive times,
// fewer than 2 distinct sizes, fits whose slope is not positive (time
// must grow with size) and intercepts beyond a time.Duration. A negative
// intercept is clamped to 0.
func Calibrate(samples []Sample) (Fit, error) {
	if len(samples) < 2 {
		return Fit{}, fmt.Errorf("%w: got %d", ErrTooFewSamples, len(samples))
	}
	// Sizes and times are taken relative to the first sample's, in
	// integers, so that distinct sizes stay distinct however large they
	// are (their float64 values alone could round to the same mean).
	s0, t0 := samples[0].Size, samples[0].Time
	distinct := false
	var mx, my float64
	for i, s := range samples {
		if s.Size < 0 || s.Time <= 0 {
			return Fit{}, fmt.Errorf("%w: sample %d: size %d time %v", ErrBadSample, i, s.Size, s.Time)
		}
		distinct = distinct || s.Size != s0
		mx += float64(s.Size - s0)
		my += float64(s.Time - t0)
	}
	if !distinct {
		return Fit{}, ErrDegenerate
	}
	n := float64(len(samples))
	mx /= n
	my /= n
	var sxx, sxy, syy float64
	for _, s := range samples {
		dx, dy := float64(s.Size-s0)-mx, float64(s.Time-t0)-my
		sxx += dx * dx
		sxy += dx * dy
		syy += dy * dy
	}
	if sxx == 0 {
		return Fit{}, ErrDegenerate
	}
	alpha := sxy / sxx
	if !(alpha > 0) || math.IsInf(alpha, 0) {
		return Fit{}, fmt.Errorf("%w: alpha %v ns/byte", ErrBadFit, alpha)
	}
	beta := float64(t0) + my - alpha*(float64(s0)+mx)
	f := Fit{Alpha: alpha, R2: 1}
	if syy > 0 {
		f.R2 = sxy * sxy / (sxx * syy)
	}
	if beta < 0 {
		f.BetaClamped = true
		beta = 0
	}
	if !(beta < math.MaxInt64) {
		return Fit{}, fmt.Errorf("%w: beta %v ns does not fit a time.Duration", ErrBadFit, beta)
	}
	f.Beta = time.Duration(math.Round(beta))
	return f, nil
}

// Apply returns c with Alpha and Beta taken from f.
func (f Fit) Apply(c Config) Config {
	c.Alpha, c.Beta = f.Alpha, f.Beta
	return c
}
