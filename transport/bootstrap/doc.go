// Package bootstrap is how the ranks of a troupe job find each other at start-up.
//
// A job is started by the embedded launcher (Launch, used by `troupe run`). The
// launcher generates a random 128-bit job Token, starts a rendezvous Server on
// loopback and spawns N rank processes with TROUPE_RANK, TROUPE_SIZE,
// TROUPE_RDV and TROUPE_TOKEN in their environment. Each rank calls FromEnv
// (or Dial, for several in-process ranks in tests) and gets a Bootstrapper:
// its rank, the job size, AllGather (used by the transport to exchange UCX
// worker addresses) and Barrier.
//
// The rendezvous protocol is a sequence of length-prefixed JSON frames over TCP
// (see frame.go and docs/launcher.md). Joins without the job token, with a rank
// out of range or with a rank that already joined are rejected. Collectives
// are matched by name; if a rank disconnects before a collective completes,
// every other participant gets a *RankLostError naming that rank. A rank
// whose connection ends without a goodbye (its process died) is also
// reported to every other rank at once, collective or not (LossNotifier):
// that is how the transport learns of a dead rank it never talked to.
//
// The PMIx path (ranks started by mpirun or srun) is a later addition: it plugs
// in through the PMIx function variable, see env.go.
package bootstrap
