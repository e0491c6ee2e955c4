package integration

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/transport"
)

func init() { scenarios["ovl-typed"] = ovlTyped }

// TestOverlapTyped: typed (derived-datatype) transfers through the engine.
// Phase 1, late receiver: rank 0 starts a typed send per scheme before rank
// 1 posts anything; with the engine on, rank 1 takes the pack chunks off
// UCX's queue while it computes. Phase 2, late sender: rank 1 posts every
// typed receive first and computes; rank 0 sends late. Each message must
// arrive intact and in order, the gaps of the receive layout untouched,
// and the engine's books must be clean afterwards.
func TestOverlapTyped(t *testing.T) {
	forOverlap(t, false, func(t *testing.T, tls string, c ovlConfig) { launchOvl(t, "ovl-typed", tls, c, -1) })
}

// ovlTypedSchemes: two pack transfers, whose chunks are sent before any
// receive is posted, and the handshake schemes.
var ovlTypedSchemes = []datatype.Scheme{datatype.SchemePack, datatype.SchemeSGL, datatype.SchemeZCopy, datatype.SchemePack, datatype.SchemeAuto}

const ovlTagTyped = 4

func ovlTyped(ctx context.Context, r *rank) error {
	t := r.t
	// 1024 blocks of 1 KiB, stride 2 KiB: 1 MiB packed, eight pack chunks.
	vec, err := datatype.Vector(1024, 128, 256, datatype.Float64)
	if err != nil {
		return err
	}
	span, size := int(vec.Extent()), 1<<20
	ctl := make([]byte, 1)
	send := func(phase int) ([]*transport.Request, error) {
		var reqs []*transport.Request
		for i, s := range ovlTypedSchemes {
			q, err := t.IsendTypedWith(1, ovlTagTyped, pattern(span, uint32(phase*100+i)), vec, 1, transport.TypedOptions{Scheme: s})
			if err != nil {
				return nil, err
			}
			reqs = append(reqs, q)
		}
		return reqs, nil
	}
	check := func(phase, i int, st transport.Status, dst []byte) error {
		if st.Size != size {
			return fmt.Errorf("phase %d message %d: size %d, want %d", phase, i, st.Size, size)
		}
		src := pattern(span, uint32(phase*100+i))
		for j := 0; j < span; j++ {
			want := byte(0xee)
			if j%2048 < 1024 {
				want = src[j]
			}
			if dst[j] != want {
				return fmt.Errorf("phase %d message %d (%v): byte %d = %#x, want %#x", phase, i, ovlTypedSchemes[i], j, dst[j], want)
			}
		}
		return nil
	}
	fresh := func() []byte {
		b := make([]byte, span)
		for j := range b {
			b[j] = 0xee
		}
		return b
	}
	switch r.id() {
	case 0:
		reqs, err := send(1)
		if err != nil {
			return err
		}
		if err := t.Send(ctx, 1, ovlTagCtl, ctl); err != nil {
			return err
		}
		if err := waitAllReqs(ctx, reqs); err != nil {
			return fmt.Errorf("phase 1: %w", err)
		}
		if _, err := t.Recv(ctx, 1, ovlTagCtl, ctl); err != nil {
			return err
		}
		busy(5 * time.Millisecond)
		if reqs, err = send(2); err != nil {
			return err
		}
		if err := waitAllReqs(ctx, reqs); err != nil {
			return fmt.Errorf("phase 2: %w", err)
		}
	case 1:
		if _, err := t.Recv(ctx, 0, ovlTagCtl, ctl); err != nil {
			return err
		}
		chunks := 2 * transport.DefaultNoncontigOptions().PackDepth
		if engineOn() {
			// The two pack transfers each send at least PackDepth chunks
			// before a receive exists: only the engine can take them.
			for t.OverlapTable().Unexpected < chunks {
				if ctx.Err() != nil {
					return fmt.Errorf("%d typed chunks not taken: table %+v", chunks, t.OverlapTable())
				}
				if _, _, err := t.Iprobe(0, ovlTagCtl); err != nil { // enters the transport
					return err
				}
			}
		}
		busy(2 * time.Millisecond)
		for i, s := range ovlTypedSchemes {
			dst := fresh()
			st, err := t.RecvTypedWith(ctx, 0, ovlTagTyped, dst, vec, 1, transport.TypedOptions{Scheme: s})
			if err != nil {
				return fmt.Errorf("phase 1 recv %d (%v): %w", i, s, err)
			}
			if err := check(1, i, st, dst); err != nil {
				return err
			}
		}
		if st, ok := t.OverlapStats(); ok && st.Prefetched+st.Onloaded < uint64(chunks) {
			return fmt.Errorf("the engine decided for %d unexpected messages, want >= %d typed chunks: %+v", st.Prefetched+st.Onloaded, chunks, st)
		}
		bufs := make([][]byte, len(ovlTypedSchemes))
		reqs := make([]*transport.Request, len(ovlTypedSchemes))
		for i, s := range ovlTypedSchemes {
			bufs[i] = fresh()
			q, err := t.IrecvTypedWith(0, ovlTagTyped, bufs[i], vec, 1, transport.TypedOptions{Scheme: s})
			if err != nil {
				return err
			}
			reqs[i] = q
		}
		if err := t.Send(ctx, 0, ovlTagCtl, ctl); err != nil {
			return err
		}
		busy(20 * time.Millisecond)
		for i, q := range reqs {
			st, err := q.Wait(ctx)
			if err != nil {
				return fmt.Errorf("phase 2 recv %d: %w", i, err)
			}
			if err := check(2, i, st, bufs[i]); err != nil {
				return err
			}
		}
		r.logf("typed: %d late-receiver and %d late-sender messages intact, in order; counters %+v", len(ovlTypedSchemes), len(ovlTypedSchemes), t.NoncontigStats())
		return ovlEngineBooks(r)
	}
	return nil
}

// waitAllReqs waits for every request and returns the first error.
func waitAllReqs(ctx context.Context, reqs []*transport.Request) error {
	for i, q := range reqs {
		if _, err := q.Wait(ctx); err != nil {
			return fmt.Errorf("request %d: %w", i, err)
		}
	}
	return nil
}
