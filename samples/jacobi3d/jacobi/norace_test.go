//go:build !race

package jacobi

// raceEnabled: see race_test.go.
const raceEnabled = false
