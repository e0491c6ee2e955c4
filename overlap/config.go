package overlap

import (
	"errors"
	"fmt"
	"math"
	"time"
)

// Config configures an Engine. Start from DefaultConfig and override what
// calibration or the user provides; New validates it.
type Config struct {
	// Enabled turns the engine on. When false every transfer is onloaded
	// (today's behaviour: nothing moves outside the receiver's calls), no
	// slot is ever handed out, and only the decision counters move.
	Enabled bool

	// Alpha is the per-byte cost of a rendezvous transfer in nanoseconds
	// per byte (LogGP's G; the inverse of the bandwidth). Paper 004, 5.1:
	// obtained offline, architecture specific. Use Calibrate.
	Alpha float64
	// Beta is the fixed per-message cost of a rendezvous transfer (LogGP's
	// L + o: handshake and latency). Paper 004, 5.1. Use Calibrate.
	Beta time.Duration

	// RendezvousThreshold is the size in bytes from which a message uses
	// the rendezvous protocol. Smaller (eager) messages arrive with their
	// header; the engine onloads them (there is nothing to move) and they
	// do not count in K. Match it to the transport's UCX_RNDV_THRESH.
	RendezvousThreshold int64

	// DeltaWeight is the weight of a new sample in the exponentially
	// weighted moving average of delta (receive posted -> transfer start),
	// in (0, 1]. The paper measures delta but does not say how it is
	// smoothed; 0.25 follows the usual RTT-estimator practice.
	DeltaWeight float64

	// Period is the length of a cancellation-accounting period (paper 004,
	// 5.1: "if the cancelation rate passes a threshold during a period ...
	// until the next period"). Periods are aligned to time zero of the
	// event clock: period n covers [n*Period, (n+1)*Period).
	Period time.Duration
	// OffloadRatio scales K in the offload rule: a transfer is offloaded
	// when the expected onload delay exceeds OffloadRatio * K. The paper
	// compares delta with K itself (1.0) because hardware rendezvous
	// offload costs bandwidth; troupe's progress goroutine moves the data
	// at the same speed as the receiver would, so offloading pays as soon
	// as a good part of the transfer can be hidden. 0 offloads whenever
	// any delay is expected.
	OffloadRatio float64
	// MinRevisit is the shortest Decision.Revisit delay the engine asks
	// for when it onloads an expected transfer. The delay is the time left
	// until the receiver's absence reaches OffloadRatio * K (the point at
	// which the rule would have offloaded), at least MinRevisit: a revisit
	// costs the transport a timer and, when it sleeps, a wake-up of tens
	// of microseconds, so asking sooner gains nothing. Must be > 0.
	MinRevisit time.Duration

	// CancelRateThreshold is the fraction of offloaded receives cancelled
	// within a period above which offloading stops until the next period.
	CancelRateThreshold float64
	// CancelMinOffloads is the number of offloads a period must have seen
	// before its cancellation rate is trusted (avoids throttling on the
	// first cancel of a period). Not in the paper; 0 trusts any rate.
	CancelMinOffloads int

	// PoolSlots is the number of slots in the pre-registered prefetch pool
	// (paper 004, 5.3: a pool registered at init). 0 disables prefetch; at
	// most MaxPoolSlots.
	PoolSlots int
	// SlotSize is the size in bytes of one pool slot.
	SlotSize int64
	// MaxPrefetchSize is the largest message the engine prefetches; 0 means
	// SlotSize. It must not exceed SlotSize.
	MaxPrefetchSize int64

	// PrefetchWindow is how many recent prefetch outcomes are kept per
	// peer (paper 004, 5.3: "history of the previous prefetches").
	PrefetchWindow int
	// PrefetchMinSamples is how many outcomes a peer needs before its
	// history can turn prefetching off; below it the engine prefetches.
	PrefetchMinSamples int
	// PrefetchUsefulRatio is the fraction of useful outcomes in the window
	// at or above which prefetching from that peer continues.
	PrefetchUsefulRatio float64
}

// DefaultConfig returns the defaults documented in docs/overlap.md. The
// paper gives no numbers for thresholds, periods or pool sizes; the values
// below are troupe's choices, each justified there. Alpha and Beta are
// placeholders for a 100 Gb/s link until Calibrate replaces them.
func DefaultConfig() Config {
	return Config{
		Enabled:             true,
		Alpha:               0.08, // 12.5 GB/s
		Beta:                2 * time.Microsecond,
		RendezvousThreshold: 8 << 10,
		DeltaWeight:         0.25,
		OffloadRatio:        0.5,
		MinRevisit:          20 * time.Microsecond,
		Period:              10 * time.Millisecond,
		CancelRateThreshold: 0.5,
		CancelMinOffloads:   4,
		PoolSlots:           8,
		SlotSize:            4 << 20,
		MaxPrefetchSize:     4 << 20,
		PrefetchWindow:      16,
		PrefetchMinSamples:  4,
		PrefetchUsefulRatio: 0.5,
	}
}

// MaxPoolSlots is the largest PoolSlots Validate accepts. The engine and
// the transport allocate a table of PoolSlots entries up front, so a
// count from a typo or an environment variable (TROUPE_OVERLAP_SLOTS) must
// not reach the allocator; 65536 slots of the default 4 MiB are 256 GiB,
// far beyond any rank's pool.
const MaxPoolSlots = 1 << 16

// ErrConfig is wrapped by every configuration validation error.
var ErrConfig = errors.New("overlap: invalid config")

// Validate reports the first inconsistency in c, wrapped in ErrConfig.
func (c Config) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{ErrConfig}, args...)...)
	}
	switch {
	case math.IsNaN(c.Alpha) || math.IsInf(c.Alpha, 0) || c.Alpha < 0:
		return bad("Alpha %v must be a finite number >= 0", c.Alpha)
	case c.Beta < 0:
		return bad("Beta %v must be >= 0", c.Beta)
	case c.RendezvousThreshold < 0:
		return bad("RendezvousThreshold %d must be >= 0", c.RendezvousThreshold)
	case !(c.DeltaWeight > 0 && c.DeltaWeight <= 1):
		return bad("DeltaWeight %v must be in (0, 1]", c.DeltaWeight)
	case math.IsNaN(c.OffloadRatio) || math.IsInf(c.OffloadRatio, 0) || c.OffloadRatio < 0:
		return bad("OffloadRatio %v must be a finite number >= 0", c.OffloadRatio)
	case c.MinRevisit <= 0:
		return bad("MinRevisit %v must be > 0", c.MinRevisit)
	case c.Period <= 0:
		return bad("Period %v must be > 0", c.Period)
	case !(c.CancelRateThreshold >= 0 && c.CancelRateThreshold <= 1):
		return bad("CancelRateThreshold %v must be in [0, 1]", c.CancelRateThreshold)
	case c.CancelMinOffloads < 0:
		return bad("CancelMinOffloads %d must be >= 0", c.CancelMinOffloads)
	case c.PoolSlots < 0 || c.PoolSlots > MaxPoolSlots:
		return bad("PoolSlots %d must be in [0, MaxPoolSlots=%d]", c.PoolSlots, MaxPoolSlots)
	case c.PoolSlots > 0 && c.SlotSize <= 0:
		return bad("SlotSize %d must be > 0 when PoolSlots > 0", c.SlotSize)
	case c.MaxPrefetchSize < 0 || c.MaxPrefetchSize > c.SlotSize:
		return bad("MaxPrefetchSize %d must be in [0, SlotSize=%d]", c.MaxPrefetchSize, c.SlotSize)
	case c.PrefetchWindow < 1:
		return bad("PrefetchWindow %d must be >= 1", c.PrefetchWindow)
	case c.PrefetchMinSamples < 0 || c.PrefetchMinSamples > c.PrefetchWindow:
		return bad("PrefetchMinSamples %d must be in [0, PrefetchWindow=%d]", c.PrefetchMinSamples, c.PrefetchWindow)
	case !(c.PrefetchUsefulRatio >= 0 && c.PrefetchUsefulRatio <= 1):
		return bad("PrefetchUsefulRatio %v must be in [0, 1]", c.PrefetchUsefulRatio)
	}
	return nil
}

// maxPrefetch is the effective prefetch size limit.
func (c Config) maxPrefetch() int64 {
	if c.MaxPrefetchSize == 0 {
		return c.SlotSize
	}
	return c.MaxPrefetchSize
}

// cost is the LogGP estimate alpha*size + beta in nanoseconds.
func (c Config) cost(size int64) float64 {
	return c.Alpha*float64(size) + float64(c.Beta)
}
