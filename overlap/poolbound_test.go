package overlap

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"
)

// A pool size beyond MaxPoolSlots (TROUPE_OVERLAP_SLOTS takes any count)
// is a configuration error: New allocated the pool's table first and
// panicked (makeslice: len out of range) or ran out of memory.
func TestPoolSlotsBounded(t *testing.T) {
	for _, n := range []int{MaxPoolSlots + 1, math.MaxInt} {
		c := DefaultConfig()
		c.PoolSlots = n
		require.ErrorIs(t, c.Validate(), ErrConfig, "PoolSlots %d", n)
		_, err := New(c)
		require.ErrorIs(t, err, ErrConfig, "PoolSlots %d", n)
	}
	c := DefaultConfig()
	c.PoolSlots = MaxPoolSlots
	require.NoError(t, c.Validate())
}
