// Package actor will be troupe's actor runtime: a protoactor-go actor system
// per rank whose remote PIDs resolve to processes that send through the UCX
// transport (active messages), with a msgpack codec, actor arrays, broadcast
// and reductions (DESIGN sections 2, 3 and 5.1). It is the subject of the
// open issue "Actor runtime over UCX" and holds no code yet.
package actor
