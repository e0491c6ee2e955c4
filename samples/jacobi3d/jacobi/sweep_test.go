package jacobi

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

// sweepGo runs Sweep with the Go loop alone.
func sweepGo(t testing.TB, b Block, u, v []float64) float64 {
	t.Helper()
	saved := haveAVX2
	haveAVX2 = false
	defer func() { haveAVX2 = saved }()
	return b.Sweep(u, v)
}

// TestSweepKernelsAgree sweeps blocks of every row length from 1 to 13
// (every remainder modulo 4, rows with and without a vector part) with the
// assembly kernel and with the Go loop, from the same random fields with
// infinities and NaNs here and there, and wants the same bits in every
// point of v (ghosts included: neither kernel may write them) and the same
// residual.
func TestSweepKernelsAgree(t *testing.T) {
	if !haveAVX2 {
		t.Skip("no AVX2 kernel on this machine or in this build (purego); Sweep runs the Go loop only")
	}
	rng := rand.New(rand.NewPCG(7, 11))
	for nx := 1; nx <= 13; nx++ {
		for _, dims := range [][2]int{{1, 1}, {3, 2}, {5, 4}} {
			b := NewBlock(Box{NX: nx, NY: dims[0], NZ: dims[1]})
			for trial := range 4 {
				u := make([]float64, b.Len())
				for i := range u {
					u[i] = rng.Float64()*2 - 1
					switch x := rng.IntN(200); {
					case trial > 1 && x == 0:
						u[i] = math.NaN()
					case trial > 1 && x == 1:
						u[i] = math.Inf(1 - 2*rng.IntN(2))
					}
				}
				vGo, vAsm := make([]float64, b.Len()), make([]float64, b.Len())
				for i := range vGo {
					vGo[i] = float64(-i)
					vAsm[i] = float64(-i)
				}
				rGo := sweepGo(t, b, u, vGo)
				rAsm := b.Sweep(u, vAsm)
				what := fmt.Sprintf("%dx%dx%d trial %d", nx, dims[0], dims[1], trial)
				if math.Float64bits(rGo) != math.Float64bits(rAsm) {
					t.Fatalf("%s: residual %v (Go) and %v (AVX2)", what, rGo, rAsm)
				}
				for i := range vGo {
					if math.Float64bits(vGo[i]) != math.Float64bits(vAsm[i]) {
						t.Fatalf("%s: point %d is %v (Go) and %v (AVX2)", what, i, vGo[i], vAsm[i])
					}
				}
			}
		}
	}
}

// TestSweepShortStorage checks that a field too short for the block is not
// handed to the assembly kernel: the Go loop's bounds checks stop it.
func TestSweepShortStorage(t *testing.T) {
	b := NewBlock(Box{NX: 4, NY: 4, NZ: 4})
	u, v := make([]float64, b.Len()-b.SXY), make([]float64, b.Len())
	defer func() {
		if recover() == nil {
			t.Fatal("Sweep read past a short field without a bounds failure")
		}
	}()
	b.Sweep(u, v)
}

// TestShellTiles cuts blocks of several shapes, with every set of early
// faces, into Shell's slabs and core, and checks that they cover each
// interior point exactly once, that the slabs hold every point of each
// marked face's plane, and that sweeping the slabs and then the core gives
// Sweep's field and residual bit for bit, with both kernels.
func TestShellTiles(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 5))
	for _, n := range [][3]int{{1, 1, 1}, {2, 3, 1}, {5, 4, 3}, {9, 6, 7}, {12, 2, 5}} {
		b := NewBlock(Box{NX: n[0], NY: n[1], NZ: n[2]})
		u := make([]float64, b.Len())
		for i := range u {
			u[i] = rng.Float64()
		}
		for mask := range 1 << NumDirs {
			var faces [NumDirs]bool
			for d := range faces {
				faces[d] = mask&(1<<d) != 0
			}
			shell, core := b.Shell(faces)
			what := fmt.Sprintf("%v faces %06b", n, mask)
			count := make([]int, b.Len())
			inShell := make([]bool, b.Len())
			for i, p := range append(slices.Clone(shell), core) {
				for k := p.Lo[2]; k < p.Hi[2]; k++ {
					for j := p.Lo[1]; j < p.Hi[1]; j++ {
						for x := p.Lo[0]; x < p.Hi[0]; x++ {
							if x < 0 || j < 0 || k < 0 || x >= n[0] || j >= n[1] || k >= n[2] {
								t.Fatalf("%s: part %v reaches outside the interior", what, p)
							}
							count[b.Idx(x, j, k)]++
							inShell[b.Idx(x, j, k)] = i < len(shell)
						}
					}
				}
			}
			for k := range n[2] {
				for j := range n[1] {
					for x := range n[0] {
						if c := count[b.Idx(x, j, k)]; c != 1 {
							t.Fatalf("%s: point (%d,%d,%d) is in %d parts", what, x, j, k, c)
						}
					}
				}
			}
			for d, on := range faces {
				if !on {
					continue
				}
				lo, hi := b.faceRange(d, true)
				for k := lo[2]; k < hi[2]; k++ {
					for j := lo[1]; j < hi[1]; j++ {
						for x := lo[0]; x < hi[0]; x++ {
							if !inShell[b.Idx(x, j, k)] {
								t.Fatalf("%s: point (%d,%d,%d) of face %d is not in the shell", what, x, j, k, d)
							}
						}
					}
				}
			}
			for _, asm := range []bool{false, true} {
				if asm && !haveAVX2 {
					continue
				}
				saved := haveAVX2
				haveAVX2 = asm
				want, got := make([]float64, b.Len()), make([]float64, b.Len())
				rWant := b.Sweep(u, want)
				r := 0.0
				for _, p := range append(slices.Clone(shell), core) {
					r = b.SweepPart(u, got, p, r)
				}
				haveAVX2 = saved
				if math.Float64bits(r) != math.Float64bits(rWant) || !slices.Equal(got, want) {
					t.Fatalf("%s (AVX2 %v): parts give residual %v, Sweep %v, or another field", what, asm, r, rWant)
				}
			}
		}
	}
}
