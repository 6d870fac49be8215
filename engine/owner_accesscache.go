package engine

import (
	"hash/maphash"
	"sync/atomic"
)

// accessCacheSlots is the number of (initiator, request id) pairs an
// accessCache can hold: 128 KiB of slots.
const accessCacheSlots = 1 << 14

// accessCache remembers, approximately, which initiators this engine
// admitted for which request ids lately: one slot per hash of the pair, a
// later pair overwriting an earlier one of the same slot. It answers
// whether a peer could have been touching a request (see handleCanceled)
// and costs the data path one hash and, for a new pair, one store per
// admitted access. The hash is seeded per engine, so a peer cannot choose
// pairs that push out others. Its size is fixed, whatever peers do.
type accessCache struct {
	seed  maphash.Seed
	slots *[accessCacheSlots]atomic.Uint64
}

func newAccessCache() accessCache {
	return accessCache{seed: maphash.MakeSeed(), slots: new([accessCacheSlots]atomic.Uint64)}
}

// sum is the pair's hash: never 0, which marks an empty slot.
func (c *accessCache) sum(initiator string, rid uint64) uint64 {
	h := maphash.String(c.seed, initiator) ^ rid*0x9E3779B97F4A7C15
	// splitmix64's finalizer: every bit of both inputs reaches the slot
	// index.
	h ^= h >> 30
	h *= 0xBF58476D1CE4E5B9
	h ^= h >> 27
	h *= 0x94D049BB133111EB
	h ^= h >> 31
	return h | 1
}

// note records that initiator was admitted for rid.
func (c *accessCache) note(initiator string, rid uint64) {
	h := c.sum(initiator, rid)
	s := &c.slots[h%accessCacheSlots]
	if s.Load() != h {
		s.Store(h)
	}
}

// seen reports whether initiator was admitted for rid lately (false once
// as many other pairs came after it that one took its slot).
func (c *accessCache) seen(initiator string, rid uint64) bool {
	h := c.sum(initiator, rid)
	return c.slots[h%accessCacheSlots].Load() == h
}
