// Package actor is troupe's actor runtime: a protoactor-go ActorSystem on
// every rank, whose address names the rank ("rank/3"), with every other
// rank's actors reachable through UCX.
//
// Init joins the job (the embedded launcher's environment, or PMIx) and
// returns a Runtime. A PID of another rank resolves, through protoactor's
// address resolver, to a process that sends each message as one UCP active
// message: the envelope (a msgpack array: version, flags, source rank,
// target, sender, type id, payload length) in the header and the msgpack
// body as data, eager or rendezvous by size. protoactor's gRPC remote is not
// used.
//
// Messages crossing ranks must be of registered types (Register, once per
// type on every rank); Send, Request and RequestFuture check this at the
// sender. A field of type Payload travels outside the body and lands where
// the receiving actor's PostReceive hook says (zero copy), or in pooled
// memory.
//
// Messages between two actors arrive in send order. Per-peer credits bound
// what a receiving rank holds for actors that have not processed their
// messages yet: spawn receiving actors with Runtime.Props.
//
// Actor arrays (NewArray) spread an N-dimensional index space of elements
// over the ranks; Array.Broadcast reaches every element and
// Element.Contribute runs reductions within each rank and then up a tree of
// ranks.
package actor
