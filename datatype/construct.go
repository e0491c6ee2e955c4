package datatype

import "fmt"

// Constructors. Every constructor checks its arguments, computes size, bounds
// and the signature with overflow-checked 64-bit arithmetic, and compiles the
// new type's program from the programs of its old types. Blocks with a zero
// block length (and constructors with a zero count) contribute nothing: not
// data, not bounds. A type with an empty typemap has lb = ub = 0, as in
// MPICH and Open MPI, unless Resized or Subarray set its bounds explicitly.
//
// Resized (and Subarray, which MPI defines through it) puts lb and ub
// markers in the typemap (MPI-4 section 5.1.7), and every type built from
// such a type inherits them: where a typemap holds an lb marker, lb is the
// lowest marker, not the lowest data byte, and likewise for ub. Only a
// Struct that mixes members with and without markers sees a difference:
// there the members without markers do not move the bounds the markers set.

// marks records which bound markers a typemap holds.
type marks uint8

const (
	markLB marks = 1 << iota
	markUB
)

// bounds accumulates the MPI lb and ub of a new typemap from its blocks:
// over all blocks, and over those whose old type holds markers.
type bounds struct {
	set    bool
	lb, ub int64
	marks  marks
	mlb    int64 // lowest lb of the blocks with an lb marker
	mub    int64 // highest ub of the blocks with a ub marker
}

// block adds k consecutive copies of old at byte displacement disp.
func (b *bounds) block(disp, k int64, old *Type, a *arith) {
	if k == 0 {
		return
	}
	lo := a.add(disp, old.lb, "lower bound")
	hi := a.add(a.add(disp, old.ub, "upper bound"), a.mul(k-1, old.Extent(), "upper bound"), "upper bound")
	if !b.set || lo < b.lb {
		b.lb = lo
	}
	if !b.set || hi > b.ub {
		b.ub = hi
	}
	b.set = true
	if old.marks&markLB != 0 {
		if b.marks&markLB == 0 || lo < b.mlb {
			b.mlb = lo
		}
		b.marks |= markLB
	}
	if old.marks&markUB != 0 {
		if b.marks&markUB == 0 || hi > b.mub {
			b.mub = hi
		}
		b.marks |= markUB
	}
}

// derive makes the type of root with the bounds accumulated in b.
func (b *bounds) derive(comb Combiner, root *node, parts []sigPart, a *arith) (*Type, error) {
	lb, ub := b.lb, b.ub
	if b.marks&markLB != 0 {
		lb = b.mlb
	}
	if b.marks&markUB != 0 {
		ub = b.mub
	}
	t, err := derive(comb, root, lb, ub, parts, a)
	if t != nil {
		t.marks = b.marks
	}
	return t, err
}

func derive(comb Combiner, root *node, lb, ub int64, parts []sigPart, a *arith) (*Type, error) {
	t := &Type{id: nextID.Add(1), comb: comb, root: root, lb: lb, ub: ub, parts: parts}
	if root != nil {
		t.size = root.size
		a.sub(root.hi, root.lo, "true extent")
	}
	a.sub(ub, lb, "extent")
	for _, p := range parts {
		a.mul(p.k, p.t.elements, "signature length")
	}
	if err := a.err(); err != nil {
		return nil, err
	}
	t.sig, t.elements = hashParts(parts)
	return t, nil
}

func checkOld(fn string, old *Type) error {
	if err := usable(old, fn+": old type"); err != nil {
		return err
	}
	return nil
}

// Contiguous returns count copies of old laid out at consecutive extents
// (MPI_Type_contiguous).
func Contiguous(count int64, old *Type) (*Type, error) {
	if err := checkOld("Contiguous", old); err != nil {
		return nil, err
	}
	if count < 0 {
		return nil, invalid("Contiguous: negative count %d", count)
	}
	var a arith
	var b bounds
	b.block(0, count, old, &a)
	root := repeat(old.root, count, old.Extent(), &a)
	return b.derive(CombinerContiguous, root, []sigPart{{count, old}}, &a)
}

// Vector returns count blocks of blocklen copies of old, the blocks stride
// extents of old apart (MPI_Type_vector). stride may be negative.
func Vector(count, blocklen, stride int64, old *Type) (*Type, error) {
	if err := checkOld("Vector", old); err != nil {
		return nil, err
	}
	var a arith
	bs := a.mul(stride, old.Extent(), "Vector: stride in bytes")
	if err := a.err(); err != nil {
		return nil, err
	}
	t, err := hvector("Vector", count, blocklen, bs, old)
	if t != nil {
		t.comb = CombinerVector
	}
	return t, err
}

// HVector is Vector with the stride given in bytes (MPI_Type_create_hvector).
func HVector(count, blocklen, strideBytes int64, old *Type) (*Type, error) {
	if err := checkOld("HVector", old); err != nil {
		return nil, err
	}
	return hvector("HVector", count, blocklen, strideBytes, old)
}

func hvector(fn string, count, blocklen, stride int64, old *Type) (*Type, error) {
	if count < 0 || blocklen < 0 {
		return nil, invalid("%s: negative count %d or blocklength %d", fn, count, blocklen)
	}
	var a arith
	var b bounds
	if count > 0 && blocklen > 0 {
		b.block(0, blocklen, old, &a)
		last := a.mul(count-1, stride, fn+": span")
		b.block(last, blocklen, old, &a)
	}
	blk := repeat(old.root, blocklen, old.Extent(), &a)
	root := repeat(blk, count, stride, &a)
	var n int64 // copies of old in the signature; none count if old is empty
	if old.elements > 0 {
		n = a.mul(count, blocklen, fn+": elements")
	}
	return b.derive(CombinerHVector, root, []sigPart{{n, old}}, &a)
}

// Indexed returns blocks of blocklens[i] copies of old at displacements
// disps[i], in extents of old (MPI_Type_indexed).
func Indexed(blocklens, disps []int64, old *Type) (*Type, error) {
	if err := checkOld("Indexed", old); err != nil {
		return nil, err
	}
	if len(blocklens) != len(disps) {
		return nil, invalid("Indexed: %d block lengths but %d displacements", len(blocklens), len(disps))
	}
	var a arith
	bd := make([]int64, len(disps))
	for i, d := range disps {
		bd[i] = a.mul(d, old.Extent(), "Indexed: displacement in bytes")
	}
	if err := a.err(); err != nil {
		return nil, err
	}
	return hindexed("Indexed", CombinerIndexed, blocklens, bd, old)
}

// HIndexed is Indexed with displacements in bytes (MPI_Type_create_hindexed).
func HIndexed(blocklens, byteDisps []int64, old *Type) (*Type, error) {
	if err := checkOld("HIndexed", old); err != nil {
		return nil, err
	}
	if len(blocklens) != len(byteDisps) {
		return nil, invalid("HIndexed: %d block lengths but %d displacements", len(blocklens), len(byteDisps))
	}
	return hindexed("HIndexed", CombinerHIndexed, blocklens, byteDisps, old)
}

// IndexedBlock returns blocks of blocklen copies of old at displacements
// disps[i], in extents of old (MPI_Type_create_indexed_block).
func IndexedBlock(blocklen int64, disps []int64, old *Type) (*Type, error) {
	if err := checkOld("IndexedBlock", old); err != nil {
		return nil, err
	}
	if blocklen < 0 {
		return nil, invalid("IndexedBlock: negative block length %d", blocklen)
	}
	var a arith
	bd := make([]int64, len(disps))
	bl := make([]int64, len(disps))
	for i, d := range disps {
		bd[i] = a.mul(d, old.Extent(), "IndexedBlock: displacement in bytes")
		bl[i] = blocklen
	}
	if err := a.err(); err != nil {
		return nil, err
	}
	return hindexed("IndexedBlock", CombinerIndexedBlock, bl, bd, old)
}

// HIndexedBlock is IndexedBlock with displacements in bytes
// (MPI_Type_create_hindexed_block).
func HIndexedBlock(blocklen int64, byteDisps []int64, old *Type) (*Type, error) {
	if err := checkOld("HIndexedBlock", old); err != nil {
		return nil, err
	}
	if blocklen < 0 {
		return nil, invalid("HIndexedBlock: negative block length %d", blocklen)
	}
	bl := make([]int64, len(byteDisps))
	for i := range bl {
		bl[i] = blocklen
	}
	return hindexed("HIndexedBlock", CombinerHIndexedBlock, bl, byteDisps, old)
}

func hindexed(fn string, comb Combiner, blocklens, disps []int64, old *Type) (*Type, error) {
	var a arith
	var b bounds
	parts := make([]entry, 0, len(disps))
	var total int64
	for i, bl := range blocklens {
		if bl < 0 {
			return nil, invalid("%s: negative block length %d at index %d", fn, bl, i)
		}
		if bl == 0 {
			continue
		}
		b.block(disps[i], bl, old, &a)
		if old.elements > 0 {
			total = a.add(total, bl, fn+": elements")
		}
		parts = append(parts, entry{disp: disps[i], nd: repeat(old.root, bl, old.Extent(), &a)})
	}
	if err := a.err(); err != nil {
		return nil, err
	}
	root := listNode(parts, &a)
	return b.derive(comb, root, []sigPart{{total, old}}, &a)
}

// Struct returns blocks of blocklens[i] copies of types[i] at byte
// displacements byteDisps[i] (MPI_Type_create_struct). The extent is
// exactly ub - lb: no alignment epsilon is added (MPI leaves the epsilon to
// the implementation; see docs/datatype.md). Use Resized to add C-struct
// padding.
func Struct(blocklens, byteDisps []int64, types []*Type) (*Type, error) {
	if len(blocklens) != len(byteDisps) || len(blocklens) != len(types) {
		return nil, invalid("Struct: %d block lengths, %d displacements, %d types",
			len(blocklens), len(byteDisps), len(types))
	}
	var a arith
	var b bounds
	parts := make([]entry, 0, len(types))
	sp := make([]sigPart, 0, len(types))
	for i, t := range types {
		if err := usable(t, "Struct: type"); err != nil {
			return nil, fmt.Errorf("%w: Struct: type %d: %w", ErrInvalidArgument, i, err)
		}
		if blocklens[i] < 0 {
			return nil, invalid("Struct: negative block length %d at index %d", blocklens[i], i)
		}
		if blocklens[i] == 0 {
			continue
		}
		b.block(byteDisps[i], blocklens[i], t, &a)
		parts = append(parts, entry{disp: byteDisps[i], nd: repeat(t.root, blocklens[i], t.Extent(), &a)})
		if t.elements == 0 {
			continue // an empty member adds nothing to the signature
		}
		if k := len(sp) - 1; k >= 0 && sp[k].t == t {
			sp[k].k = a.add(sp[k].k, blocklens[i], "Struct: elements")
		} else {
			sp = append(sp, sigPart{blocklens[i], t})
		}
	}
	if err := a.err(); err != nil {
		return nil, err
	}
	root := listNode(parts, &a)
	return b.derive(CombinerStruct, root, sp, &a)
}

// Order is the storage order of a Subarray: OrderC (last index fastest) or
// OrderFortran (first index fastest).
type Order uint8

// The two array storage orders of MPI_Type_create_subarray.
const (
	OrderC Order = iota
	OrderFortran
)

// Subarray returns the subarray of subsizes elements starting at starts of
// an n-dimensional array of sizes elements of old (MPI_Type_create_subarray).
// Its lb is 0 and its extent is the whole array, prod(sizes) * extent(old),
// as the MPI standard defines. sizes must be >= 1, subsizes >= 0 and
// starts[i] + subsizes[i] <= sizes[i].
func Subarray(sizes, subsizes, starts []int64, order Order, old *Type) (*Type, error) {
	if err := checkOld("Subarray", old); err != nil {
		return nil, err
	}
	n := len(sizes)
	if n == 0 || len(subsizes) != n || len(starts) != n {
		return nil, invalid("Subarray: %d sizes, %d subsizes, %d starts (need equal, >= 1)", n, len(subsizes), len(starts))
	}
	if order != OrderC && order != OrderFortran {
		return nil, invalid("Subarray: unknown order %d", order)
	}
	for d := 0; d < n; d++ {
		if sizes[d] < 1 || subsizes[d] < 0 || starts[d] < 0 || starts[d] > sizes[d]-subsizes[d] {
			return nil, invalid("Subarray: dimension %d: size %d, subsize %d, start %d out of range",
				d, sizes[d], subsizes[d], starts[d])
		}
	}
	var a arith
	// dims from fastest to slowest.
	dims := make([]int, n)
	for i := range dims {
		if order == OrderC {
			dims[i] = n - 1 - i
		} else {
			dims[i] = i
		}
	}
	stride := old.Extent()
	root := old.root
	var off, elems int64 = 0, 1
	for _, d := range dims {
		root = repeat(root, subsizes[d], stride, &a)
		off = a.add(off, a.mul(starts[d], stride, "Subarray: offset"), "Subarray: offset")
		if old.elements > 0 { // copies of an empty type are empty, however many
			elems = a.mul(elems, subsizes[d], "Subarray: elements")
		}
		stride = a.mul(stride, sizes[d], "Subarray: extent")
	}
	root = shift(root, off, &a)
	t, err := derive(CombinerSubarray, root, 0, stride, []sigPart{{elems, old}}, &a)
	if t != nil {
		t.marks = markLB | markUB // MPI defines it as a resized type
	}
	return t, err
}

// Resized returns old with lower bound lb and extent extent
// (MPI_Type_create_resized); the data are unchanged. A negative extent is
// rejected.
func Resized(old *Type, lb, extent int64) (*Type, error) {
	if err := checkOld("Resized", old); err != nil {
		return nil, err
	}
	if extent < 0 {
		return nil, invalid("Resized: negative extent %d", extent)
	}
	var a arith
	ub := a.add(lb, extent, "Resized: upper bound")
	t, err := derive(CombinerResized, old.root, lb, ub, []sigPart{{1, old}}, &a)
	if t != nil {
		t.marks = markLB | markUB
	}
	return t, err
}

// Dup returns a new type with the same typemap and bounds as old
// (MPI_Type_dup). It has its own identity: it is a different layout-cache
// key and is freed independently.
func Dup(old *Type) (*Type, error) {
	if err := checkOld("Dup", old); err != nil {
		return nil, err
	}
	var a arith
	t, err := derive(CombinerDup, old.root, old.lb, old.ub, []sigPart{{1, old}}, &a)
	if t != nil {
		t.marks = old.marks
	}
	return t, err
}
