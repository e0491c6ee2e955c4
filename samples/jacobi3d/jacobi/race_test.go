//go:build race

package jacobi

// raceEnabled: the race detector slows the kernel about tenfold, so the
// grid-96 reference check runs only without it.
const raceEnabled = true
