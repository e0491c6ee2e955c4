package datatype

import (
	"math"
	"sort"
)

// The compiled form of a type is a tree of nodes. A node describes the data
// bytes of one element relative to the element's origin, in typemap order:
//
//	leaf: length bytes at off
//	loop: n copies of child, the i-th at off + i*stride (a vector)
//	list: entries, the i-th at off + disp_i (an indexed or struct type);
//	      an entry with a nil node is a leaf of len bytes
//
// Nodes are immutable once built and may be shared between types. A vector
// of a billion blocks is one loop node over one leaf: O(1) memory. Building
// normalises: zero-sized parts vanish, a loop of touching leaves becomes one
// leaf, a loop whose body is a loop that tiles it becomes one loop, adjacent
// list leaves merge and a list of equally spaced equal leaves becomes a loop.

type opcode uint8

const (
	opLeaf opcode = iota
	opLoop
	opList
)

type entry struct {
	disp int64
	len  int64 // packed bytes of the entry
	nd   *node // nil: a leaf of len bytes at disp
}

type node struct {
	op     opcode
	off    int64
	length int64    // leaf
	n      int64    // loop
	stride int64    // loop
	child  *node    // loop
	ents   []entry  // list, unless uniform
	prefix []int64  // list, unless uniform: prefix[i] = packed bytes before entry i
	leafs  bool     // list: every entry is a leaf
	ulen   int64    // uniform list: every entry is a leaf of ulen bytes, at disps
	disps  []int64  // uniform list, unless delta-coded
	deltas []uint16 // delta-coded uniform list: deltas[i] = disp_i - disp_(i-1), deltas[0] = 0
	marks  []int64  // delta-coded uniform list: marks[k] = disp_(k*markEvery)
	size   int64    // packed bytes
	lo, hi int64    // data bounds: true lb and true ub relative to the origin
	segs   int64    // number of leaf pieces before merging (statistics hint)
}

func leafNode(off, length int64, a *arith) *node {
	if length == 0 {
		return nil
	}
	return &node{op: opLeaf, off: off, length: length, size: length, lo: off,
		hi: a.add(off, length, "leaf bounds"), segs: 1}
}

// shift returns nd moved by d bytes.
func shift(nd *node, d int64, a *arith) *node {
	if nd == nil || d == 0 {
		return nd
	}
	c := *nd
	c.off = a.add(c.off, d, "displacement")
	c.lo = a.add(c.lo, d, "displacement")
	c.hi = a.add(c.hi, d, "displacement")
	return &c
}

// repeat returns n copies of nd, the i-th shifted by i*stride.
func repeat(nd *node, n, stride int64, a *arith) *node {
	if nd == nil || n == 0 {
		return nil
	}
	if n == 1 {
		return nd
	}
	span := a.mul(n-1, stride, "repeat span")
	size := a.mul(n, nd.size, "size")
	if nd.op == opLeaf && stride == nd.length {
		return leafNode(nd.off, size, a)
	}
	var tile arith // only a comparison: an overflow here just means "no fusion"
	if nd.op == opLoop && stride == tile.mul(nd.n, nd.stride, "") && !tile.bad {
		inner := shift(nd.child, 0, a)
		return loopNode(nd.off, a.mul(n, nd.n, "count"), nd.stride, inner, a)
	}
	r := &node{op: opLoop, n: n, stride: stride, child: nd, size: size,
		segs: a.mul(n, nd.segs, "segments")}
	r.lo, r.hi = nd.lo, nd.hi
	if span < 0 {
		r.lo = a.add(nd.lo, span, "bounds")
	} else {
		r.hi = a.add(nd.hi, span, "bounds")
	}
	return r
}

func loopNode(off, n, stride int64, child *node, a *arith) *node {
	return shift(repeat(child, n, stride, a), off, a)
}

// listNode builds an irregular list from entries (disp, node); nil nodes are
// dropped. Leaf entries are given as nodes of op leaf and stored inline.
func listNode(parts []entry, a *arith) *node {
	ents := make([]entry, 0, len(parts))
	for _, p := range parts {
		nd := p.nd
		if nd == nil || nd.size == 0 {
			continue
		}
		if nd.op == opLeaf {
			ents = append(ents, entry{disp: a.add(p.disp, nd.off, "displacement"), len: nd.length})
			continue
		}
		ents = append(ents, entry{disp: p.disp, len: nd.size, nd: nd})
	}
	// Merge touching leaves, unless that turns equal-length leaves into
	// unequal ones: the copy kernels for equal small leaves are much faster
	// than one merge saves, and segment iteration merges touching pieces
	// anyway.
	if m := mergeLeaves(ents, a); len(m) < len(ents) && (!uniformLeaves(ents) || uniformLeaves(m)) {
		ents = m
	}
	switch len(ents) {
	case 0:
		return nil
	case 1:
		if ents[0].nd == nil {
			return leafNode(ents[0].disp, ents[0].len, a)
		}
		return shift(ents[0].nd, ents[0].disp, a)
	}
	// Equally spaced equal leaves: a loop.
	if regular(ents) {
		return loopNode(ents[0].disp, int64(len(ents)), ents[1].disp-ents[0].disp, leafNode(0, ents[0].len, a), a)
	}
	r := &node{op: opList, ents: ents, prefix: make([]int64, len(ents)+1), leafs: true}
	for i, e := range ents {
		lo, hi := e.disp, a.add(e.disp, e.len, "bounds")
		segs := int64(1)
		if e.nd != nil {
			r.leafs = false
			lo, hi = a.add(e.disp, e.nd.lo, "bounds"), a.add(e.disp, e.nd.hi, "bounds")
			segs = e.nd.segs
		}
		if i == 0 || lo < r.lo {
			r.lo = lo
		}
		if i == 0 || hi > r.hi {
			r.hi = hi
		}
		r.prefix[i+1] = a.add(r.prefix[i], e.len, "size")
		r.segs = a.add(r.segs, segs, "segments")
	}
	r.size = r.prefix[len(ents)]
	if uniformLeaves(ents) {
		// Compact form: 8 bytes of metadata per entry, no prefix sums; 2
		// bytes when the list ascends in steps below 64 KiB.
		r.ulen = ents[0].len
		r.ents, r.prefix = nil, nil
		if !deltaCode(r, ents) {
			r.disps = make([]int64, len(ents))
			for i, e := range ents {
				r.disps[i] = e.disp
			}
		}
	}
	return r
}

// markEvery is how many entries of a delta-coded list one mark covers: the
// most deltas a random access adds up.
const markEvery = 64

// deltaCode stores the displacements of uniform list r as 16-bit steps
// with a full displacement every markEvery entries, when every step fits.
// Dense index lists (atoms, mesh cells) are the common case; their
// displacements then cost a quarter of the memory traffic of 8-byte ones,
// which matters when a pack streams through a list of tens of thousands of
// small blocks.
func deltaCode(r *node, ents []entry) bool {
	for i := 1; i < len(ents); i++ {
		// Compared first, so that a difference beyond int64 cannot wrap.
		if d, p := ents[i].disp, ents[i-1].disp; d < p || uint64(d-p) > math.MaxUint16 {
			return false
		}
	}
	r.deltas = make([]uint16, len(ents))
	r.marks = make([]int64, (len(ents)+markEvery-1)/markEvery)
	for i, e := range ents {
		if i%markEvery == 0 {
			r.marks[i/markEvery] = e.disp
		}
		if i > 0 {
			r.deltas[i] = uint16(e.disp - ents[i-1].disp)
		}
	}
	return true
}

// entries returns the number of entries of a uniform list.
func (nd *node) entries() int {
	if nd.deltas != nil {
		return len(nd.deltas)
	}
	return len(nd.disps)
}

// disp returns the displacement of entry i of a uniform list.
func (nd *node) disp(i int) int64 {
	if nd.deltas == nil {
		return nd.disps[i]
	}
	k := i / markEvery
	d := nd.marks[k]
	for _, s := range nd.deltas[k*markEvery+1 : i+1] {
		d += int64(s)
	}
	return d
}

// nextDisp returns the displacement of entry i of a uniform list given
// prev, that of entry i-1.
func (nd *node) nextDisp(i int, prev int64) int64 {
	if nd.deltas == nil {
		return nd.disps[i]
	}
	return prev + int64(nd.deltas[i])
}

func regular(ents []entry) bool {
	if ents[0].nd != nil {
		return false
	}
	var a arith // a delta that overflows just means "not regular"
	d := a.sub(ents[1].disp, ents[0].disp, "")
	for i := 1; i < len(ents); i++ {
		if ents[i].nd != nil || ents[i].len != ents[0].len || a.sub(ents[i].disp, ents[i-1].disp, "") != d {
			return false
		}
	}
	return !a.bad
}

// entryAt returns the index of the list entry holding packed byte p.
func (nd *node) entryAt(p int64) int {
	if nd.ulen > 0 {
		return int(p / nd.ulen)
	}
	return sort.Search(len(nd.ents), func(i int) bool { return nd.prefix[i+1] > p })
}

// start returns the packed offset of list entry i.
func (nd *node) start(i int) int64 {
	if nd.ulen > 0 {
		return int64(i) * nd.ulen
	}
	return nd.prefix[i]
}

func mergeLeaves(ents []entry, a *arith) []entry {
	out := make([]entry, 0, len(ents))
	for _, e := range ents {
		if k := len(out) - 1; k >= 0 && e.nd == nil && out[k].nd == nil && a.add(out[k].disp, out[k].len, "bounds") == e.disp {
			out[k].len = a.add(out[k].len, e.len, "size")
			continue
		}
		out = append(out, e)
	}
	return out
}

func uniformLeaves(ents []entry) bool {
	for _, e := range ents {
		if e.nd != nil || e.len != ents[0].len {
			return false
		}
	}
	return true
}
