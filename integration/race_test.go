//go:build race

package integration

// raceEnabled: the race detector makes the actor message path about six
// times slower and shadows every heap byte, so the flood sends fewer
// messages under it and does not judge RSS there (see TestActorFlood).
const raceEnabled = true
