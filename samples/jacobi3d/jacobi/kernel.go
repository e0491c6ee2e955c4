// Package jacobi is the Jacobi3D sample's engine: the 7-point stencil
// kernel, the block decomposition, the serial reference and the field hash
// of docs/jacobi3d.md, and Run, which solves the problem with an actor array
// of blocks on a troupe actor runtime.
//
// The problem (unknowns, boundary values, sweep, residual and field_hash) is
// the reference problem every Jacobi3D implementation of this project
// reproduces bit for bit; see docs/jacobi3d.md.
package jacobi

import (
	"fmt"
	"math"
)

// C7 is the float64 nearest 1/7 (0x3FC2492492492492), the stencil weight.
var C7 = math.Float64frombits(0x3FC2492492492492)

// HotValue is the fixed boundary value on the face x = -1; the five other
// boundary faces hold 0.
const HotValue = 1.0

// Directions of a block's six faces. A face's opposite is d ^ 1.
const (
	XLow = iota
	XHigh
	YLow
	YHigh
	ZLow
	ZHigh
	NumDirs
)

// Box is a block's part of the global grid: interior points
// [X0, X0+NX) x [Y0, Y0+NY) x [Z0, Z0+NZ).
type Box struct {
	X0, Y0, Z0 int
	NX, NY, NZ int
}

// Split returns where part p of n cells cut into parts parts starts and how
// many cells it has: part p gets [p*n/parts, (p+1)*n/parts).
func Split(n, parts, p int) (start, size int) {
	start = p * n / parts
	return start, (p+1)*n/parts - start
}

// BlockBox returns the box of block (bx, by, bz) when an nx x ny x nz grid is
// cut into blocks[0] x blocks[1] x blocks[2] blocks.
func BlockBox(nx, ny, nz int, blocks [3]int, bx, by, bz int) Box {
	var b Box
	b.X0, b.NX = Split(nx, blocks[0], bx)
	b.Y0, b.NY = Split(ny, blocks[1], by)
	b.Z0, b.NZ = Split(nz, blocks[2], bz)
	return b
}

// Block is a sub-grid with one ghost layer on every side. Point (i, j, k) of
// the box (0 <= i < NX, ...) is stored at Idx(i, j, k); ghosts are at i = -1
// and i = NX (and likewise in y and z). Edges and corners of the ghost layer
// are never read.
type Block struct {
	Box
	SX, SXY int // strides of j and k in the padded array
}

// NewBlock describes the padded storage of box b.
func NewBlock(b Box) Block {
	sx := b.NX + 2
	return Block{Box: b, SX: sx, SXY: sx * (b.NY + 2)}
}

// Len is the number of float64s of the padded storage.
func (b Block) Len() int { return b.SXY * (b.NZ + 2) }

// Idx is the storage index of box point (i, j, k); -1 and N address ghosts.
func (b Block) Idx(i, j, k int) int { return (i + 1) + b.SX*(j+1) + b.SXY*(k+1) }

// Sweep computes one Jacobi sweep of the block: it reads u (interior and
// ghosts) and writes the new interior into v, and returns the block's
// residual max |v - u| over the interior. The arithmetic per point is the
// reference's: s = u[c]; s += x-1; s += x+1; s += y-1; s += y+1; s += z-1;
// s += z+1; v = s*C7, each a separately rounded float64 operation.
//
// On amd64 with AVX2 the sweep runs four points at a time in assembly
// (sweep_amd64.s), with the same bits as the Go loop; build with the tag
// purego, or set haveAVX2 to false in a test, for the Go loop alone.
func (b Block) Sweep(u, v []float64) float64 {
	return b.SweepPart(u, v, b.Whole(), 0)
}

// Part is the points Lo <= (i, j, k) < Hi of a block's interior, in box
// coordinates.
type Part struct {
	Lo, Hi [3]int
}

// Whole is the part that is the block's whole interior.
func (b Block) Whole() Part { return Part{Hi: [3]int{b.NX, b.NY, b.NZ}} }

// empty says whether p holds no point.
func (p Part) empty() bool { return p.Lo[0] >= p.Hi[0] || p.Lo[1] >= p.Hi[1] || p.Lo[2] >= p.Hi[2] }

// SweepPart is Sweep restricted to part p: it writes the new values of p's
// points into v and returns max(r, their largest |v - u|). Parts that tile
// the interior, swept one after another with r passed on, give exactly
// Sweep's field and residual (a point's arithmetic does not depend on its
// part, and the residual is a maximum). A part reaching outside the
// interior is clipped to it.
func (b Block) SweepPart(u, v []float64, p Part, r float64) float64 {
	n := [3]int{b.NX, b.NY, b.NZ}
	for d := range 3 {
		p.Lo[d], p.Hi[d] = max(p.Lo[d], 0), min(p.Hi[d], n[d])
	}
	if p.empty() {
		return r
	}
	if res, ok := sweepAsm(b, u, v, p, r); ok {
		return res
	}
	nx, ny := p.Hi[0]-p.Lo[0], p.Hi[1]-p.Lo[1]
	for k := p.Lo[2]; k < p.Hi[2]; k++ {
		r = sweepPlane(v, u, b.Idx(p.Lo[0], p.Lo[1], k), nx, ny, b.SX, b.SXY, r)
	}
	return r
}

// ShellDepthX is how many points deep Shell cuts the slab of an x face:
// one AVX2 vector, so that the slab and the rest of each row both run four
// points a step.
const ShellDepthX = 4

// Shell cuts the interior into the slabs next to the faces marked in faces
// (one plane deep for y and z faces, ShellDepthX points for x faces, less
// where the block is thinner) and the rest, core. Sweeping the shell first
// gives the faces a neighbour needs before the whole block is swept: the
// slabs hold every point of each marked face's plane. z slabs span the
// whole x-y extent, y slabs the whole x extent between the z slabs, x slabs
// what is left of their planes; together with core they tile the interior
// without overlap.
func (b Block) Shell(faces [NumDirs]bool) (shell []Part, core Part) {
	core = b.Whole()
	depth := [3]int{ShellDepthX, 1, 1}
	for _, dim := range []int{2, 1, 0} {
		for side := range 2 {
			if !faces[2*dim+side] {
				continue
			}
			slab := core
			lo, hi := core.Lo[dim], core.Hi[dim]
			if side == 0 {
				slab.Hi[dim] = min(lo+depth[dim], hi)
				core.Lo[dim] = slab.Hi[dim]
			} else {
				slab.Lo[dim] = max(hi-depth[dim], lo)
				core.Hi[dim] = slab.Lo[dim]
			}
			if !slab.empty() {
				shell = append(shell, slab)
			}
		}
	}
	return shell, core
}

// sweepPlane computes the ny rows of n points of one plane, the first
// starting at index row, into v from u, and returns max(r, the plane's
// largest |v - u|). It is a function of its own, with few arguments (all in
// registers), so that the compiler keeps the inner loop's eight row pointers
// and index in registers (inside Sweep's nested loops it kept the index on
// the stack, a store and a load on every point's critical path); a plane
// rather than a row per call, because a row of a 16^3 block is only 16
// points (BenchmarkSweep: 2.2 ns a point per row, 1.8 per plane).
//
//go:noinline
func sweepPlane(v, u []float64, row, n, ny, sx, sxy int, r float64) float64 {
	nr := -r
	for j := 0; j < ny; j, row = j+1, row+sx {
		// Rows of exactly n elements: every index below is then proven
		// in bounds and nothing is checked per point.
		out := v[row:][:n]
		c0, xm, xp := u[row:][:n], u[row-1:][:n], u[row+1:][:n]
		ym, yp := u[row-sx:][:n], u[row+sx:][:n]
		zm, zp := u[row-sxy:][:n], u[row+sxy:][:n]
		for i := 0; i < n; i++ {
			old := c0[i]
			s := old
			s += xm[i]
			s += xp[i]
			s += ym[i]
			s += yp[i]
			s += zm[i]
			s += zp[i]
			// The explicit conversion forbids fusing s*C7 - old into an
			// FMA on architectures that would (the Go spec allows it).
			nv := float64(s * C7)
			out[i] = nv
			// |d| > r as two comparisons with r and -r, both rarely
			// true, instead of math.Abs, which moves d through an
			// integer register (and -d, a sign flip per point).
			if d := nv - old; d > r || d < nr {
				r = max(d, -d)
				nr = -r
			}
		}
	}
	return r
}

// faceRange returns the index ranges, in box coordinates, of the interior
// plane next to face d (inner = true, what a neighbour needs) or of the ghost
// plane of face d (inner = false, where the neighbour's plane goes).
func (b Block) faceRange(d int, inner bool) (lo, hi [3]int) {
	hi = [3]int{b.NX, b.NY, b.NZ}
	n := hi[d/2]
	var at int
	switch {
	case d%2 == 0 && inner:
		at = 0
	case d%2 == 0:
		at = -1
	case inner:
		at = n - 1
	default:
		at = n
	}
	lo[d/2], hi[d/2] = at, at+1
	return lo, hi
}

// FaceLen is the number of points of face d.
func (b Block) FaceLen(d int) int {
	switch d / 2 {
	case 0:
		return b.NY * b.NZ
	case 1:
		return b.NX * b.NZ
	default:
		return b.NX * b.NY
	}
}

// PackFace copies the interior plane next to face d of u into a new slice,
// in (i fastest, then j, then k) order.
func (b Block) PackFace(u []float64, d int) []float64 {
	out := make([]float64, b.FaceLen(d))
	_ = b.PackFaceTo(out, u, d) // out has the face's length
	return out
}

// PackFaceTo is PackFace into dst, which must have FaceLen(d) points.
func (b Block) PackFaceTo(dst, u []float64, d int) error {
	if len(dst) != b.FaceLen(d) {
		return fmt.Errorf("jacobi: face %d buffer has %d points, want %d", d, len(dst), b.FaceLen(d))
	}
	lo, hi := b.faceRange(d, true)
	w := hi[0] - lo[0]
	p := 0
	for k := lo[2]; k < hi[2]; k++ {
		if w == 1 { // an x face: one point per row, no copy call each
			row := b.Idx(lo[0], lo[1], k)
			for j := lo[1]; j < hi[1]; j, row, p = j+1, row+b.SX, p+1 {
				dst[p] = u[row]
			}
			continue
		}
		for j := lo[1]; j < hi[1]; j++ {
			row := b.Idx(lo[0], j, k)
			copy(dst[p:p+w], u[row:row+w])
			p += w
		}
	}
	return nil
}

// UnpackFace copies a neighbour's plane (as PackFace made it) into the ghost
// plane of face d of u.
func (b Block) UnpackFace(u []float64, d int, face []float64) error {
	if len(face) != b.FaceLen(d) {
		return fmt.Errorf("jacobi: face %d has %d points, want %d", d, len(face), b.FaceLen(d))
	}
	lo, hi := b.faceRange(d, false)
	w := hi[0] - lo[0]
	p := 0
	for k := lo[2]; k < hi[2]; k++ {
		if w == 1 { // an x face: one point per row, no copy call each
			row := b.Idx(lo[0], lo[1], k)
			for j := lo[1]; j < hi[1]; j, row, p = j+1, row+b.SX, p+1 {
				u[row] = face[p]
			}
			continue
		}
		for j := lo[1]; j < hi[1]; j++ {
			row := b.Idx(lo[0], j, k)
			copy(u[row:row+w], face[p:p+w])
			p += w
		}
	}
	return nil
}

// FillGhost sets the ghost plane of face d to value v (a fixed boundary).
func (b Block) FillGhost(u []float64, d int, v float64) {
	lo, hi := b.faceRange(d, false)
	for k := lo[2]; k < hi[2]; k++ {
		for j := lo[1]; j < hi[1]; j++ {
			for i := lo[0]; i < hi[0]; i++ {
				u[b.Idx(i, j, k)] = v
			}
		}
	}
}

// Interior copies the block's interior out of u, i fastest.
func (b Block) Interior(u []float64) []float64 {
	out := make([]float64, 0, b.NX*b.NY*b.NZ)
	for k := 0; k < b.NZ; k++ {
		for j := 0; j < b.NY; j++ {
			row := b.Idx(0, j, k)
			out = append(out, u[row:row+b.NX]...)
		}
	}
	return out
}

// BoundaryValue is the fixed value of the global boundary face d.
func BoundaryValue(d int) float64 {
	if d == XLow {
		return HotValue
	}
	return 0
}

// mix64 is the SplitMix64 finalizer.
func mix64(z uint64) uint64 {
	z = (z ^ z>>30) * 0xBF58476D1CE4E5B9
	z = (z ^ z>>27) * 0x94D049BB133111EB
	return z ^ z>>31
}

// HashPartial is the block's share of H = sum over points of
// mix64(bits(u) + p*0x9E3779B97F4A7C15) mod 2^64, p = i + NX*(j + NY*k) in
// global coordinates of an nx x ny grid. Shares add (mod 2^64) to H.
func (b Block) HashPartial(u []float64, nx, ny int) uint64 {
	var h uint64
	for k := 0; k < b.NZ; k++ {
		for j := 0; j < b.NY; j++ {
			row := b.Idx(0, j, k)
			p := uint64(b.X0 + nx*((b.Y0+j)+ny*(b.Z0+k)))
			for i := 0; i < b.NX; i++ {
				h += mix64(math.Float64bits(u[row+i]) + (p+uint64(i))*0x9E3779B97F4A7C15)
			}
		}
	}
	return h
}

// FieldHash turns H (the sum of every block's HashPartial) into the printed
// field_hash, H >> 11.
func FieldHash(h uint64) uint64 { return h >> 11 }

// Serial is the serial reference: sweeps Jacobi sweeps of the nx x ny x nz
// problem from the initial state. It returns the interior field after the
// last sweep (i fastest, then j, then k) and that sweep's residual.
func Serial(nx, ny, nz, sweeps int) (field []float64, residual float64) {
	b := NewBlock(Box{NX: nx, NY: ny, NZ: nz})
	u := make([]float64, b.Len())
	v := make([]float64, b.Len())
	for d := 0; d < NumDirs; d++ {
		b.FillGhost(u, d, BoundaryValue(d))
		b.FillGhost(v, d, BoundaryValue(d))
	}
	for s := 0; s < sweeps; s++ {
		residual = b.Sweep(u, v)
		u, v = v, u
	}
	return b.Interior(u), residual
}

// HashField is field_hash of a whole interior field as Serial returns it
// (its index is p = i + NX*(j + NY*k)).
func HashField(field []float64) uint64 {
	var h uint64
	for p, x := range field {
		h += mix64(math.Float64bits(x) + uint64(p)*0x9E3779B97F4A7C15)
	}
	return FieldHash(h)
}

// plane is a face's plane of the padded array as a 2-D array: point (p1,
// p2) is at index base + p1*s1 + p2*s2, and at p1 + n1*p2 in the packed
// face (the order of PackFace).
type plane struct {
	base, s1, s2, n1, n2 int
}

// plane returns the interior plane next to face d (inner, what PackFaceTo
// reads) or the ghost plane of face d (what UnpackFace writes).
func (b Block) plane(d int, inner bool) plane {
	lo, _ := b.faceRange(d, inner)
	p := plane{base: b.Idx(lo[0], lo[1], lo[2])}
	switch d / 2 {
	case 0: // x fixed: j fastest, then k
		p.s1, p.n1, p.s2, p.n2 = b.SX, b.NY, b.SXY, b.NZ
	case 1: // y fixed: i, then k
		p.s1, p.n1, p.s2, p.n2 = 1, b.NX, b.SXY, b.NZ
	default: // z fixed: i, then j
		p.s1, p.n1, p.s2, p.n2 = 1, b.NX, b.SX, b.NY
	}
	return p
}
