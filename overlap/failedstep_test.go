package overlap

import (
	"math/rand"
	"reflect"
	"testing"
	"time"
)

// cloneEngine is a deep copy of e. It copies every field of Engine that
// refers to memory (the shadows, the transfer and peer maps, the pool's
// slots): a field added there must be added here, or the copy would share
// it and TestFailedStepChangesOnlyClock could miss a change to it.
func cloneEngine(e *Engine) *Engine {
	c := *e
	c.shadows = append([]shadowDelta(nil), e.shadows...)
	c.transfers = make(map[TransferID]*transfer, len(e.transfers))
	for id, t := range e.transfers {
		tt := *t
		c.transfers[id] = &tt
	}
	c.peers = make(map[int]*peerState, len(e.peers))
	for p, ps := range e.peers {
		pp := *ps
		if ps.hist != nil {
			pp.hist = append([]bool(nil), ps.hist...)
		}
		c.peers[p] = &pp
	}
	c.pool.used = append([]bool(nil), e.pool.used...)
	return &c
}

// TestFailedStepChangesOnlyClock feeds engines random events, most of
// them invalid for the lifecycle (unknown ids, duplicates, events out of
// order, unknown kinds, times going backwards), and checks the contract
// of docs/overlap.md section 4: a Step that fails returns None and changes
// nothing but the clock.
func TestFailedStepChangesOnlyClock(t *testing.T) {
	sizes := []int64{0, 100, 8 << 10, 64 << 10, 1 << 20, 3 << 20, 1 << 41}
	failed := 0
	for seed := int64(1); seed <= 400; seed++ {
		rng := rand.New(rand.NewSource(seed))
		cfg := testConfig()
		cfg.Enabled = rng.Intn(5) > 0
		cfg.PoolSlots = rng.Intn(4)
		cfg.CancelMinOffloads = rng.Intn(4)
		e, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		var at time.Duration
		for i := 0; i < 200; i++ {
			at += time.Duration(rng.Intn(300)) * time.Microsecond
			if rng.Intn(15) == 0 {
				at -= 100 * time.Microsecond
			}
			ev := Event{
				Kind:     EventKind(rng.Intn(int(OnloadDropped) + 2)), // 0 and one past the last are unknown
				At:       at,
				ID:       TransferID(rng.Intn(8) + 1),
				Peer:     rng.Intn(4) - 1,
				Size:     sizes[rng.Intn(len(sizes))],
				Expected: rng.Intn(2) == 0,
				InPlace:  rng.Intn(3) == 0,
			}
			want := cloneEngine(e)
			want.advance(ev.At)
			d, err := e.Step(ev)
			if err == nil {
				continue
			}
			failed++
			if d.Action != None || d.Slot != NoSlot {
				t.Fatalf("seed %d step %d: failed step %+v returned %+v", seed, i, ev, d)
			}
			if !reflect.DeepEqual(cloneEngine(e), want) {
				t.Fatalf("seed %d step %d: failed step %+v (%v) changed the engine:\n got %+v\nwant %+v", seed, i, ev, err, e.Stats(), want.Stats())
			}
		}
	}
	if failed == 0 {
		t.Fatal("no step failed: the events exercise nothing")
	}
}
