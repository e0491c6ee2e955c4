package overlap

// Stats is a snapshot of the engine's counters. Every rendezvous transfer
// is counted once in exactly one of Offloaded, Onloaded and Prefetched,
// when its mode becomes final; eager messages are counted in Eager. An
// expected transfer onloaded with a revisit (reason delay<=K) is final
// when it starts, completes or is cancelled (then Onloaded) or when a
// Revisit offloads it (then Offloaded and Revisited); until then it is
// counted in OnloadPending only. One
// exception: a receive armed at its post (Offload before any header) counts
// in Offloaded then, so one whose message proves eager counts in Eager as
// well, and one cancelled before its header stays counted (the
// cancellation throttle judges exactly these offloads).
type Stats struct {
	Offloaded  uint64 // transfers offloaded (armed at post or at header)
	Onloaded   uint64 // rendezvous transfers left to the receiver
	Prefetched uint64 // unexpected transfers pulled into a pool slot
	Eager      uint64 // headers below the rendezvous threshold
	Revisited  uint64 // of Offloaded, onloaded transfers a Revisit offloaded

	// Onloaded broken down by reason (the six add up to Onloaded).
	OnloadDisabled    uint64
	OnloadDelayBelowK uint64
	OnloadThrottled   uint64
	OnloadTooLarge    uint64
	OnloadPeerHistory uint64
	OnloadPoolFull    uint64

	Cancelled        uint64 // receives cancelled (any mode)
	OffloadCancelled uint64 // of which had been offloaded

	Periods          uint64 // period boundaries crossed
	ThrottledPeriods uint64 // periods in which offloading was stopped
	Throttled        bool   // offloading is stopped in the current period

	PrefetchUseful  uint64 // receive posted after the prefetch completed
	PrefetchUseless uint64 // receive posted before completion, or dropped
	PrefetchDropped uint64 // of the useless, those dropped unconsumed
	OnloadDropped   uint64 // unexpected onloaded messages dropped unmatched
	// Shadow outcomes: for unexpected messages that were onloaded, whether
	// a prefetch would have completed before the receive was posted.
	ShadowUseful  uint64
	ShadowUseless uint64
	// ShadowDeltas counts delta samples taken for offloaded transfers at
	// the receiver's next activity (what an onload would have waited).
	ShadowDeltas uint64

	PoolSlots     int `metric:",gauge"` // configured slots
	PoolInUse     int `metric:",gauge"` // slots held now
	PoolHighWater int `metric:",gauge"` // most slots ever held at once

	Outstanding   int     `metric:",gauge"`              // rendezvous transfers with a header, not finished
	OnloadPending int     `metric:",gauge"`              // expected transfers onloaded with a revisit, mode not final yet
	K             float64 `metric:"k_nanoseconds,gauge"` // current K in nanoseconds
	Tracked       int     `metric:",gauge"`              // transfer records held (for leak checks)
}
