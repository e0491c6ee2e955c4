package overlap

// pool tracks which prefetch slots are in use. Slots are handed out lowest
// index first so that decisions are deterministic.
type pool struct {
	used      []bool
	inUse     int
	highWater int
}

func newPool(n int) pool { return pool{used: make([]bool, n)} }

// acquire returns a free slot, or NoSlot and false when all are in use.
func (p *pool) acquire() (int, bool) {
	for i, u := range p.used {
		if !u {
			p.used[i] = true
			p.inUse++
			if p.inUse > p.highWater {
				p.highWater = p.inUse
			}
			return i, true
		}
	}
	return NoSlot, false
}

// release frees slot; it reports false if the slot was not in use.
func (p *pool) release(slot int) bool {
	if slot < 0 || slot >= len(p.used) || !p.used[slot] {
		return false
	}
	p.used[slot] = false
	p.inUse--
	return true
}

func (p *pool) full() bool { return p.inUse == len(p.used) }
