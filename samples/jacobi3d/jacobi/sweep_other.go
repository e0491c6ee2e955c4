//go:build !amd64 || purego

package jacobi

// haveAVX2 and haveAVX512 are false where there is no assembly kernel.
var haveAVX2, haveAVX512 = false, false

// sweepAsm reports that there is no assembly kernel: Sweep runs the Go loop.
func sweepAsm(b Block, u, v []float64, p Part, r float64) (float64, bool) { return 0, false }
