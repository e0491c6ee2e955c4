package overlap

import (
	"fmt"
	"time"
)

// TransferID names one message on the receiving rank. The transport picks
// it: when the receive is posted first (expected message) the id is the
// receive's; when the header arrives first (unexpected message) the id is
// allocated at header arrival and reused by the RecvPosted that matches it.
type TransferID = uint64

// AnyPeer is the Peer of a receive posted for any source.
const AnyPeer = -1

// NoSlot is Decision.Slot when the decision uses no prefetch slot.
const NoSlot = -1

// EventKind says what happened.
type EventKind uint8

// Event kinds, in the order a transfer typically sees them.
const (
	// RecvPosted: the receiver posted a receive (ID, Peer or AnyPeer, Tag,
	// Size = buffer size). If the message's header already arrived
	// (unexpected), ID is the header's id and the event is the match.
	RecvPosted EventKind = iota + 1
	// HeaderArrived: the eager header or rendezvous RTS of a message
	// arrived (ID, Peer, Tag, Size = message size). Expected is true when
	// the transport matched it to a posted receive (then ID is that
	// receive's id), false when it is unexpected (ID is new).
	HeaderArrived
	// TransferStarted: the data transfer of ID began (GET issued).
	TransferStarted
	// TransferCompleted: the data of ID is in its destination (the user
	// buffer, or the prefetch slot).
	TransferCompleted
	// RecvCancelled: the receive ID was cancelled before it completed.
	RecvCancelled
	// Progress: the receiver entered the library (progress, test, wait or
	// receive call). Only At is read.
	Progress
	// Tick: time passed; lets the engine roll its period without other
	// traffic. Only At is read.
	Tick
	// PrefetchConsumed: the transport finished copying prefetched ID out of
	// its slot into the user buffer; the slot returns to the pool. Valid
	// only after both the matching RecvPosted and TransferCompleted.
	PrefetchConsumed
	// PrefetchDropped: prefetched ID was discarded (expired, peer lost,
	// transfer failed) without being consumed; no write into its slot is
	// in flight any more. The slot returns to the pool.
	PrefetchDropped
	// OnloadDropped: the unexpected message ID, onloaded or eager (not
	// prefetched), was discarded before any receive matched it and before
	// its transfer started: its consumer went away (an actor stopped with
	// the message in its mailbox). The engine forgets it.
	OnloadDropped
	// Revisit: the expected transfer ID, onloaded with a Decision.Revisit
	// delay, is still held (not started, not cancelled) that long after the
	// decision. The engine offloads it if the receiver has not been active
	// since its header arrived (or since the previous Revisit that kept it
	// onloaded), else keeps it onloaded with a new delay.
	Revisit
)

var eventNames = [...]string{
	RecvPosted:        "RecvPosted",
	HeaderArrived:     "HeaderArrived",
	TransferStarted:   "TransferStarted",
	TransferCompleted: "TransferCompleted",
	RecvCancelled:     "RecvCancelled",
	Progress:          "Progress",
	Tick:              "Tick",
	PrefetchConsumed:  "PrefetchConsumed",
	PrefetchDropped:   "PrefetchDropped",
	OnloadDropped:     "OnloadDropped",
	Revisit:           "Revisit",
}

func (k EventKind) String() string {
	if int(k) < len(eventNames) && eventNames[k] != "" {
		return eventNames[k]
	}
	return fmt.Sprintf("EventKind(%d)", k)
}

// Event is one input to Engine.Step. Fields a kind does not use are
// ignored.
type Event struct {
	Kind EventKind
	// At is the event time on a monotonic clock with an arbitrary origin
	// (for instance time.Since(start) of the rank). An At earlier than a
	// previous event's is treated as that previous time.
	At       time.Duration
	ID       TransferID
	Peer     int
	Tag      uint64
	Size     int64
	Expected bool
	// InPlace marks an unexpected HeaderArrived whose prefetch would land
	// straight in the message's final destination (an actor message: its
	// landing buffer is known at arrival), not in a pool slot copied out
	// later. Such a prefetch costs no copy, so the per-peer prefetch
	// history neither gates it nor learns from it; the pool, the size limit
	// and K still apply.
	InPlace bool
}

// Action is what the transport should do with a transfer.
type Action uint8

const (
	// None: this event decides nothing; carry on.
	None Action = iota
	// Offload: the progress goroutine owns the transfer. For RecvPosted:
	// hand the receive to the progress goroutine / UCX now so it starts the
	// transfer the moment the header arrives. For HeaderArrived: start the
	// transfer now, into the posted receive's buffer.
	Offload
	// Onload: leave the transfer to the receiver's next progress or receive
	// call. For a RecvPosted that matches an onloaded unexpected header:
	// start the transfer now (the receiver is in the library).
	Onload
	// Prefetch: for an unexpected HeaderArrived, start the transfer now
	// into pool slot Decision.Slot. For the RecvPosted that matches a
	// prefetched message: copy from Decision.Slot once the transfer has
	// completed, then report PrefetchConsumed.
	Prefetch
)

var actionNames = [...]string{None: "None", Offload: "Offload", Onload: "Onload", Prefetch: "Prefetch"}

func (a Action) String() string {
	if int(a) < len(actionNames) {
		return actionNames[a]
	}
	return fmt.Sprintf("Action(%d)", a)
}

// Reason says why the engine chose an Action; it is for tests, logs and
// counters, never needed to act on a decision.
type Reason uint8

const (
	// ReasonNone: the event decides nothing.
	ReasonNone Reason = iota
	// ReasonDisabled: the engine is off; always onload.
	ReasonDisabled
	// ReasonEager: the message is below the rendezvous threshold.
	ReasonEager
	// ReasonDelayAboveK: expected onload delay delta > K: offload.
	ReasonDelayAboveK
	// ReasonDelayBelowK: delta <= K (or unknown): offloading gains nothing.
	ReasonDelayBelowK
	// ReasonThrottled: the period's cancellation rate of offloaded
	// receives passed the threshold; no offload until the next period.
	ReasonThrottled
	// ReasonArmed: the receive was offloaded when it was posted.
	ReasonArmed
	// ReasonPrefetch: unexpected, fits a free slot, peer history good.
	ReasonPrefetch
	// ReasonTooLarge: unexpected but larger than MaxPrefetchSize.
	ReasonTooLarge
	// ReasonPeerHistory: unexpected but this peer's prefetches were mostly
	// useless recently.
	ReasonPeerHistory
	// ReasonPoolFull: unexpected, would prefetch, but no slot is free (or
	// the pool has no slots).
	ReasonPoolFull
	// ReasonMatched: a receive matched an unexpected message that was
	// onloaded: the receiver starts it now.
	ReasonMatched
	// ReasonPrefetched: a receive matched a prefetched message: copy from
	// its slot.
	ReasonPrefetched
	// ReasonRevisited: an onloaded expected transfer whose receiver stayed
	// away until its revisit time: offload it now.
	ReasonRevisited
)

var reasonNames = [...]string{
	ReasonNone:        "none",
	ReasonDisabled:    "disabled",
	ReasonEager:       "eager",
	ReasonDelayAboveK: "delay>K",
	ReasonDelayBelowK: "delay<=K",
	ReasonThrottled:   "throttled",
	ReasonArmed:       "armed",
	ReasonPrefetch:    "prefetch",
	ReasonTooLarge:    "too-large",
	ReasonPeerHistory: "peer-history",
	ReasonPoolFull:    "pool-full",
	ReasonMatched:     "matched",
	ReasonPrefetched:  "prefetched",
	ReasonRevisited:   "revisited",
}

func (r Reason) String() string {
	if int(r) < len(reasonNames) {
		return reasonNames[r]
	}
	return fmt.Sprintf("Reason(%d)", r)
}

// Decision is the engine's answer to one event.
type Decision struct {
	Action Action
	ID     TransferID
	// Slot is the prefetch pool slot for Action == Prefetch, else NoSlot.
	Slot   int
	Reason Reason
	// Revisit, when > 0, comes with an Onload of an expected transfer
	// (reason delay<=K, or a Revisit event's answer): if the transfer is
	// still held that long after this decision (the receiver has not
	// started it), send a Revisit event for it. 0: no revisit.
	Revisit time.Duration
}

func (d Decision) String() string {
	switch {
	case d.Action == Prefetch:
		return fmt.Sprintf("%v(id=%d slot=%d %v)", d.Action, d.ID, d.Slot, d.Reason)
	case d.Revisit > 0:
		return fmt.Sprintf("%v(id=%d %v revisit=%v)", d.Action, d.ID, d.Reason, d.Revisit)
	}
	return fmt.Sprintf("%v(id=%d %v)", d.Action, d.ID, d.Reason)
}
