//go:build !purego

package jacobi

import "golang.org/x/sys/cpu"

// haveAVX2 says whether Sweep runs an assembly kernel (sweep_amd64.s), and
// haveAVX512 whether that is the AVX-512 one. All kernels give the same
// bits: each point's sum, product and change are the same separately
// rounded float64 operations, and the residual is a maximum, which does not
// depend on the order it is taken in.
var (
	haveAVX2   = cpu.X86.HasAVX2
	haveAVX512 = cpu.X86.HasAVX2 && cpu.X86.HasAVX512F
)

// sweepAsm sweeps part p (inside the interior, not empty) of block b with
// an assembly kernel, starting from residual r, when the CPU has one and u
// and v hold the block's padded storage, and reports whether it did.
func sweepAsm(b Block, u, v []float64, p Part, r float64) (float64, bool) {
	if n := b.Len(); !haveAVX2 || len(u) < n || len(v) < n {
		return 0, false
	}
	at := b.Idx(p.Lo[0], p.Lo[1], p.Lo[2])
	nx, ny, nz := p.Hi[0]-p.Lo[0], p.Hi[1]-p.Lo[1], p.Hi[2]-p.Lo[2]
	if haveAVX512 {
		return sweepAVX512(&v[at], &u[at], nx, ny, nz, b.SX, b.SXY, r, C7), true
	}
	return sweepAVX2(&v[at], &u[at], nx, ny, nz, b.SX, b.SXY, r, C7), true
}

// sweepAVX2 sweeps the nz planes of ny rows of nx points of a box whose
// first point is *u (read) and *v (written), with strides sx and sxy, and
// returns max(r, the largest |v - u|). The box lies in a block's interior,
// and every point it reads within one stride sxy of it, so the block's
// padded storage holds them all.
//
//go:noescape
func sweepAVX2(v, u *float64, nx, ny, nz, sx, sxy int, r, c7 float64) float64

// sweepAVX512 is sweepAVX2 eight points a step (AVX-512F).
//
//go:noescape
func sweepAVX512(v, u *float64, nx, ny, nz, sx, sxy int, r, c7 float64) float64
