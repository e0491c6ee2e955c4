package overlap

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

const (
	us = time.Microsecond
	ms = time.Millisecond
	MB = 1 << 20
)

// testConfig: alpha 0.01 ns/B and beta 1us, so one 1 MiB rendezvous costs
// about 11.5us and K for n outstanding 1 MiB transfers is n*11.5us.
func testConfig() Config {
	c := DefaultConfig()
	c.Alpha = 0.01
	c.Beta = 1 * us
	c.OffloadRatio = 1 // the paper's rule: delta > K
	c.Period = 1 * ms
	c.CancelMinOffloads = 2
	c.CancelRateThreshold = 0.5
	c.PoolSlots = 2
	c.SlotSize = 4 * MB
	c.MaxPrefetchSize = 2 * MB
	c.PrefetchWindow = 4
	c.PrefetchMinSamples = 2
	c.PrefetchUsefulRatio = 0.5
	c.MinRevisit = 1 * us
	return c
}

// Event shorthands.
func post(at time.Duration, id TransferID, peer int, size int64) Event {
	return Event{Kind: RecvPosted, At: at, ID: id, Peer: peer, Size: size}
}
func exp(at time.Duration, id TransferID, peer int, size int64) Event {
	return Event{Kind: HeaderArrived, At: at, ID: id, Peer: peer, Size: size, Expected: true}
}
func unexp(at time.Duration, id TransferID, peer int, size int64) Event {
	return Event{Kind: HeaderArrived, At: at, ID: id, Peer: peer, Size: size}
}
func inPlace(at time.Duration, id TransferID, peer int, size int64) Event {
	return Event{Kind: HeaderArrived, At: at, ID: id, Peer: peer, Size: size, InPlace: true}
}
func start(at time.Duration, id TransferID) Event {
	return Event{Kind: TransferStarted, At: at, ID: id}
}
func done(at time.Duration, id TransferID) Event {
	return Event{Kind: TransferCompleted, At: at, ID: id}
}
func cancel(at time.Duration, id TransferID) Event {
	return Event{Kind: RecvCancelled, At: at, ID: id}
}
func progress(at time.Duration) Event { return Event{Kind: Progress, At: at} }
func tick(at time.Duration) Event     { return Event{Kind: Tick, At: at} }
func consumed(at time.Duration, id TransferID) Event {
	return Event{Kind: PrefetchConsumed, At: at, ID: id}
}
func dropped(at time.Duration, id TransferID) Event {
	return Event{Kind: PrefetchDropped, At: at, ID: id}
}
func onloadDropped(at time.Duration, id TransferID) Event {
	return Event{Kind: OnloadDropped, At: at, ID: id}
}
func revisit(at time.Duration, id TransferID) Event {
	return Event{Kind: Revisit, At: at, ID: id}
}

// Decision shorthands (the ID is filled in from the event).
var (
	wait = Decision{Action: None, Slot: NoSlot}
)

func dec(a Action, r Reason) Decision { return Decision{Action: a, Slot: NoSlot, Reason: r} }

// hold is an Onload (delay<=K) of an expected transfer, revisited after d.
func hold(d time.Duration) Decision {
	return Decision{Action: Onload, Slot: NoSlot, Reason: ReasonDelayBelowK, Revisit: d}
}
func pf(slot int, r Reason) Decision { return Decision{Action: Prefetch, Slot: slot, Reason: r} }

type step struct {
	ev   Event
	want Decision
}

// offloadHistory makes peer 1's delta 100us: a receive posted at t and its
// header arriving 100us later, while the receiver is away.
func offloadHistory(t0 time.Duration, id TransferID) []step {
	return []step{
		{post(t0, id, 1, MB), dec(Onload, ReasonDelayBelowK)},
		{exp(t0+100*us, id, 1, MB), dec(Offload, ReasonDelayAboveK)},
		{start(t0+100*us, id), wait},
		{done(t0+112*us, id), wait},
	}
}

func cat(parts ...[]step) []step {
	var out []step
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

func TestEngineTable(t *testing.T) {
	cases := []struct {
		name  string
		cfg   func(*Config)
		steps []step
		stats func(t *testing.T, s Stats)
	}{
		{
			name: "disabled engine always onloads",
			cfg:  func(c *Config) { c.Enabled = false },
			steps: []step{
				{post(0, 1, 1, MB), dec(Onload, ReasonDisabled)},
				{exp(500*us, 1, 1, MB), dec(Onload, ReasonDisabled)},
				{unexp(501*us, 2, 1, MB), dec(Onload, ReasonDisabled)},
				{post(900*us, 2, 1, MB), dec(Onload, ReasonMatched)},
				{start(900*us, 1), wait},
				{done(920*us, 1), wait},
				{start(900*us, 2), wait},
				{done(920*us, 2), wait},
				{post(1000*us, 3, 1, MB), dec(Onload, ReasonDisabled)},
			},
			stats: func(t *testing.T, s Stats) {
				require.EqualValues(t, 2, s.Onloaded)
				require.EqualValues(t, 2, s.OnloadDisabled)
				require.Zero(t, s.Offloaded+s.Prefetched+s.ShadowUseful+s.ShadowUseless)
				require.Zero(t, s.PoolHighWater)
			},
		},
		{
			name: "receiver polling often: delta below K, onload",
			steps: []step{
				{post(0, 1, 1, MB), dec(Onload, ReasonDelayBelowK)},
				{progress(5 * us), wait},
				// K = 11485.76ns, away 1us: revisit after 10485ns.
				{exp(6*us, 1, 1, MB), hold(10485)},
				{start(7*us, 1), wait},
				{done(19*us, 1), wait},
			},
			stats: func(t *testing.T, s Stats) {
				require.EqualValues(t, 1, s.Onloaded)
				require.EqualValues(t, 1, s.OnloadDelayBelowK)
				require.Zero(t, s.Outstanding)
				require.Zero(t, s.Tracked)
			},
		},
		{
			name:  "receiver computing: delta above K, offload at header",
			steps: cat(offloadHistory(0, 1)),
			stats: func(t *testing.T, s Stats) {
				require.EqualValues(t, 1, s.Offloaded)
			},
		},
		{
			name: "K grows with outstanding rendezvous and blocks offload",
			cfg:  func(c *Config) { c.PoolSlots = 0 },
			steps: []step{
				{post(0, 100, 1, MB), dec(Onload, ReasonDelayBelowK)},
				{unexp(1*us, 1, 2, MB), dec(Onload, ReasonPoolFull)},
				{unexp(1*us, 2, 2, MB), dec(Onload, ReasonPoolFull)},
				{unexp(1*us, 3, 2, MB), dec(Onload, ReasonPoolFull)},
				{unexp(1*us, 4, 2, MB), dec(Onload, ReasonPoolFull)},
				{unexp(1*us, 5, 2, MB), dec(Onload, ReasonPoolFull)},
				{unexp(1*us, 6, 2, MB), dec(Onload, ReasonPoolFull)},
				{unexp(1*us, 7, 2, MB), dec(Onload, ReasonPoolFull)},
				{unexp(1*us, 8, 2, MB), dec(Onload, ReasonPoolFull)},
				// 9 outstanding 1 MiB: K ~ 103.4us > 100us away.
				// Revisit when the absence reaches K: 103371ns - 100us.
				{exp(100*us, 100, 1, MB), hold(3371)},
				// A second receive, away 150us > K (10 outstanding ~ 114.9us).
				{post(100*us, 101, 1, MB), dec(Onload, ReasonDelayBelowK)},
				{exp(250*us, 101, 1, MB), dec(Offload, ReasonDelayAboveK)},
			},
			stats: func(t *testing.T, s Stats) {
				require.Equal(t, 10, s.Outstanding)
				require.InDelta(t, 10*(0.01*MB+1000), s.K, 1)
			},
		},
		{
			name: "delta history arms the receive at post time",
			steps: cat(offloadHistory(0, 1), []step{
				{post(200*us, 2, 1, MB), dec(Offload, ReasonDelayAboveK)},
				{exp(210*us, 2, 1, MB), dec(Offload, ReasonArmed)},
				{start(210*us, 2), wait},
				{done(222*us, 2), wait},
				// Any-source receive falls back to the rank-wide delta.
				{post(300*us, 3, AnyPeer, MB), dec(Offload, ReasonDelayAboveK)},
				// An armed receive may complete without a reported header.
				{done(305*us, 3), wait},
				// Small buffer: eager, never armed.
				{post(300*us, 4, 1, 100), dec(Onload, ReasonEager)},
				{exp(301*us, 4, 1, 100), dec(Onload, ReasonEager)},
			}),
			stats: func(t *testing.T, s Stats) {
				require.EqualValues(t, 3, s.Offloaded)
				require.EqualValues(t, 1, s.Eager)
				require.Zero(t, s.Tracked)
			},
		},
		{
			name: "cancellation throttle stops offloading until the next period",
			steps: cat(offloadHistory(0, 1), []step{
				{post(200*us, 2, 1, MB), dec(Offload, ReasonDelayAboveK)},
				{post(200*us, 3, 1, MB), dec(Offload, ReasonDelayAboveK)},
				{cancel(210*us, 2), wait}, // 1/3 cancelled: fine
				{post(220*us, 4, 1, MB), dec(Offload, ReasonDelayAboveK)},
				{cancel(230*us, 3), wait}, // 2/4: not above 0.5
				{cancel(240*us, 4), wait}, // 3/4: throttled
				{post(250*us, 5, 1, MB), dec(Onload, ReasonThrottled)},
				{exp(700*us, 5, 1, MB), dec(Onload, ReasonThrottled)},
				// Prefetch is not throttled.
				{unexp(710*us, 6, 2, MB), pf(0, ReasonPrefetch)},
				// Next period: offloading resumes.
				{tick(1 * ms), wait},
				{post(1001*us, 7, 1, MB), dec(Offload, ReasonDelayAboveK)},
				// One cancel out of one offload: below CancelMinOffloads,
				// the rate is not trusted yet.
				{cancel(1002*us, 7), wait},
				{post(1003*us, 8, 1, MB), dec(Offload, ReasonDelayAboveK)},
			}),
			stats: func(t *testing.T, s Stats) {
				require.EqualValues(t, 1, s.ThrottledPeriods)
				require.EqualValues(t, 4, s.OffloadCancelled)
				require.EqualValues(t, 4, s.Cancelled)
				require.EqualValues(t, 1, s.Periods)
				require.False(t, s.Throttled)
				require.EqualValues(t, 1, s.OnloadThrottled)
			},
		},
		{
			name: "throttle holds for the rest of the period, then clears over several periods",
			steps: cat(offloadHistory(0, 1), []step{
				{post(200*us, 2, 1, MB), dec(Offload, ReasonDelayAboveK)},
				{cancel(201*us, 2), wait}, // 1/2: not above 0.5
				{post(202*us, 3, 1, MB), dec(Offload, ReasonDelayAboveK)},
				{cancel(203*us, 3), wait}, // 2/3: throttled
				{post(999*us, 4, 1, MB), dec(Onload, ReasonThrottled)},
				{post(3500*us, 5, 1, MB), dec(Offload, ReasonDelayAboveK)},
			}),
			stats: func(t *testing.T, s Stats) {
				require.EqualValues(t, 3, s.Periods)
				require.EqualValues(t, 1, s.ThrottledPeriods)
			},
		},
		{
			name: "prefetch unexpected, useful when the receive comes after completion",
			steps: []step{
				{unexp(0, 1, 1, MB), pf(0, ReasonPrefetch)},
				{start(0, 1), wait},
				{done(12*us, 1), wait},
				{post(500*us, 1, 1, MB), pf(0, ReasonPrefetched)},
				{consumed(510*us, 1), wait},
				{unexp(600*us, 2, 1, MB), pf(0, ReasonPrefetch)},
			},
			stats: func(t *testing.T, s Stats) {
				require.EqualValues(t, 2, s.Prefetched)
				require.EqualValues(t, 1, s.PrefetchUseful)
				require.Equal(t, 1, s.PoolInUse)
				require.Equal(t, 1, s.PoolHighWater)
			},
		},
		{
			name: "pool full: onload, and a freed slot is reused",
			steps: []step{
				{unexp(0, 1, 1, MB), pf(0, ReasonPrefetch)},
				{unexp(1*us, 2, 2, MB), pf(1, ReasonPrefetch)},
				{unexp(2*us, 3, 3, MB), dec(Onload, ReasonPoolFull)},
				{done(20*us, 2), wait},
				{post(30*us, 2, 2, MB), pf(1, ReasonPrefetched)},
				{consumed(31*us, 2), wait},
				{unexp(40*us, 4, 3, MB), pf(1, ReasonPrefetch)},
				{dropped(50*us, 1), wait},
				{unexp(60*us, 5, 3, MB), pf(0, ReasonPrefetch)},
				{unexp(60*us, 6, 3, MB), dec(Onload, ReasonPoolFull)},
			},
			stats: func(t *testing.T, s Stats) {
				require.Equal(t, 2, s.PoolHighWater)
				require.Equal(t, 2, s.PoolInUse)
				require.EqualValues(t, 2, s.OnloadPoolFull)
				require.EqualValues(t, 1, s.PrefetchDropped)
				require.EqualValues(t, 1, s.PrefetchUseless)
				require.EqualValues(t, 1, s.PrefetchUseful)
			},
		},
		{
			name: "an onloaded unexpected message dropped before its match leaves K",
			steps: []step{
				{unexp(0, 1, 1, 3*MB), dec(Onload, ReasonTooLarge)},
				{unexp(0, 2, 1, 2*MB), pf(0, ReasonPrefetch)},
				{unexp(0, 3, 1, 100), dec(Onload, ReasonEager)},
				{onloadDropped(5*us, 1), wait},
				{onloadDropped(5*us, 3), wait},
			},
			stats: func(t *testing.T, s Stats) {
				require.EqualValues(t, 1, s.OnloadDropped)
				require.Equal(t, 1, s.Outstanding) // the prefetch, id 2
				require.Equal(t, 1, s.Tracked)
				require.EqualValues(t, 0, s.PrefetchDropped)
			},
		},
		{
			name: "message larger than MaxPrefetchSize is onloaded",
			steps: []step{
				{unexp(0, 1, 1, 3*MB), dec(Onload, ReasonTooLarge)},
				{unexp(0, 2, 1, 2*MB), pf(0, ReasonPrefetch)},
				{unexp(0, 3, 1, 100), dec(Onload, ReasonEager)},
				{post(10*us, 3, 1, 100), dec(Onload, ReasonEager)},
			},
			stats: func(t *testing.T, s Stats) {
				require.EqualValues(t, 1, s.OnloadTooLarge)
				require.EqualValues(t, 1, s.Eager)
				require.Equal(t, 2, s.Outstanding)
				require.Equal(t, 2, s.Tracked)
			},
		},
		{
			name: "per-peer history turns prefetch off, shadow outcomes turn it back on",
			steps: []step{
				// Peer 1: two useless prefetches (receive posted before
				// the prefetch completed).
				{unexp(0, 1, 1, MB), pf(0, ReasonPrefetch)},
				{post(1*us, 1, 1, MB), pf(0, ReasonPrefetched)},
				{done(12*us, 1), wait},
				{consumed(13*us, 1), wait},
				{unexp(20*us, 2, 1, MB), pf(0, ReasonPrefetch)},
				{post(21*us, 2, 1, MB), pf(0, ReasonPrefetched)},
				{done(32*us, 2), wait},
				{consumed(33*us, 2), wait},
				// Peer 1 is now off; peer 2 is unaffected.
				{unexp(40*us, 3, 1, MB), dec(Onload, ReasonPeerHistory)},
				{unexp(40*us, 4, 2, MB), pf(0, ReasonPrefetch)},
				// The receiver becomes late: posting long after the
				// header, a prefetch would have paid (shadow useful).
				{post(200*us, 3, 1, MB), dec(Onload, ReasonMatched)},
				{start(200*us, 3), wait},
				{done(212*us, 3), wait},
				{unexp(300*us, 5, 1, MB), dec(Onload, ReasonPeerHistory)},
				{post(500*us, 5, 1, MB), dec(Onload, ReasonMatched)},
				{start(500*us, 5), wait},
				{done(512*us, 5), wait},
				// 2 useful of 4: back on.
				{unexp(600*us, 6, 1, MB), pf(1, ReasonPrefetch)},
			},
			stats: func(t *testing.T, s Stats) {
				require.EqualValues(t, 2, s.PrefetchUseless)
				require.EqualValues(t, 2, s.ShadowUseful)
				require.EqualValues(t, 2, s.OnloadPeerHistory)
			},
		},
		{
			name: "in-place prefetches ignore and do not feed the peer history",
			steps: []step{
				// Two useless in-place prefetches from peer 1 ...
				{inPlace(0, 1, 1, MB), pf(0, ReasonPrefetch)},
				{post(1*us, 1, 1, MB), pf(0, ReasonPrefetched)},
				{done(12*us, 1), wait},
				{consumed(13*us, 1), wait},
				{inPlace(20*us, 2, 1, MB), pf(0, ReasonPrefetch)},
				{post(21*us, 2, 1, MB), pf(0, ReasonPrefetched)},
				{done(32*us, 2), wait},
				{consumed(33*us, 2), wait},
				// ... leave its slot-copy prefetches on.
				{unexp(40*us, 3, 1, MB), pf(0, ReasonPrefetch)},
				{post(41*us, 3, 1, MB), pf(0, ReasonPrefetched)},
				{done(52*us, 3), wait},
				{consumed(53*us, 3), wait},
				{unexp(60*us, 4, 1, MB), pf(0, ReasonPrefetch)},
				{post(61*us, 4, 1, MB), pf(0, ReasonPrefetched)},
				{done(72*us, 4), wait},
				{consumed(73*us, 4), wait},
				// Now the history is bad: slot copies are off, in-place
				// prefetches still on; the pool and size limit still hold.
				{unexp(80*us, 5, 1, MB), dec(Onload, ReasonPeerHistory)},
				{inPlace(81*us, 6, 1, MB), pf(0, ReasonPrefetch)},
				{inPlace(82*us, 7, 1, MB), pf(1, ReasonPrefetch)},
				{inPlace(83*us, 8, 1, MB), dec(Onload, ReasonPoolFull)},
				{inPlace(84*us, 9, 1, 3*MB), dec(Onload, ReasonTooLarge)},
			},
			stats: func(t *testing.T, s Stats) {
				require.EqualValues(t, 4, s.PrefetchUseless)
				require.EqualValues(t, 1, s.OnloadPeerHistory)
			},
		},
		{
			name: "shadow outcome useless when the receive follows the header closely",
			steps: []step{
				{unexp(0, 1, 1, 3*MB), dec(Onload, ReasonTooLarge)},
				{post(1*us, 1, 1, 3*MB), dec(Onload, ReasonMatched)}, // too large: no shadow
				{unexp(10*us, 2, 1, MB), pf(0, ReasonPrefetch)},
				{unexp(10*us, 3, 1, MB), pf(1, ReasonPrefetch)},
				{unexp(10*us, 4, 1, MB), dec(Onload, ReasonPoolFull)},
				{post(11*us, 4, 1, MB), dec(Onload, ReasonMatched)},
			},
			stats: func(t *testing.T, s Stats) {
				require.EqualValues(t, 1, s.ShadowUseless)
				require.Zero(t, s.ShadowUseful)
			},
		},
		{
			name: "OffloadRatio scales K: away 8us offloads a 11.5us transfer at 0.5, not at 1",
			cfg:  func(c *Config) { c.OffloadRatio = 0.5 },
			steps: []step{
				{post(0, 1, 1, MB), dec(Onload, ReasonDelayBelowK)},
				{exp(8*us, 1, 1, MB), dec(Offload, ReasonDelayAboveK)},
				{post(20*us, 2, 1, MB), dec(Onload, ReasonDelayBelowK)},
				{exp(24*us, 2, 1, MB), hold(7485)}, // 0.5 x K (two outstanding) - 4us
			},
		},
		{
			name: "offloaded transfers sample delta at the receiver's next activity, so decisions do not alternate",
			// With weight 1 one sample decides: sampling the start of an
			// offloaded transfer (1us after its post) would onload the next.
			cfg: func(c *Config) { c.DeltaWeight = 1 },
			steps: cat(offloadHistory(0, 1), []step{
				// The receiver returns at 300us: the shadow delta is 300us.
				{post(300*us, 2, 1, MB), dec(Offload, ReasonDelayAboveK)},
				{exp(301*us, 2, 1, MB), dec(Offload, ReasonArmed)},
				{start(301*us, 2), wait},
				{done(313*us, 2), wait},
				{progress(600 * us), wait},
				{post(600*us, 3, 1, MB), dec(Offload, ReasonDelayAboveK)},
			}),
			stats: func(t *testing.T, s Stats) {
				require.EqualValues(t, 2, s.ShadowDeltas)
				require.EqualValues(t, 3, s.Offloaded)
			},
		},
		{
			name: "the receiver polling often again brings the delta down and onloads",
			cfg:  func(c *Config) { c.DeltaWeight = 1 },
			steps: cat(offloadHistory(0, 1), []step{
				{progress(101 * us), wait}, // shadow delta 101us
				{post(200*us, 2, 1, MB), dec(Offload, ReasonDelayAboveK)},
				{exp(202*us, 2, 1, MB), dec(Offload, ReasonArmed)},
				{start(202*us, 2), wait},
				{progress(203 * us), wait}, // shadow delta 3us
				{done(214*us, 2), wait},
				{post(300*us, 3, 1, MB), dec(Onload, ReasonDelayBelowK)},
			}),
		},
		{
			name: "a held transfer whose receiver stays away is offloaded at its revisit, and teaches offload",
			cfg:  func(c *Config) { c.DeltaWeight = 1 },
			steps: []step{
				{post(0, 1, 1, MB), dec(Onload, ReasonDelayBelowK)},
				// K = 11485ns, away 5us: revisit when the absence reaches K.
				{exp(5*us, 1, 1, MB), hold(6485)},
				{revisit(12*us, 1), dec(Offload, ReasonRevisited)},
				{start(12*us, 1), wait},
				{done(24*us, 1), wait},
				// The receiver comes back at 100us: that is the delta an
				// onload would have had, so the next receive is armed.
				{progress(100 * us), wait},
				{post(200*us, 2, 1, MB), dec(Offload, ReasonDelayAboveK)},
			},
			stats: func(t *testing.T, s Stats) {
				require.EqualValues(t, 2, s.Offloaded)
				require.EqualValues(t, 1, s.Revisited)
				require.Zero(t, s.Onloaded)
				require.Zero(t, s.OnloadDelayBelowK)
				require.Zero(t, s.OnloadPending)
				require.EqualValues(t, 1, s.ShadowDeltas)
			},
		},
		{
			name: "a receiver back since the header keeps the transfer onloaded until it leaves for long enough",
			steps: []step{
				{post(0, 1, 1, MB), dec(Onload, ReasonDelayBelowK)},
				{exp(5*us, 1, 1, MB), hold(6485)},
				{progress(8 * us), wait},
				// Back at 8us: asked again when that absence reaches K.
				{revisit(12*us, 1), hold(7485)},
				{revisit(20*us, 1), dec(Offload, ReasonRevisited)},
			},
			stats: func(t *testing.T, s Stats) {
				require.EqualValues(t, 1, s.Revisited)
				require.EqualValues(t, 1, s.Offloaded)
				require.Zero(t, s.OnloadPending)
			},
		},
		{
			name: "held transfers the receiver starts or cancels count as onloaded then",
			steps: []step{
				{post(0, 1, 1, MB), dec(Onload, ReasonDelayBelowK)},
				{post(0, 2, 1, MB), dec(Onload, ReasonDelayBelowK)},
				{post(0, 3, 1, MB), dec(Onload, ReasonDelayBelowK)},
				{exp(1*us, 1, 1, MB), hold(10485)},
				{exp(1*us, 2, 1, MB), hold(21971)},
				{exp(1*us, 3, 1, MB), hold(33457)},
				{start(3*us, 1), wait},
				{cancel(3*us, 2), wait},
				{done(4*us, 3), wait}, // completed without a reported start
			},
			stats: func(t *testing.T, s Stats) {
				require.EqualValues(t, 3, s.Onloaded)
				require.EqualValues(t, 3, s.OnloadDelayBelowK)
				require.EqualValues(t, 1, s.Cancelled)
				require.Zero(t, s.OnloadPending)
				require.Zero(t, s.Offloaded+s.Revisited)
				require.Equal(t, 1, s.Tracked) // id 1, started
			},
		},
		{
			name: "a revisit while offloads are throttled waits for the next period",
			steps: []step{
				{post(0, 10, 1, MB), dec(Onload, ReasonDelayBelowK)},
				{exp(1*us, 10, 1, MB), hold(10485)},
				// Two offloads of peer 2, both cancelled: throttled.
				{post(2*us, 1, 2, MB), dec(Onload, ReasonDelayBelowK)},
				{exp(100*us, 1, 2, MB), dec(Offload, ReasonDelayAboveK)},
				{cancel(101*us, 1), wait},
				{post(102*us, 2, 2, MB), dec(Onload, ReasonDelayBelowK)},
				{exp(200*us, 2, 2, MB), dec(Offload, ReasonDelayAboveK)},
				{cancel(201*us, 2), wait},
				// Active since the header (posts at 2 and 102us), away 198us
				// already: the floor.
				{revisit(300*us, 10), hold(1 * us)},
				{revisit(400*us, 10), Decision{Action: Onload, Slot: NoSlot, Reason: ReasonThrottled, Revisit: 600 * us}},
				{revisit(1000*us, 10), dec(Offload, ReasonRevisited)},
			},
			stats: func(t *testing.T, s Stats) {
				require.EqualValues(t, 1, s.ThrottledPeriods)
				require.EqualValues(t, 3, s.Offloaded)
				require.EqualValues(t, 1, s.Revisited)
				require.Zero(t, s.Onloaded)
			},
		},
		{
			name: "time never goes backwards",
			steps: []step{
				{progress(100 * us), wait},
				{post(50*us, 1, 1, MB), dec(Onload, ReasonDelayBelowK)},
				{exp(60*us, 1, 1, MB), hold(11485)},
			},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig()
			if tc.cfg != nil {
				tc.cfg(&cfg)
			}
			e, err := New(cfg)
			require.NoError(t, err)
			for i, st := range tc.steps {
				got, err := e.Step(st.ev)
				require.NoError(t, err, "step %d %v", i, st.ev.Kind)
				want := st.want
				want.ID = st.ev.ID
				require.Equal(t, want, got, "step %d: %v id=%d", i, st.ev.Kind, st.ev.ID)
			}
			if tc.stats != nil {
				tc.stats(t, e.Stats())
			}
		})
	}
}

func TestEngineErrors(t *testing.T) {
	cases := []struct {
		name  string
		setup []Event
		bad   Event
		want  error
	}{
		{"unknown event kind", nil, Event{Kind: 99}, ErrUnknownEvent},
		{"complete unknown id", nil, done(0, 7), ErrUnknownTransfer},
		{"start unknown id", nil, start(0, 7), ErrUnknownTransfer},
		{"cancel unknown id", nil, cancel(0, 7), ErrUnknownTransfer},
		{"expected header without receive", nil, exp(0, 7, 1, MB), ErrUnknownTransfer},
		{"duplicate post", []Event{post(0, 1, 1, MB)}, post(0, 1, 1, MB), ErrDuplicate},
		{"duplicate expected header", []Event{post(0, 1, 1, MB), exp(0, 1, 1, MB)}, exp(0, 1, 1, MB), ErrDuplicate},
		{"duplicate unexpected header", []Event{unexp(0, 1, 1, MB)}, unexp(0, 1, 1, MB), ErrDuplicate},
		{"start before header", []Event{post(0, 1, 1, MB)}, start(0, 1), ErrOrder},
		{"complete before header", []Event{post(0, 1, 1, MB)}, done(0, 1), ErrOrder},
		{"consume before complete", []Event{unexp(0, 1, 1, MB), post(1, 1, 1, MB)}, consumed(2, 1), ErrOrder},
		{"consume before receive", []Event{unexp(0, 1, 1, MB), done(1, 1)}, consumed(2, 1), ErrOrder},
		{"consume a non-prefetch", []Event{unexp(0, 1, 1, 3*MB)}, consumed(2, 1), ErrOrder},
		{"drop a non-prefetch", []Event{unexp(0, 1, 1, 3*MB)}, dropped(2, 1), ErrOrder},
		{"onload-drop a prefetch", []Event{unexp(0, 1, 1, MB)}, onloadDropped(2, 1), ErrOrder},
		{"onload-drop a matched message", []Event{unexp(0, 1, 1, 3*MB), post(1, 1, 1, 3*MB)}, onloadDropped(2, 1), ErrOrder},
		{"onload-drop a receive", []Event{post(0, 1, 1, MB)}, onloadDropped(2, 1), ErrOrder},
		{"onload-drop unknown id", nil, onloadDropped(2, 1), ErrUnknownTransfer},
		{"cancel a receive matched to an unexpected message", []Event{unexp(0, 1, 1, MB), post(1, 1, 1, MB)}, cancel(2, 1), ErrOrder},
		{"cancel an unexpected header", []Event{unexp(0, 1, 1, MB)}, cancel(2, 1), ErrOrder},
		{"revisit unknown id", nil, revisit(0, 7), ErrUnknownTransfer},
		{"revisit a receive without header", []Event{post(0, 1, 1, MB)}, revisit(50*us, 1), ErrOrder},
		{"revisit an offloaded transfer", []Event{post(0, 1, 1, MB), exp(100*us, 1, 1, MB)}, revisit(200*us, 1), ErrOrder},
		{"revisit a started transfer", []Event{post(0, 1, 1, MB), exp(1*us, 1, 1, MB), start(2*us, 1)}, revisit(50*us, 1), ErrOrder},
		{"revisit twice after the offload", []Event{post(0, 1, 1, MB), exp(1*us, 1, 1, MB), revisit(50*us, 1)}, revisit(60*us, 1), ErrOrder},
		{"revisit an unexpected onload", []Event{unexp(0, 1, 1, 3*MB)}, revisit(50*us, 1), ErrOrder},
		{"revisit an eager message", []Event{post(0, 1, 1, MB), exp(1*us, 1, 1, 100)}, revisit(50*us, 1), ErrUnknownTransfer},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e, err := New(testConfig())
			require.NoError(t, err)
			for _, ev := range tc.setup {
				_, err := e.Step(ev)
				require.NoError(t, err)
			}
			before := e.Stats()
			d, err := e.Step(tc.bad)
			require.ErrorIs(t, err, tc.want)
			require.Equal(t, None, d.Action)
			require.Equal(t, before, e.Stats(), "a failed step must not change state")
		})
	}
}

func TestConfigValidate(t *testing.T) {
	require.NoError(t, DefaultConfig().Validate())
	bad := []func(*Config){
		func(c *Config) { c.Alpha = -1 },
		func(c *Config) { c.Beta = -1 },
		func(c *Config) { c.RendezvousThreshold = -1 },
		func(c *Config) { c.DeltaWeight = 0 },
		func(c *Config) { c.DeltaWeight = 1.5 },
		func(c *Config) { c.Period = 0 },
		func(c *Config) { c.CancelRateThreshold = 2 },
		func(c *Config) { c.CancelMinOffloads = -1 },
		func(c *Config) { c.PoolSlots = -1 },
		func(c *Config) { c.SlotSize = 0 },
		func(c *Config) { c.MaxPrefetchSize = c.SlotSize + 1 },
		func(c *Config) { c.PrefetchWindow = 0 },
		func(c *Config) { c.PrefetchMinSamples = c.PrefetchWindow + 1 },
		func(c *Config) { c.PrefetchUsefulRatio = -0.1 },
		func(c *Config) { c.MinRevisit = 0 },
	}
	for i, f := range bad {
		c := DefaultConfig()
		f(&c)
		err := c.Validate()
		require.True(t, errors.Is(err, ErrConfig), "case %d: %v", i, err)
		_, err = New(c)
		require.ErrorIs(t, err, ErrConfig)
	}
	// No pool: slot size is irrelevant.
	c := DefaultConfig()
	c.PoolSlots, c.SlotSize, c.MaxPrefetchSize = 0, 0, 0
	require.NoError(t, c.Validate())
}

func TestStringers(t *testing.T) {
	require.Equal(t, "RecvPosted", RecvPosted.String())
	require.Equal(t, "EventKind(99)", EventKind(99).String())
	require.Equal(t, "Offload", Offload.String())
	require.Equal(t, "Action(9)", Action(9).String())
	require.Equal(t, "delay>K", ReasonDelayAboveK.String())
	require.Equal(t, "Prefetch(id=3 slot=1 prefetch)", Decision{Action: Prefetch, ID: 3, Slot: 1, Reason: ReasonPrefetch}.String())
	require.Equal(t, "Onload(id=3 pool-full)", Decision{Action: Onload, ID: 3, Slot: NoSlot, Reason: ReasonPoolFull}.String())
	require.Equal(t, "Onload(id=3 delay<=K revisit=20µs)", Decision{Action: Onload, ID: 3, Slot: NoSlot, Reason: ReasonDelayBelowK, Revisit: 20 * us}.String())
	require.Equal(t, "Revisit", Revisit.String())
	require.Equal(t, "revisited", ReasonRevisited.String())
}

func TestSetCost(t *testing.T) {
	e, err := New(testConfig())
	require.NoError(t, err)
	require.NoError(t, e.SetCost(0.2, 5*us))
	require.Equal(t, 0.2, e.Config().Alpha)
	require.Equal(t, 5*us, e.Config().Beta)
	require.ErrorIs(t, e.SetCost(-1, 0), ErrConfig)
	require.Equal(t, 0.2, e.Config().Alpha, "a rejected cost changes nothing")
}

// mustStep is Step that fails the test on an error.
func mustStep(t *testing.T, e *Engine, ev Event) Decision {
	t.Helper()
	d, err := e.Step(ev)
	require.NoError(t, err)
	return d
}

// Cancels that came before the period had CancelMinOffloads offloads are
// judged at the offload that reaches the minimum: two offloads cancelled,
// then a third (2 > 0.5 x 3) throttles the period at once.
func TestThrottleJudgedAtOffload(t *testing.T) {
	cfg := testConfig()
	cfg.CancelMinOffloads = 3
	e, err := New(cfg)
	require.NoError(t, err)
	mustStep(t, e, post(0, 1, 1, MB))
	require.Equal(t, Offload, mustStep(t, e, exp(100*us, 1, 1, MB)).Action)
	mustStep(t, e, cancel(110*us, 1))
	mustStep(t, e, post(120*us, 2, 1, MB))
	require.Equal(t, Offload, mustStep(t, e, exp(220*us, 2, 1, MB)).Action)
	mustStep(t, e, cancel(230*us, 2))
	require.False(t, e.Stats().Throttled, "two offloads are below the minimum of three")
	mustStep(t, e, post(240*us, 3, 1, MB))
	require.Equal(t, Offload, mustStep(t, e, exp(340*us, 3, 1, MB)).Action)
	require.True(t, e.Stats().Throttled, "2 cancels > 0.5 x 3 offloads")
	mustStep(t, e, post(350*us, 4, 1, MB))
	require.Equal(t, dec(Onload, ReasonThrottled).Reason, mustStep(t, e, exp(450*us, 4, 1, MB)).Reason)
}

// A receive armed at post whose message turns out eager stays offloaded
// (the transport has it) and its header counts as eager.
func TestArmedReceiveGetsEagerMessage(t *testing.T) {
	e, err := New(testConfig())
	require.NoError(t, err)
	mustStep(t, e, post(0, 1, 1, MB)) // teach peer 1 a delta of 500 us
	require.Equal(t, Onload, mustStep(t, e, exp(1*us, 1, 1, MB)).Action)
	mustStep(t, e, start(500*us, 1))
	mustStep(t, e, done(512*us, 1))
	require.Equal(t, Offload, mustStep(t, e, post(600*us, 2, 1, MB)).Action)
	require.Equal(t, dec(Offload, ReasonArmed).Reason, mustStep(t, e, exp(700*us, 2, 1, 100)).Reason)
	s := e.Stats()
	require.Equal(t, uint64(1), s.Eager, "%+v", s)
	require.Zero(t, s.Tracked)
}

// With the engine off nothing is learned.
func TestDisabledLearnsNothing(t *testing.T) {
	cfg := testConfig()
	cfg.Enabled = false
	e, err := New(cfg)
	require.NoError(t, err)
	mustStep(t, e, post(0, 1, 1, MB))
	mustStep(t, e, exp(10*us, 1, 1, MB))
	mustStep(t, e, start(500*us, 1))
	mustStep(t, e, done(512*us, 1))
	_, ok := e.Delta(1)
	require.False(t, ok)
}

// Huge sizes (a corrupt header) cannot overflow the bytes behind K: K
// stays positive, a transfer with no delay is onloaded, and K returns to
// 0 once they are done.
func TestKHugeSizes(t *testing.T) {
	e, err := New(testConfig())
	require.NoError(t, err)
	mustStep(t, e, unexp(0, 1, 1, 1<<62))
	mustStep(t, e, unexp(0, 2, 1, 1<<62))
	require.Greater(t, e.Stats().K, float64(0))
	mustStep(t, e, post(1*us, 3, 1, MB))
	require.Equal(t, Onload, mustStep(t, e, exp(1*us, 3, 1, MB)).Action)
	for _, id := range []TransferID{1, 2, 3} {
		mustStep(t, e, start(2*us, id))
		mustStep(t, e, done(3*us, id))
	}
	require.Zero(t, e.Stats().K)
}
