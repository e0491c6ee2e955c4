//go:build !race

package integration

// raceEnabled: see race_test.go.
const raceEnabled = false
