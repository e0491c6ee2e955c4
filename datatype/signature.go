package datatype

import (
	"fmt"
	"math/bits"
)

// A type signature is the sequence of basic types of a typemap, without the
// displacements. MPI requires the signature of count elements of the send
// type to be a prefix of (usually equal to) that of the receive type.
//
// The signature hash is a polynomial hash of that sequence modulo the
// Mersenne prime 2^61-1 under two fixed bases. It depends only on the
// sequence of basic types, never on how the type was built, and it is
// computed from the constructor tree with concatenation and repetition
// formulas, so a vector of a billion float64 is hashed in O(log n) steps.

const mersenne61 = 1<<61 - 1

var sigBases = [2]uint64{0x1fd1_e0c4_27b3_a1d5 % mersenne61, 0x0a3b_5c87_f21d_9e63 % mersenne61}

func mulmod(a, b uint64) uint64 {
	hi, lo := bits.Mul64(a, b)
	// a, b < 2^61, so the product < 2^122: split at bit 61.
	r := (hi<<3 | lo>>61) + lo&mersenne61
	for r >= mersenne61 {
		r -= mersenne61
	}
	return r
}

func addmod(a, b uint64) uint64 {
	r := a + b
	if r >= mersenne61 {
		r -= mersenne61
	}
	return r
}

func powmod(x uint64, e int64) uint64 {
	r := uint64(1)
	for e > 0 {
		if e&1 == 1 {
			r = mulmod(r, x)
		}
		x = mulmod(x, x)
		e >>= 1
	}
	return r
}

// geo returns 1 + y + ... + y^(k-1) and y^k.
func geo(y uint64, k int64) (g, yk uint64) {
	if k == 0 {
		return 0, 1
	}
	if k&1 == 1 {
		g, yk = geo(y, k-1)
		return addmod(1, mulmod(y, g)), mulmod(y, yk)
	}
	g, yk = geo(y, k/2)
	return mulmod(g, addmod(1, yk)), mulmod(yk, yk)
}

// sigHash is the hash of a signature of n basic elements.
type sigHash struct {
	n int64
	h [2]uint64
}

func basicHash(code uint8) sigHash { return sigHash{n: 1, h: [2]uint64{uint64(code), uint64(code)}} }

func (a sigHash) concat(b sigHash) sigHash {
	r := sigHash{n: a.n + b.n}
	for i := range r.h {
		r.h[i] = addmod(mulmod(a.h[i], powmod(sigBases[i], b.n)), b.h[i])
	}
	return r
}

func (a sigHash) repeat(k int64) sigHash {
	r := sigHash{n: a.n * k}
	for i := range r.h {
		g, _ := geo(powmod(sigBases[i], a.n), k)
		r.h[i] = mulmod(a.h[i], g)
	}
	return r
}

// sigPart is k repetitions of the signature of t.
type sigPart struct {
	k int64
	t *Type
}

func hashParts(parts []sigPart) (sigHash, int64) {
	var h sigHash
	for _, p := range parts {
		h = h.concat(p.t.sig.repeat(p.k))
	}
	return h, h.n
}

// Signature is the compact form of the type signature of count elements of a
// type: the number of basic elements and a 122-bit hash of their sequence.
// Two signatures are equal (with overwhelming probability only if) the
// sequences of basic types are equal, however the types were built.
type Signature struct {
	Elements int64     // number of basic elements
	Hash     [2]uint64 // polynomial hash of the sequence of basic types
}

// String formats the signature for logs.
func (s Signature) String() string {
	return fmt.Sprintf("sig(%d:%016x%016x)", s.Elements, s.Hash[0], s.Hash[1])
}

// SignatureHash returns the signature of count elements of t. A sender and a
// receiver whose SignatureHash values are equal have matching type
// signatures; computing it costs O(log count) after construction.
func (t *Type) SignatureHash(count int64) (Signature, error) {
	if err := usable(t, "type"); err != nil {
		return Signature{}, err
	}
	if count < 0 {
		return Signature{}, invalid("SignatureHash: negative count %d", count)
	}
	var a arith
	a.mul(t.elements, count, "signature length")
	if err := a.err(); err != nil {
		return Signature{}, err
	}
	h := t.sig.repeat(count)
	return Signature{Elements: h.n, Hash: h.h}, nil
}

// SigRun is a run of Count consecutive basic elements of the named type Type
// in a type signature.
type SigRun struct {
	Type  *Type
	Count int64
}

// TypeSignature returns the type signature of one element of t as runs of
// equal basic types (adjacent runs of the same type are merged). It returns
// an error if the signature needs more than maxRuns runs; the compact
// alternative is SignatureHash.
func (t *Type) TypeSignature(maxRuns int) ([]SigRun, error) {
	if err := usable(t, "type"); err != nil {
		return nil, err
	}
	var runs []SigRun
	w := sigWalk{max: maxRuns, memo: map[*Type]sigElement{}}
	if !w.appendRuns(&runs, t, 1) {
		return nil, invalid("TypeSignature of %s needs more than %d runs", t, maxRuns)
	}
	return runs, nil
}

func appendRun(runs *[]SigRun, r SigRun, max int) bool {
	if k := len(*runs) - 1; k >= 0 && (*runs)[k].Type == r.Type {
		(*runs)[k].Count += r.Count
		return true
	}
	if len(*runs) >= max {
		return false
	}
	*runs = append(*runs, r)
	return true
}

// sigWalk expands a type signature into runs of at most max entries.
// memo holds the runs of one element of each derived type met so far: a
// type that uses another several times (structs of a type and its dup,
// nested) would otherwise expand it again at every use, 2^depth times.
type sigWalk struct {
	max  int
	memo map[*Type]sigElement
}

// sigElement is the runs of one element of a type, or ok false when they
// are more than the walk's max.
type sigElement struct {
	runs []SigRun
	ok   bool
}

// element returns the runs of one element of derived type t.
func (w *sigWalk) element(t *Type) ([]SigRun, bool) {
	if e, found := w.memo[t]; found {
		return e.runs, e.ok
	}
	var one []SigRun
	ok := true
	for _, p := range t.parts {
		if !w.appendRuns(&one, p.t, p.k) {
			ok = false
			break
		}
	}
	w.memo[t] = sigElement{one, ok}
	return one, ok
}

// appendRuns appends the runs of k elements of t.
func (w *sigWalk) appendRuns(runs *[]SigRun, t *Type, k int64) bool {
	if k == 0 {
		return true
	}
	if t.comb == CombinerNamed {
		return appendRun(runs, SigRun{t, k}, w.max)
	}
	one, ok := w.element(t)
	if !ok {
		return false
	}
	if len(one) == 0 {
		return true
	}
	if len(one) == 1 {
		return appendRun(runs, SigRun{one[0].Type, one[0].Count * k}, w.max)
	}
	for i := int64(0); i < k; i++ {
		for _, r := range one {
			if !appendRun(runs, r, w.max) {
				return false
			}
		}
	}
	return true
}
