package engine

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
)

// Initiator tombstones under churn: a random mix of new aborts (from owners
// known and not), re-aborts at a higher generation (the tombstone, and its
// owner, become the youngest), drains that settle, owed ACKs, and sweeps
// before and after the TTL, over more owners and request ids than the caps
// hold. After every step: a tombstone not settled is still there, the same
// one; the owners stay within their cap; and a new owner is refused only
// when every owner held holds a tombstone not settled (none could go).
func TestInitiatorTombstonesNeverForgetAnUnsettledOneUnderChurn(t *testing.T) {
	const maxOwners, ttl = 3, time.Minute
	e := newCacheEngine(t, Options{MaxTombstones: 4, TombstoneTTL: ttl})
	e.abortMu.Lock()
	defer e.abortMu.Unlock()
	e.setMaxTombOwners(maxOwners)
	rng := rand.New(rand.NewPCG(16, 4))
	unsettled := map[tombKey]*tombstone{} // what must survive
	refused := 0
	for step := 0; step < 20_000; step++ {
		k := tombKey{fmt.Sprintf("10.0.0.%d:1", rng.IntN(6)), uint64(rng.IntN(8) + 1)}
		switch op := rng.IntN(10); {
		case op < 5: // an ABORT, new or at a higher generation
			tb := e.tombOf(k)
			if tb == nil {
				if _, seen := e.tombOwners.Get(k.owner); !seen && e.tombOwners.Len() >= maxOwners {
					canGo := false
					for _, q := range e.tombOwners.All() {
						all := true
						for _, o := range q.All() {
							all = all && o.settled()
						}
						canGo = canGo || all
					}
					if tb = e.newTomb(k, rng.IntN(2) == 0); tb == nil {
						refused++
						if canGo {
							t.Fatalf("step %d: a new owner was refused though an owner with every tombstone settled could go", step)
						}
						continue
					}
				} else if tb = e.newTomb(k, rng.IntN(2) == 0); tb == nil {
					t.Fatalf("step %d: a tombstone of an owner held, or below the owners' cap, was refused", step)
				}
			} else {
				e.renewTomb(k, tb)
			}
			tb.minGen++
			tb.drained, tb.owed = false, rng.IntN(2) == 0
			unsettled[k] = tb
		case op < 8: // a drain ends, its ACK sent or (a third of the time) still owed
			if tb := unsettled[k]; tb != nil {
				tb.drained = true
				tb.owed = tb.owed && rng.IntN(3) == 0
				if !tb.owed {
					delete(unsettled, k)
				}
			}
		default: // the sweeper, before or after the TTL
			at := time.Now()
			if rng.IntN(2) == 0 {
				at = at.Add(2 * ttl)
			}
			e.abortMu.Unlock()
			e.sweepTombs(at)
			e.abortMu.Lock()
		}
		for k, tb := range unsettled {
			if got := e.tombOf(k); got != tb {
				t.Fatalf("step %d: tombstone %v, not settled, was forgotten or replaced", step, k)
			}
		}
		if n := e.tombOwners.Len(); n > maxOwners {
			t.Fatalf("step %d: %d owners held, cap %d", step, n, maxOwners)
		}
	}
	if refused == 0 {
		t.Error("the owners' cap was never pressed: the run proves little")
	}
}
