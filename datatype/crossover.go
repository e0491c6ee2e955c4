package datatype

import (
	"slices"
	"time"
)

// Crossover measures, for one pair of layouts, whether host pack or SGL
// moves it faster on this machine. The layout-aware paper's Algorithm 1
// assumes one threshold T for every layout; where pack and SGL cross over
// depends on the machine (memcpy speed against the cost per IOV entry),
// so near T the adaptive scheme times both instead: Next hands out runs of
// one scheme, run transfers long, in the order pack, SGL, SGL, pack, pack,
// SGL, ...; Observe records how long each took, except the first transfer
// after a change of scheme; and once each scheme has trials timings the
// verdict from then on is the scheme with the shorter median time (the
// thresholds' choice when the two are within CrossoverMargin).
//
// Runs, not single transfers in turn: a transfer right after one of the
// other scheme is not what the transfers after the verdict will be (on a
// 2-vCPU VM an SGL transfer of 64 KiB after a pack one took 10-40 % less
// than SGL after SGL, and alternating single transfers picked SGL for 4 KiB
// blocks that pack moves 13-28 % faster; docs/noncontig.md). Pack, SGL,
// SGL, pack (ABBA), not pack, SGL, pack, SGL: a layout's first transfers
// are often its slowest and get faster for a while (fresh memory, caches,
// the heap growing), and with the schemes strictly in turn SGL's runs come
// later on average and look faster than they are. ABBA gives both schemes
// runs of the same average position, which cancels a steady trend in their
// means; the verdict compares medians, so a steep trend over few runs can
// still tip it between two schemes within a few percent of each other (a
// review found a linear trend flipping the verdict between equal schemes
// with 8 trials in runs of 4). Medians, not best times: one lucky transfer made a scheme's best
// time win while its typical time lost; not means, which one slow transfer
// on a shared machine would swing. With two trials per scheme the (lower)
// median is the best time. It is a pure state machine: the caller times the
// transfers.
type Crossover struct {
	trials  int
	run     int
	prefer  Scheme // the verdict unless the other is clearly faster
	issued  int    // transfers Next handed out before the verdict
	last    Scheme // the scheme of the latest observation (SchemeAuto: none)
	n       [2]int
	best    [2]time.Duration
	times   [2][]time.Duration
	verdict Scheme // SchemeAuto until decided
}

// median returns the lower median of ds (sorted in place).
func median(ds []time.Duration) time.Duration {
	slices.Sort(ds)
	return ds[(len(ds)-1)/2]
}

// CrossoverMargin is how much faster (as a fraction of the preferred
// scheme's median time) the other scheme must be to become the verdict: two
// schemes this close are equal for the adaptive default's purpose, and
// keeping the threshold's choice then avoids flipping on noise.
const CrossoverMargin = 0.03

// NewCrossover returns a Crossover that times each scheme trials times (at
// least 1) in runs of run transfers (at least 1; with 1 every transfer is
// timed, else the first after a change of scheme is not) and keeps prefer
// (SchemePack or SchemeSGL: what the thresholds alone would choose) unless
// the other scheme's median time is shorter by more than CrossoverMargin.
func NewCrossover(trials, run int, prefer Scheme) *Crossover {
	if prefer != SchemeSGL {
		prefer = SchemePack
	}
	return &Crossover{trials: max(trials, 1), run: max(run, 1), prefer: prefer, last: SchemeAuto, verdict: SchemeAuto}
}

func crossIndex(s Scheme) int {
	if s == SchemeSGL {
		return 1
	}
	return 0
}

// Next returns the scheme for the next transfer: the verdict once there is
// one, else the scheme of the current run (runs of pack, SGL, SGL, pack,
// pack, SGL, ...).
func (c *Crossover) Next() Scheme {
	if c.verdict != SchemeAuto {
		return c.verdict
	}
	k := c.issued / c.run
	c.issued++
	if (k+1)/2%2 == 1 {
		return SchemeSGL
	}
	return SchemePack
}

// Observe records that a transfer under s (SchemePack or SchemeSGL) took
// d, unless runs are longer than one transfer and it is the first
// observation of s since one of the other scheme.
// Once both schemes have trials timings the verdict is fixed: the
// preferred scheme, unless the other's median time is shorter by more
// than CrossoverMargin. Observations after the verdict, and of other schemes,
// are ignored.
func (c *Crossover) Observe(s Scheme, d time.Duration) {
	if c.verdict != SchemeAuto || (s != SchemePack && s != SchemeSGL) {
		return
	}
	first := s != c.last
	c.last = s
	if first && c.run > 1 {
		return
	}
	i := crossIndex(s)
	if c.n[i] == 0 || d < c.best[i] {
		c.best[i] = d
	}
	c.n[i]++
	c.times[i] = append(c.times[i], d)
	if c.n[0] >= c.trials && c.n[1] >= c.trials {
		p := crossIndex(c.prefer)
		c.verdict = c.prefer
		m := [2]time.Duration{median(c.times[0]), median(c.times[1])}
		if float64(m[1-p]) < float64(m[p])*(1-CrossoverMargin) {
			c.verdict = [2]Scheme{SchemePack, SchemeSGL}[1-p]
		}
	}
}

// Verdict returns the faster scheme and true once it is known.
func (c *Crossover) Verdict() (Scheme, bool) {
	return c.verdict, c.verdict != SchemeAuto
}

// Medians returns the median time of the pack and of the SGL trials so far
// (0 for a scheme not yet timed): with the verdict, what it was judged on.
func (c *Crossover) Medians() (pack, sgl time.Duration) {
	var m [2]time.Duration
	for i := range m {
		if len(c.times[i]) > 0 {
			m[i] = median(slices.Clone(c.times[i]))
		}
	}
	return m[0], m[1]
}

// Best returns the best time observed for pack and for SGL so far (0 for
// a scheme not yet timed).
func (c *Crossover) Best() (pack, sgl time.Duration) {
	return c.best[0], c.best[1]
}

// CrossoverTransfers is how many transfers of a layout pair the crossover
// measurement takes, one after another, until its verdict: 2 x
// CrossoverTrials with runs of 1, more with longer runs (the first
// transfer after each change of scheme is not timed). sgl of them go SGL.
func (th Thresholds) CrossoverTransfers() (n, sgl int) {
	c := NewCrossover(th.CrossoverTrials, th.CrossoverRun, SchemePack)
	for {
		if _, ok := c.Verdict(); ok {
			return n, sgl
		}
		s := c.Next()
		n++
		if s == SchemeSGL {
			sgl++
		}
		c.Observe(s, time.Millisecond)
	}
}

// InCrossoverBand reports whether a layout's average block lies within the
// calibration band around T, [T/CrossoverBand, T*CrossoverBand], where the
// adaptive scheme measures the pack/SGL crossover per layout (Crossover)
// instead of assuming it at T. A band of 0 or 1 turns measuring off.
func (th Thresholds) InCrossoverBand(st Stats) bool {
	if th.CrossoverBand <= 1 || st.Segments < 2 || th.ZCopyAvgBlock <= 0 {
		return false
	}
	lo := float64(th.ZCopyAvgBlock) / float64(th.CrossoverBand)
	hi := float64(th.ZCopyAvgBlock) * float64(th.CrossoverBand)
	return st.AvgBlock >= lo && st.AvgBlock <= hi && st.Segments <= th.SGLMaxSegments
}
