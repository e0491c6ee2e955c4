// Package overlap is troupe's overlap engine: a pure, deterministic state
// machine that decides, transfer by transfer, how a rendezvous (large)
// message makes progress on the receiving rank.
//
// The engine follows the communication-aware overlap design of paper 004
// (CHAMPION, ISC 2020) and the structure of etcd's raft library: the caller
// feeds it events (a receive was posted, a header/RTS arrived, a transfer
// started or completed, a receive was cancelled, the receiver entered the
// library, time passed, a prefetch slot was released) and it answers each
// event with a Decision. The engine performs no I/O, starts no goroutines,
// reads no clock (every Event carries its own timestamp) and imports no
// other troupe package, so it is unit-testable without UCX and replayable:
// the same event sequence always yields the same decisions.
//
// The three outcomes for a transfer are:
//
//   - Offload: the destination is known (a posted receive), so the progress
//     goroutine starts the data transfer the moment the header arrives,
//     without waiting for the receiver.
//   - Onload: leave the transfer to the receiver's next progress or receive
//     call (today's behaviour, and the cheapest when the receiver polls
//     often).
//   - Prefetch: the message is unexpected (no receive posted yet); pull it
//     now into a slot of a pre-registered pool so the sender is released,
//     and copy out of the slot when the receive is posted.
//
// The engine is not safe for concurrent use; the transport serializes calls
// (typically by calling it only from the progress goroutine, or under the
// lock that already protects its matching queues).
//
// See docs/overlap.md for the model, the rule, the defaults and the contract
// a transport implements to drive the engine.
package overlap
