package transport

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"sort"
	"time"

	"github.com/troupe-hpc/troupe/overlap"
)

// CalibrationTag is the user tag CalibrateOverlap uses; nothing else may use
// it with the calibrating peer while the calibration runs.
const CalibrationTag = MaxUserTag

// CalibrationSizes are the message sizes CalibrateOverlap measures: the
// rendezvous range the benchmark and the default pool cover.
var CalibrationSizes = []int{64 << 10, 256 << 10, 1 << 20, 2 << 20}

// CalibrateOverlap measures the rendezvous cost model with a short
// ping-pong (the median round trip per size) between this rank and peer (both call it, naming each other),
// fits time = alpha*size + beta (overlap.Calibrate) and installs alpha and
// beta in the rank's rendezvous policy. The lower rank measures and sends
// the fit to the other, so both use the same numbers. reps is the number of
// timed round trips per size (at least 1; 2 untimed ones come first).
func (t *Transport) CalibrateOverlap(ctx context.Context, peer, reps int) (overlap.Fit, error) {
	if t.opts.Overlap == nil {
		return overlap.Fit{}, fmt.Errorf("%w: calibrate overlap: the transport has no rendezvous policy", ErrInvalid)
	}
	if err := t.checkRank(peer, "calibrate"); err != nil {
		return overlap.Fit{}, err
	}
	if peer == t.rank {
		return overlap.Fit{}, fmt.Errorf("%w: calibrate overlap: peer %d is this rank", ErrInvalid, peer)
	}
	reps = max(reps, 1)
	const warmup = 2
	pinger := t.rank < peer
	buf := make([]byte, CalibrationSizes[len(CalibrationSizes)-1])
	var samples []overlap.Sample
	for _, n := range CalibrationSizes {
		b := buf[:n]
		var times []time.Duration
		for i := 0; i < warmup+reps; i++ {
			start := time.Now()
			if pinger {
				r, err := t.Irecv(peer, CalibrationTag, b)
				if err != nil {
					return overlap.Fit{}, err
				}
				if err := t.Send(ctx, peer, CalibrationTag, b); err != nil {
					return overlap.Fit{}, fmt.Errorf("calibrate overlap: %w", err)
				}
				if _, err := r.Wait(ctx); err != nil {
					return overlap.Fit{}, fmt.Errorf("calibrate overlap: %w", err)
				}
				if i >= warmup {
					times = append(times, time.Since(start)/2)
				}
				continue
			}
			if _, err := t.Recv(ctx, peer, CalibrationTag, b); err != nil {
				return overlap.Fit{}, fmt.Errorf("calibrate overlap: %w", err)
			}
			if err := t.Send(ctx, peer, CalibrationTag, b); err != nil {
				return overlap.Fit{}, fmt.Errorf("calibrate overlap: %w", err)
			}
		}
		if pinger {
			// The median round trip per size: on a shared machine single
			// round trips are often stretched by preemption.
			sort.Slice(times, func(i, j int) bool { return times[i] < times[j] })
			samples = append(samples, overlap.Sample{Size: int64(n), Time: times[len(times)/2]})
		}
	}
	var msg [16]byte
	var fit overlap.Fit
	if pinger {
		f, err := overlap.Calibrate(samples)
		if err != nil {
			// Tell the peer, so it does not wait for a fit forever.
			_ = t.Send(ctx, peer, CalibrationTag, msg[:])
			return overlap.Fit{}, fmt.Errorf("calibrate overlap: %w", err)
		}
		fit = f
		binary.LittleEndian.PutUint64(msg[0:], math.Float64bits(fit.Alpha))
		binary.LittleEndian.PutUint64(msg[8:], uint64(fit.Beta))
		if err := t.Send(ctx, peer, CalibrationTag, msg[:]); err != nil {
			return overlap.Fit{}, fmt.Errorf("calibrate overlap: %w", err)
		}
	} else {
		if _, err := t.Recv(ctx, peer, CalibrationTag, msg[:]); err != nil {
			return overlap.Fit{}, fmt.Errorf("calibrate overlap: %w", err)
		}
		fit.Alpha = math.Float64frombits(binary.LittleEndian.Uint64(msg[0:]))
		fit.Beta = time.Duration(binary.LittleEndian.Uint64(msg[8:]))
		if !(fit.Alpha > 0) {
			return overlap.Fit{}, fmt.Errorf("calibrate overlap: rank %d could not fit its measurements", peer)
		}
	}
	t.mu.Lock()
	err := t.opts.Overlap.SetCost(fit.Alpha, fit.Beta)
	t.mu.Unlock()
	if err != nil {
		return overlap.Fit{}, fmt.Errorf("calibrate overlap: %w", err)
	}
	return fit, nil
}
