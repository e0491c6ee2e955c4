//go:build !amd64 || purego

package jacobi

// haveAVX2 is false where there is no assembly kernel.
var haveAVX2 = false

func sweepAVX2(v, u *float64, nx, ny, nz, sx, sxy int, r, c7 float64) float64 {
	panic("jacobi: no AVX2 kernel in this build")
}
