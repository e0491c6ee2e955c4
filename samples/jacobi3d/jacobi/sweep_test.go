package jacobi

import (
	"fmt"
	"math"
	"math/rand/v2"
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
