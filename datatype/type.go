package datatype

import (
	"fmt"
	"sync"
	"sync/atomic"
	"weak"
)

// Combiner tells which constructor built a type, like MPI_Type_get_envelope.
type Combiner uint8

// The combiners, one per constructor.
const (
	CombinerNamed Combiner = iota
	CombinerContiguous
	CombinerVector
	CombinerHVector
	CombinerIndexed
	CombinerHIndexed
	CombinerIndexedBlock
	CombinerHIndexedBlock
	CombinerStruct
	CombinerSubarray
	CombinerResized
	CombinerDup
)

var combinerNames = [...]string{"named", "contiguous", "vector", "hvector", "indexed",
	"hindexed", "indexed_block", "hindexed_block", "struct", "subarray", "resized", "dup"}

// String returns the MPI-style name of the combiner.
func (c Combiner) String() string {
	if int(c) < len(combinerNames) {
		return combinerNames[c]
	}
	return fmt.Sprintf("Combiner(%d)", int(c))
}

// Type is an MPI datatype: a typemap (a sequence of basic types at byte
// displacements) plus the lower and upper bounds that define its extent.
// Types are immutable; build them with the constructors of this package and
// use the predefined named types (Int8, ..., Byte) as leaves.
type Type struct {
	id       uint64
	name     string
	comb     Combiner
	basic    uint8 // basic type code, 0 for derived types
	size     int64
	lb, ub   int64
	marks    marks // lb and ub markers in the typemap (Resized, Subarray)
	root     *node // compiled program of one element; nil when size == 0
	sig      sigHash
	parts    []sigPart // the signature as repetitions of other types
	elements int64     // number of basic elements of one element

	last   atomic.Pointer[countProg] // program of the last count used
	freed  atomic.Bool
	mu     sync.Mutex
	caches map[weak.Pointer[LayoutCache]]struct{} // caches holding entries of the type
}

var nextID atomic.Uint64

func newNamed(name string, code uint8, size int64) *Type {
	var a arith
	t := &Type{id: nextID.Add(1), name: name, comb: CombinerNamed, basic: code, size: size,
		ub: size, root: leafNode(0, size, &a), elements: 1}
	t.sig = basicHash(code)
	return t
}

// The predefined named types. They cannot be freed.
var (
	Byte       = newNamed("byte", 1, 1)
	Int8       = newNamed("int8", 2, 1)
	Int16      = newNamed("int16", 3, 2)
	Int32      = newNamed("int32", 4, 4)
	Int64      = newNamed("int64", 5, 8)
	Uint8      = newNamed("uint8", 6, 1)
	Uint16     = newNamed("uint16", 7, 2)
	Uint32     = newNamed("uint32", 8, 4)
	Uint64     = newNamed("uint64", 9, 8)
	Float32    = newNamed("float32", 10, 4)
	Float64    = newNamed("float64", 11, 8)
	Complex64  = newNamed("complex64", 12, 8)
	Complex128 = newNamed("complex128", 13, 16)
)

// String returns the name of a named type, or the combiner and id of a
// derived one.
func (t *Type) String() string {
	if t == nil {
		return "<nil>"
	}
	if t.comb == CombinerNamed {
		return t.name
	}
	return fmt.Sprintf("%s#%d", t.comb, t.id)
}

// Combiner returns the constructor that built t.
func (t *Type) Combiner() Combiner { return t.comb }

// IsNamed reports whether t is one of the predefined named types.
func (t *Type) IsNamed() bool { return t.comb == CombinerNamed }

// Size returns the number of data bytes of one element (MPI_Type_size).
func (t *Type) Size() int64 { return t.size }

// LB returns the lower bound of t (MPI_Type_get_extent).
func (t *Type) LB() int64 { return t.lb }

// UB returns the upper bound of t: LB + Extent.
func (t *Type) UB() int64 { return t.ub }

// Extent returns UB - LB, the stride between consecutive elements of t.
func (t *Type) Extent() int64 { return t.ub - t.lb }

// TrueLB returns the lowest displacement of any data byte of t
// (MPI_Type_get_true_extent), ignoring the bounds set by Resized. It is 0
// when t has no data.
func (t *Type) TrueLB() int64 {
	if t.root == nil {
		return 0
	}
	return t.root.lo
}

// TrueUB returns one past the highest displacement of any data byte of t; 0
// when t has no data.
func (t *Type) TrueUB() int64 {
	if t.root == nil {
		return 0
	}
	return t.root.hi
}

// TrueExtent returns TrueUB - TrueLB.
func (t *Type) TrueExtent() int64 { return t.TrueUB() - t.TrueLB() }

// Elements returns the number of basic elements in one element of t, the
// length of its type signature.
func (t *Type) Elements() int64 { return t.elements }

// Commit checks that t can be used for communication and returns an error if
// it is nil or freed. Types are compiled when they are constructed, so Commit
// does no other work; it exists for parity with MPI_Type_commit.
func (t *Type) Commit() error { return usable(t, "type") }

// Free marks t as freed (MPI_Type_free) and evicts every layout-cache entry
// that refers to it. Types built from t stay valid, as in MPI. Freeing a
// named type or freeing twice returns an error.
func (t *Type) Free() error {
	if t == nil {
		return invalid("Free of a nil type")
	}
	if t.comb == CombinerNamed {
		return invalid("cannot free named type %s", t.name)
	}
	if t.freed.Swap(true) {
		return fmt.Errorf("%w: %w: %s freed twice", ErrInvalidArgument, ErrFreed, t)
	}
	t.mu.Lock()
	caches := make([]*LayoutCache, 0, len(t.caches))
	for wc := range t.caches {
		if c := wc.Value(); c != nil {
			caches = append(caches, c)
		}
	}
	t.caches = nil
	t.mu.Unlock()
	for _, c := range caches {
		c.evictType(t)
	}
	return nil
}

// Freed reports whether Free has been called on t.
func (t *Type) Freed() bool { return t.freed.Load() }

func usable(t *Type, what string) error {
	if t == nil {
		return invalid("%s is nil", what)
	}
	if t.freed.Load() {
		return fmt.Errorf("%w: %w: %s %s", ErrInvalidArgument, ErrFreed, what, t)
	}
	return nil
}
