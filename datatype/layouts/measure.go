package layouts

import (
	"fmt"
	"runtime"
	"time"

	dt "github.com/troupe-hpc/troupe/datatype"
)

// Result is one layout's measured bandwidths in GB/s (10^9 bytes per
// second of packed data), each the best of a few rounds.
type Result struct {
	Layout     string  `json:"layout"`
	Bytes      int64   `json:"bytes"`
	PackGBps   float64 `json:"pack_GBps"`
	UnpackGBps float64 `json:"unpack_GBps"`
	CopyGBps   float64 `json:"copy_GBps"`
	Workers    int     `json:"workers,omitempty"` // goroutines per pack and unpack, when more than one
}

// Buffers allocates and fills the source buffer of l and a packed buffer.
func (l Layout) Buffers() (src, packed []byte) {
	src = make([]byte, l.Alloc)
	Fill(src, l.Base)
	return src, make([]byte, l.Packed)
}

// Measure measures pack, unpack and copy of the same number of bytes for l
// with warm caches: each operation is repeated until a round lasts about
// round, and the best of rounds rounds is reported. With workers > 1, pack
// and unpack use PackParallel and UnpackParallel with as many goroutines as
// the layout's Workers allows (one for all but page-bound layouts).
func Measure(l Layout, round time.Duration, rounds, workers int) (Result, error) {
	src, packed := l.Buffers()
	cpy := make([]byte, l.Packed)
	// Finish the garbage collection the large allocation started before
	// measuring: Fill's long copies hold off its mark termination, and
	// meanwhile an idle mark worker kept the other processor busy for up
	// to 0.7 s (GODEBUG=gctrace=1), into the first rounds.
	runtime.GC()
	w := l.Type.Workers(1, workers)
	srcR, packedR := dt.SliceRegion(src), dt.SliceRegion(packed)
	pack := func() (int64, error) { return l.Type.PackParallel(packedR, srcR, l.Base, 1, 0, w) }
	if n, err := pack(); err != nil || n != l.Packed {
		return Result{}, fmt.Errorf("layouts: %s: pack returned %d, %v; want %d bytes", l.Name, n, err, l.Packed)
	}
	ops := []func() error{
		func() error { _, err := pack(); return err },
		func() error { _, err := l.Type.UnpackParallel(srcR, packedR, l.Base, 1, 0, w); return err },
		func() error { copy(cpy, packed); return nil },
	}
	var gbps [3]float64
	for i, op := range ops {
		g, err := rate(op, l.Packed, round, rounds)
		if err != nil {
			return Result{}, fmt.Errorf("layouts: %s: %w", l.Name, err)
		}
		gbps[i] = g
	}
	r := Result{Layout: l.Name, Bytes: l.Packed, PackGBps: gbps[0], UnpackGBps: gbps[1], CopyGBps: gbps[2]}
	if w > 1 {
		r.Workers = w
	}
	return r, nil
}

// rate returns the best bandwidth of op over rounds rounds of about round.
func rate(op func() error, bytes int64, round time.Duration, rounds int) (float64, error) {
	// Warm up and calibrate.
	n := 1
	for {
		start := time.Now()
		for i := 0; i < n; i++ {
			if err := op(); err != nil {
				return 0, err
			}
		}
		el := time.Since(start)
		if el >= round/4 || n >= 1<<30 {
			n = int(float64(n) * float64(round) / float64(max(el, time.Microsecond)))
			n = max(n, 1)
			break
		}
		n *= 4
	}
	best := 0.0
	for r := 0; r < max(rounds, 1); r++ {
		start := time.Now()
		for i := 0; i < n; i++ {
			if err := op(); err != nil {
				return 0, err
			}
		}
		el := time.Since(start).Seconds()
		if g := float64(bytes) * float64(n) / el / 1e9; g > best {
			best = g
		}
	}
	return best, nil
}

// MeasureAll builds and measures every layout in table order, with up to
// workers goroutines per pack and unpack (see Measure).
func MeasureAll(round time.Duration, rounds, workers int) ([]Result, error) {
	var out []Result
	for _, name := range Names {
		l, err := Build(name)
		if err != nil {
			return nil, err
		}
		r, err := Measure(l, round, rounds, workers)
		if err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	return out, nil
}
