// Package datatype implements MPI derived datatypes with MPI-4 semantics for
// troupe: constructors (contiguous, vector, hvector, indexed, hindexed,
// indexed_block, hindexed_block, struct, subarray, resized, dup), the MPI
// queries (size, extent, lb, ub, true lb, true extent, type signature,
// typemap), a compiled representation made of nested regular loops and
// irregular lists, fast pack and unpack on byte slices and on raw memory, a
// resumable segment iterator over the packed stream, a compact signature hash
// for matching a sender's and a receiver's type signatures, and a layout cache
// (type, base address, count) -> flattened segments and block statistics.
//
// The package is pure Go: it performs no I/O and imports nothing of troupe.
// It starts goroutines only in PackParallel and UnpackParallel, which wait
// for them before returning. All results are deterministic.
//
// Offsets are in bytes and are relative to the buffer origin, MPI's "buf"
// argument. Because MPI types may have negative displacements, the byte-slice
// functions take the origin as an index (base) into the slice, and the
// raw-memory functions take a region plus the origin's offset within it.
//
// Types are immutable after construction; every exported method is safe for
// concurrent use. A type is compiled when it is built, so Commit only checks
// that the type is usable; it exists for parity with MPI_Type_commit.
package datatype
