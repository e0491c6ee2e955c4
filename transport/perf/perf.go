// Package perf measures a transport the way the OSU micro-benchmarks do:
// one-way latency by ping-pong and bandwidth with a window of messages in
// flight. Both ranks of a pair call the same function; rank roles follow
// from Transport.Rank.
package perf

import (
	"context"
	"fmt"
	"time"

	"github.com/troupe-hpc/troupe/transport"
)

// Point is one measured message size.
type Point struct {
	Size  int     `json:"size"`
	LatUs float64 `json:"lat_us"`
	BwMBs float64 `json:"bw_MBps"`
}

// Config chooses sizes and repetition counts.
type Config struct {
	MinSize, MaxSize int // powers of two between them (default 8 B .. 4 MiB)
	Window           int // messages in flight for bandwidth (default 64)
	// Scale multiplies the default iteration counts (default 1).
	Scale float64
	// AnySource receives every message with transport.AnySource instead
	// of naming the peer, to measure the software matcher's cost.
	AnySource bool
}

func (c *Config) defaults() {
	if c.MinSize <= 0 {
		c.MinSize = 8
	}
	if c.MaxSize <= 0 {
		c.MaxSize = 4 << 20
	}
	if c.Window <= 0 {
		c.Window = 64
	}
	if c.Scale <= 0 {
		c.Scale = 1
	}
}

// Sizes lists the message sizes of the sweep.
func (c Config) Sizes() []int {
	c.defaults()
	var s []int
	for n := c.MinSize; n <= c.MaxSize; n *= 2 {
		s = append(s, n)
		if n > c.MaxSize/2 {
			break // the next step passes MaxSize (or would overflow)
		}
	}
	return s
}

// iterations mirrors OSU: many short iterations for small messages.
func iterations(size int, scale float64) (iters, warmup int) {
	switch {
	case size <= 8<<10:
		iters, warmup = 20000, 2000
	case size <= 256<<10:
		iters, warmup = 2000, 200
	default:
		iters, warmup = 200, 20
	}
	iters = max(int(float64(iters)*scale), 10)
	warmup = max(int(float64(warmup)*scale), 2)
	return
}

const (
	tagPing = 1
	tagAck  = 2
)

// Latency measures the one-way latency between ranks 0 and 1 for size-byte
// messages: half the mean round trip. Rank 1 echoes. Both ranks return the
// same value only on rank 0; rank 1 returns 0.
func Latency(ctx context.Context, t *transport.Transport, size int, scale float64) (float64, error) {
	return latency(ctx, t, size, scale, false)
}

// recvFrom is the source the ranks' receives name: the peer, or
// AnySource.
func recvFrom(peer int, anySource bool) int {
	if anySource {
		return transport.AnySource
	}
	return peer
}

func latency(ctx context.Context, t *transport.Transport, size int, scale float64, anySource bool) (float64, error) {
	if size < 0 {
		return 0, fmt.Errorf("latency of %d-byte messages: want a size of 0 or more", size)
	}
	if t.Rank() > 1 {
		return 0, nil
	}
	iters, warmup := iterations(size, scale)
	peer := 1 - t.Rank()
	from := recvFrom(peer, anySource)
	sbuf := make([]byte, size)
	rbuf := make([]byte, size)
	var start time.Time
	for i := 0; i < iters+warmup; i++ {
		if i == warmup {
			start = time.Now()
		}
		if t.Rank() == 0 {
			if err := t.Send(ctx, peer, tagPing, sbuf); err != nil {
				return 0, fmt.Errorf("latency %d B, iteration %d: %w", size, i, err)
			}
			if _, err := t.Recv(ctx, from, tagPing, rbuf); err != nil {
				return 0, fmt.Errorf("latency %d B, iteration %d: %w", size, i, err)
			}
		} else {
			if _, err := t.Recv(ctx, from, tagPing, rbuf); err != nil {
				return 0, fmt.Errorf("latency %d B, iteration %d: %w", size, i, err)
			}
			if err := t.Send(ctx, peer, tagPing, sbuf); err != nil {
				return 0, fmt.Errorf("latency %d B, iteration %d: %w", size, i, err)
			}
		}
	}
	if t.Rank() != 0 {
		return 0, nil
	}
	return time.Since(start).Seconds() * 1e6 / float64(iters) / 2, nil
}

// Bandwidth measures unidirectional bandwidth from rank 0 to rank 1 with
// window messages in flight, acknowledged per window (OSU osu_bw). The result
// (MB/s, 10^6 bytes per second) is valid on rank 0.
func Bandwidth(ctx context.Context, t *transport.Transport, size, window int, scale float64) (float64, error) {
	return bandwidth(ctx, t, size, window, scale, false)
}

func bandwidth(ctx context.Context, t *transport.Transport, size, window int, scale float64, anySource bool) (float64, error) {
	if size < 1 || window < 1 {
		return 0, fmt.Errorf("bandwidth of %d-byte messages, window %d: want a size and a window of at least 1", size, window)
	}
	if t.Rank() > 1 {
		return 0, nil
	}
	// About 2 GiB per point (as long as ucx_perftest's default 1 MiB run),
	// between 10 and 2000 windows.
	iters := int(float64(min(max((2<<30)/(size*window), 10), 2000)) * scale)
	iters = max(iters, 5)
	warmup := max(iters/10, 2)
	peer := 1 - t.Rank()
	// Like osu_bw, every message of the window uses the same buffer.
	buf := make([]byte, size)
	ack := make([]byte, 1)
	reqs := make([]*transport.Request, window)
	var start time.Time
	for i := 0; i < iters+warmup; i++ {
		if i == warmup {
			start = time.Now()
		}
		var err error
		for w := range reqs {
			if t.Rank() == 0 {
				reqs[w], err = t.Isend(peer, tagPing, buf)
			} else {
				reqs[w], err = t.Irecv(recvFrom(peer, anySource), tagPing, buf)
			}
			if err != nil {
				return 0, fmt.Errorf("bandwidth %d B: %w", size, err)
			}
		}
		for _, r := range reqs {
			if _, err := r.Wait(ctx); err != nil {
				return 0, fmt.Errorf("bandwidth %d B: %w", size, err)
			}
		}
		if t.Rank() == 0 {
			_, err = t.Recv(ctx, recvFrom(peer, anySource), tagAck, ack)
		} else {
			err = t.Send(ctx, peer, tagAck, ack)
		}
		if err != nil {
			return 0, fmt.Errorf("bandwidth %d B ack: %w", size, err)
		}
	}
	if t.Rank() != 0 {
		return 0, nil
	}
	sec := time.Since(start).Seconds()
	return float64(size) * float64(window) * float64(iters) / sec / 1e6, nil
}

// Sweep runs Latency and Bandwidth for every size of cfg. Results are valid
// on rank 0; each is passed to report as soon as it is measured.
func Sweep(ctx context.Context, t *transport.Transport, cfg Config, report func(Point)) ([]Point, error) {
	cfg.defaults()
	var out []Point
	for _, size := range cfg.Sizes() {
		lat, err := latency(ctx, t, size, cfg.Scale, cfg.AnySource)
		if err != nil {
			return out, err
		}
		bw, err := bandwidth(ctx, t, size, cfg.Window, cfg.Scale, cfg.AnySource)
		if err != nil {
			return out, err
		}
		p := Point{Size: size, LatUs: lat, BwMBs: bw}
		out = append(out, p)
		if report != nil && t.Rank() == 0 {
			report(p)
		}
	}
	return out, nil
}

// FormatSize prints a byte count the way OSU tables do (8, 1K, 4M).
func FormatSize(n int) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%dM", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%dK", n>>10)
	}
	return fmt.Sprint(n)
}
