package jacobi

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"unsafe"
)

// kernels names the sweep kernels this CPU and build can run: the Go
// loop, and the assembly ones.
func kernels() []string {
	ks := []string{"go"}
	if haveAVX2 {
		ks = append(ks, "avx2")
	}
	if haveAVX512 {
		ks = append(ks, "avx512")
	}
	return ks
}

// withKernel runs f with Sweep using kernel k (one of kernels()).
func withKernel(k string, f func()) {
	saved2, saved512 := haveAVX2, haveAVX512
	defer func() { haveAVX2, haveAVX512 = saved2, saved512 }()
	haveAVX2 = saved2 && k != "go"
	haveAVX512 = saved512 && k == "avx512"
	f()
}

// sweepGo runs Sweep with the Go loop alone.
func sweepGo(t testing.TB, b Block, u, v []float64) (r float64) {
	t.Helper()
	withKernel("go", func() { r = b.Sweep(u, v) })
	return r
}

// TestSweepKernelsAgree sweeps blocks of every row length from 1 to 19
// (every remainder modulo 8, rows with and without a vector part) and of
// long rows (64 to 72 and 101 points, which the AVX-512 kernel starts on a
// 64-byte boundary), the long ones from every 8-byte offset of a cache
// line, with each assembly kernel and with the Go loop, from the same
// random fields with infinities and NaNs here and there, and wants the same
// bits in every point of v (ghosts included: no kernel may write them; a
// NaN may come out as another NaN, see sameOrNaN) and the same residual.
func TestSweepKernelsAgree(t *testing.T) {
	if !haveAVX2 {
		t.Skip("no assembly kernel on this machine or in this build (purego); Sweep runs the Go loop only")
	}
	for _, k := range kernels()[1:] {
		t.Run(k, func(t *testing.T) { withKernel(k, func() { sweepKernelAgrees(t, k) }) })
	}
}

// sweepKernelAgrees is TestSweepKernelsAgree for kernel k, the one Sweep
// runs.
func sweepKernelAgrees(t *testing.T, k string) {
	rng := rand.New(rand.NewPCG(7, 11))
	rows := []int{64, 65, 66, 67, 68, 69, 70, 71, 72, 101}
	for nx := 1; nx <= 19; nx++ {
		rows = append(rows, nx)
	}
	for _, nx := range rows {
		offsets := []int{0}
		if nx >= 64 {
			offsets = []int{0, 1, 2, 3, 4, 5, 6, 7}
		}
		for _, dims := range [][2]int{{1, 1}, {3, 2}, {5, 4}} {
			b := NewBlock(Box{NX: nx, NY: dims[0], NZ: dims[1]})
			for trial := range 4 {
				for _, off := range offsets {
					// The fields start off points past a 64-byte line.
					u := aligned64(b.Len(), off)
					for i := range u {
						u[i] = rng.Float64()*2 - 1
						switch x := rng.IntN(200); {
						case trial > 1 && x == 0:
							u[i] = math.NaN()
						case trial > 1 && x == 1:
							u[i] = math.Inf(1 - 2*rng.IntN(2))
						}
					}
					vGo, vAsm := make([]float64, b.Len()), aligned64(b.Len(), off)
					for i := range vGo {
						vGo[i] = float64(-i)
						vAsm[i] = float64(-i)
					}
					rAsm := b.Sweep(u, vAsm)
					rGo := sweepGo(t, b, u, vGo)
					what := fmt.Sprintf("%dx%dx%d trial %d offset %d", nx, dims[0], dims[1], trial, off)
					if math.Float64bits(rGo) != math.Float64bits(rAsm) {
						t.Fatalf("%s: residual %v (Go) and %v (%s)", what, rGo, rAsm, k)
					}
					for i := range vGo {
						if !sameOrNaN(vGo[i], vAsm[i]) {
							t.Fatalf("%s: point %d is %v (Go) and %v (%s)", what, i, vGo[i], vAsm[i], k)
						}
					}
				}
			}
		}
	}
}

// sameOrNaN reports whether a and b have the same bits, or are both NaN.
// Which NaN a sum of two NaNs gives (x86 keeps the first operand's) depends
// on the order the compiler puts an add's operands in, which it may choose
// for a commutative operation, and did differently under -race: NaNs are
// not part of the same-bits promise.
func sameOrNaN(a, b float64) bool {
	return math.Float64bits(a) == math.Float64bits(b) || math.IsNaN(a) && math.IsNaN(b)
}

// aligned64 returns n float64s starting off points past a 64-byte boundary.
func aligned64(n, off int) []float64 {
	buf := make([]float64, n+16)
	skip := int((64 - uintptr(unsafe.Pointer(&buf[0]))%64) % 64 / 8)
	return buf[skip+off:][:n]
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
			for _, k := range kernels() {
				want, got := make([]float64, b.Len()), make([]float64, b.Len())
				var r, rWant float64
				withKernel(k, func() {
					rWant = b.Sweep(u, want)
					for _, p := range append(slices.Clone(shell), core) {
						r = b.SweepPart(u, got, p, r)
					}
				})
				if math.Float64bits(r) != math.Float64bits(rWant) || !slices.Equal(got, want) {
					t.Fatalf("%s (kernel %s): parts give residual %v, Sweep %v, or another field", what, k, r, rWant)
				}
			}
		}
	}
}
