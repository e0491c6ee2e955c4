package overlap

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"
)

// TestPoolProperty: the pool alone never hands out more slots than it has
// and never hands out a slot that is held.
func TestPoolProperty(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		n := rapid.IntRange(0, 6).Draw(t, "slots")
		p := newPool(n)
		held := map[int]bool{}
		ops := rapid.SliceOfN(rapid.IntRange(-1, n), 0, 60).Draw(t, "ops")
		for _, op := range ops {
			if op < 0 { // acquire
				s, ok := p.acquire()
				if len(held) == n {
					if ok {
						t.Fatalf("acquired slot %d from a full pool", s)
					}
					continue
				}
				if !ok || s < 0 || s >= n || held[s] {
					t.Fatalf("acquire = %d, %v with held %v", s, ok, held)
				}
				held[s] = true
			} else { // release slot op (op == n is out of range)
				ok := p.release(op)
				if ok != held[op] {
					t.Fatalf("release(%d) = %v, held %v", op, ok, held[op])
				}
				delete(held, op)
			}
			if p.inUse != len(held) || p.inUse > n || p.highWater > n || p.full() != (len(held) == n) {
				t.Fatalf("inUse %d highWater %d held %d n %d", p.inUse, p.highWater, len(held), n)
			}
		}
	})
}

func genEvent(t *rapid.T, label string, at *time.Duration) Event {
	*at += time.Duration(rapid.IntRange(0, 200).Draw(t, label+"-dt")) * time.Microsecond
	if rapid.IntRange(0, 20).Draw(t, label+"-back") == 0 {
		*at -= 50 * time.Microsecond // the engine must clamp
	}
	sizes := []int64{100, 64 << 10, 1 << 20, 3 << 20}
	return Event{
		Kind:     EventKind(rapid.IntRange(1, int(Revisit)).Draw(t, label+"-kind")),
		At:       *at,
		ID:       TransferID(rapid.IntRange(1, 10).Draw(t, label+"-id")),
		Peer:     rapid.IntRange(-1, 3).Draw(t, label+"-peer"),
		Size:     sizes[rapid.IntRange(0, len(sizes)-1).Draw(t, label+"-size")],
		Expected: rapid.Bool().Draw(t, label+"-exp"),
		InPlace:  rapid.Bool().Draw(t, label+"-inplace"),
	}
}

// genEvents draws one arbitrary event, or now and then the lifecycle of a
// held expected transfer (receive, header, revisit, with arbitrary gaps),
// which arbitrary events alone rarely produce.
func genEvents(t *rapid.T, label string, at *time.Duration) []Event {
	if rapid.IntRange(0, 5).Draw(t, label+"-lifecycle") > 0 {
		return []Event{genEvent(t, label, at)}
	}
	evs := make([]Event, 3)
	for i, k := range []EventKind{RecvPosted, HeaderArrived, Revisit} {
		evs[i] = genEvent(t, label, at)
		evs[i].Kind, evs[i].Expected = k, true
		if i > 0 {
			evs[i].ID, evs[i].Peer, evs[i].Size = evs[0].ID, evs[0].Peer, evs[0].Size
		}
	}
	return evs
}

func genConfig(t *rapid.T) Config {
	c := testConfig()
	c.Enabled = rapid.IntRange(0, 4).Draw(t, "enabled") > 0
	c.PoolSlots = rapid.IntRange(0, 3).Draw(t, "slots")
	c.CancelMinOffloads = rapid.IntRange(0, 3).Draw(t, "minOffloads")
	c.PrefetchMinSamples = rapid.IntRange(0, c.PrefetchWindow).Draw(t, "minSamples")
	return c
}

// TestEngineSlotProperty drives the engine with arbitrary (often invalid)
// event sequences and checks that it never hands out more slots than the
// pool has, never assigns a slot that a live prefetch holds, and keeps its
// counters consistent.
func TestEngineSlotProperty(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		cfg := genConfig(t)
		e, err := New(cfg)
		require.NoError(t, err)
		held := map[int]TransferID{}   // slot -> id
		slotOf := map[TransferID]int{} // id -> slot
		var at time.Duration
		var evs []Event
		for n := rapid.IntRange(1, 150).Draw(t, "n"); len(evs) < n; {
			evs = append(evs, genEvents(t, "ev", &at)...)
		}
		for _, ev := range evs {
			d, err := e.Step(ev)
			if err != nil {
				if d.Action != None {
					t.Fatalf("error with action %v", d)
				}
				continue
			}
			if d.ID != ev.ID {
				t.Fatalf("decision id %d for event id %d", d.ID, ev.ID)
			}
			if (d.Action == Prefetch) != (d.Slot != NoSlot) {
				t.Fatalf("slot/action mismatch: %v", d)
			}
			switch {
			case d.Action == Prefetch && ev.Kind == HeaderArrived:
				if !cfg.Enabled {
					t.Fatalf("prefetch while disabled")
				}
				if d.Slot < 0 || d.Slot >= cfg.PoolSlots {
					t.Fatalf("slot %d out of range [0,%d)", d.Slot, cfg.PoolSlots)
				}
				if other, ok := held[d.Slot]; ok {
					t.Fatalf("slot %d given to %d while held by %d", d.Slot, ev.ID, other)
				}
				held[d.Slot], slotOf[ev.ID] = ev.ID, d.Slot
			case d.Action == Prefetch && ev.Kind == RecvPosted:
				if s, ok := slotOf[ev.ID]; !ok || s != d.Slot {
					t.Fatalf("match of %d names slot %d, model %d (%v)", ev.ID, d.Slot, s, ok)
				}
			case ev.Kind == PrefetchConsumed || ev.Kind == PrefetchDropped:
				s, ok := slotOf[ev.ID]
				if !ok {
					t.Fatalf("%v succeeded for %d which holds no slot", ev.Kind, ev.ID)
				}
				delete(held, s)
				delete(slotOf, ev.ID)
			}
			if !cfg.Enabled && (d.Action == Offload || d.Action == Prefetch) {
				t.Fatalf("disabled engine decided %v", d)
			}
			// Only an expected onload with reason delay<=K, or the answer
			// to a Revisit that keeps it onloaded, asks for a revisit.
			heldAtHeader := ev.Kind == HeaderArrived && ev.Expected && d.Action == Onload && d.Reason == ReasonDelayBelowK
			heldAgain := ev.Kind == Revisit && d.Action == Onload
			if (d.Revisit > 0) != (heldAtHeader || heldAgain) || (d.Revisit > 0 && d.Revisit < cfg.MinRevisit) {
				t.Fatalf("%v gave %v (revisit %v)", ev.Kind, d, d.Revisit)
			}
			if ev.Kind == Revisit && d.Action == Offload && d.Reason != ReasonRevisited {
				t.Fatalf("revisit offloaded with reason %v", d.Reason)
			}
			s := e.Stats()
			if s.PoolInUse != len(held) || s.PoolInUse > cfg.PoolSlots || s.PoolHighWater > cfg.PoolSlots {
				t.Fatalf("pool in use %d high %d, model %d, slots %d", s.PoolInUse, s.PoolHighWater, len(held), cfg.PoolSlots)
			}
			if s.Outstanding < 0 || s.K < 0 || s.Outstanding > s.Tracked {
				t.Fatalf("outstanding %d K %v tracked %d", s.Outstanding, s.K, s.Tracked)
			}
			if s.OnloadPending < 0 || s.OnloadPending > s.Tracked || s.Revisited > s.Offloaded {
				t.Fatalf("pending %d tracked %d revisited %d offloaded %d", s.OnloadPending, s.Tracked, s.Revisited, s.Offloaded)
			}
			if s.OffloadCancelled > s.Cancelled || s.PrefetchDropped > s.Prefetched ||
				s.PrefetchUseful+s.PrefetchUseless > s.Prefetched {
				t.Fatalf("inconsistent counters %+v", s)
			}
			if s.OnloadDisabled+s.OnloadDelayBelowK+s.OnloadThrottled+s.OnloadTooLarge+
				s.OnloadPeerHistory+s.OnloadPoolFull != s.Onloaded {
				t.Fatalf("onload reasons do not add up: %+v", s)
			}
		}
	})
}

// TestEngineDeterminism: the same events give the same decisions, errors
// and counters.
func TestEngineDeterminism(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		cfg := genConfig(t)
		var at time.Duration
		var evs []Event
		for n := rapid.IntRange(1, 150).Draw(t, "n"); len(evs) < n; {
			evs = append(evs, genEvents(t, "ev", &at)...)
		}
		run := func() ([]Decision, []string, Stats) {
			e, err := New(cfg)
			require.NoError(t, err)
			var ds []Decision
			var errs []string
			for _, ev := range evs {
				d, err := e.Step(ev)
				ds = append(ds, d)
				if err != nil {
					errs = append(errs, err.Error())
				} else {
					errs = append(errs, "")
				}
			}
			return ds, errs, e.Stats()
		}
		d1, e1, s1 := run()
		d2, e2, s2 := run()
		require.Equal(t, d1, d2)
		require.Equal(t, e1, e2)
		require.Equal(t, s1, s2)
	})
}
