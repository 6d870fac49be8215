package engine

import (
	"fmt"
	"testing"
	"time"
)

// allTombs returns every initiator tombstone held. Called with abortMu held.
func allTombs(e *Engine) []*tombstone {
	var out []*tombstone
	for _, q := range e.tombOwners.All() {
		for _, tb := range q.All() {
			out = append(out, tb)
		}
	}
	return out
}

// ownerTombCount returns how many tombstones of owner are held. Called
// with abortMu held.
func ownerTombCount(e *Engine, owner string) int {
	if q, ok := e.tombOwners.Get(owner); ok {
		return q.Len()
	}
	return 0
}

// newCacheEngine starts a tcp engine for the caches' tests.
func newCacheEngine(t *testing.T, opts Options) *Engine {
	t.Helper()
	opts.IgnoreEnv, opts.Protocol = true, "tcp"
	e, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close() })
	return e
}

// An initiator tombstone whose drain has not finished, or whose ACK is
// still owed, outlives its TTL, its owner's cap and a forced eviction: the
// owner may be waiting on it, and a submit would otherwise slip past the
// abort. Once settled it ages out like any other.
func TestUnsettledInitiatorTombstoneIsNeverEvicted(t *testing.T) {
	e := newCacheEngine(t, Options{MaxTombstones: 2, TombstoneTTL: time.Minute})
	const owner = "10.0.0.1:1"
	e.abortMu.Lock()
	for rid := uint64(1); rid <= 5; rid++ {
		tb := e.newTombLocked(tombKey{owner, rid})
		// Odd: draining, ACK owed; even: drained, ACK not yet sent.
		tb.minGen, tb.drained, tb.owed = 1, rid%2 == 0, true
	}
	e.abortMu.Unlock()
	later := time.Now().Add(time.Hour)
	e.sweepTombs(later)
	e.abortMu.Lock()
	q, _ := e.tombOwners.Get(owner)
	forced := q.Force(0)
	e.abortMu.Unlock()
	if forced != 0 {
		t.Errorf("a forced eviction took %d unsettled tombstones", forced)
	}
	e.abortMu.RLock()
	for rid := uint64(1); rid <= 5; rid++ {
		if !e.abortedLocked(owner, rid, 0) {
			t.Errorf("tombstone %d, not settled, was forgotten (cap 2, TTL passed, forced)", rid)
		}
	}
	e.abortMu.RUnlock()

	e.abortMu.Lock()
	for _, tb := range allTombs(e) {
		tb.drained, tb.owed = true, false
	}
	e.abortMu.Unlock()
	e.sweepTombs(later)
	e.abortMu.RLock()
	tombs, owners := e.tombCounts()
	e.abortMu.RUnlock()
	if tombs != 0 || owners != 0 {
		t.Errorf("once settled and past the TTL, %d tombstones of %d owners are left; want none", tombs, owners)
	}
	if s := e.Stats(); s.InitiatorTombstones != 0 || s.TombstoneOwners != 0 {
		t.Errorf("stats: %d tombstones, %d owners; want 0 and 0", s.InitiatorTombstones, s.TombstoneOwners)
	}
}

// An owner whose tombstones are not all settled is never forgotten to make
// room for a new owner: the new one is refused instead, and is recorded
// once an owner's tombstones settled, which is then forgotten and counted.
func TestOwnerWithAnUnsettledTombstoneIsNeverForgotten(t *testing.T) {
	e := newCacheEngine(t, Options{})
	e.abortMu.Lock()
	defer e.abortMu.Unlock()
	e.setMaxTombOwners(2)
	a := e.newTombLocked(tombKey{"10.0.0.1:1", 1})
	a.minGen, a.owed = 1, true
	b := e.newTombLocked(tombKey{"10.0.0.2:1", 1})
	b.minGen, b.drained = 1, true
	settledA := e.newTombLocked(tombKey{"10.0.0.1:1", 2}) // a's other tombstone is settled, a is not
	settledA.minGen, settledA.drained = 1, true
	b.owed = true // b is not settled either
	if tb := e.newTombLocked(tombKey{"10.0.0.3:1", 1}); tb != nil {
		t.Fatal("a new owner was recorded over the cap while every owner held an unsettled tombstone")
	}
	if e.tombOf(tombKey{"10.0.0.1:1", 1}) == nil || e.tombOf(tombKey{"10.0.0.2:1", 1}) == nil {
		t.Fatal("an owner with an unsettled tombstone was forgotten")
	}
	b.owed = false
	if tb := e.newTombLocked(tombKey{"10.0.0.3:1", 1}); tb == nil {
		t.Fatal("no room for a new owner once an owner's tombstones were all settled")
	}
	if e.tombOf(tombKey{"10.0.0.2:1", 1}) != nil || e.tombOf(tombKey{"10.0.0.1:1", 1}) == nil {
		t.Error("making room forgot the wrong owner")
	}
	if n := e.stats.tombOwnersForgotten.Load(); n != 1 {
		t.Errorf("TombstoneOwnersForgotten = %d; want 1", n)
	}
}

// A fence debt (an abort whose rdma fence cut an initiator that has not
// acknowledged it) is never evicted, whatever the pressure: a full set
// refuses the next debt, and only the initiator's ACK settles one.
func TestFenceDebtIsNeverEvicted(t *testing.T) {
	debts := newFenceDebts(2)
	a, b := fenceDebt{"10.0.0.1:1", abortKey{1, 1}}, fenceDebt{"10.0.0.2:1", abortKey{2, 1}}
	debts.Put(a, struct{}{})
	debts.Put(b, struct{}{})
	if debts.Put(fenceDebt{"10.0.0.3:1", abortKey{3, 1}}, struct{}{}) {
		t.Error("a full set of fence debts took a new one")
	}
	if n := debts.Force(0) + debts.Trim(0, nil) + debts.Expire(time.Now().Add(24*time.Hour)); n != 0 {
		t.Errorf("%d fence debts evicted by force, trim or age", n)
	}
	if !debts.Has(a) || !debts.Has(b) {
		t.Error("a fence debt went missing")
	}

	e := newCacheEngine(t, Options{})
	if err := e.noteFence("10.0.0.1:1", abortKey{1, 1}); err != nil {
		t.Fatal(err)
	}
	if err := e.noteFence("10.0.0.1:1", abortKey{1, 1}); err != nil || e.Stats().RDMAFencesPending != 1 {
		t.Fatalf("a debt noted twice: err %v, %d pending; want nil and 1", err, e.Stats().RDMAFencesPending)
	}
	if err := e.admitInitiator("10.0.0.2:1"); err != nil {
		t.Errorf("an initiator that owes nothing was refused: %v", err)
	}
	if err := e.admitInitiator("10.0.0.1:1"); err == nil {
		t.Error("an initiator owing an ACK connected new QPs")
	}
	e.ackedFence("10.0.0.1:1", abortKey{1, 1})
	if err := e.admitInitiator("10.0.0.1:1"); err != nil || e.Stats().RDMAFencesPending != 0 {
		t.Errorf("after the ACK: %v, %d pending; want nil and 0", err, e.Stats().RDMAFencesPending)
	}

	// Two debts of one initiator: it stays refused until both are
	// acknowledged, and an ACK repeated or for no debt settles nothing else.
	for _, k := range []abortKey{{5, 1}, {6, 1}} {
		if err := e.noteFence("10.0.0.1:1", k); err != nil {
			t.Fatal(err)
		}
	}
	e.ackedFence("10.0.0.1:1", abortKey{5, 1})
	e.ackedFence("10.0.0.1:1", abortKey{5, 1})
	e.ackedFence("10.0.0.1:1", abortKey{7, 1})
	if err := e.admitInitiator("10.0.0.1:1"); err == nil {
		t.Error("an initiator that still owes one of two ACKs connected new QPs")
	}
	e.ackedFence("10.0.0.1:1", abortKey{6, 1})
	if err := e.admitInitiator("10.0.0.1:1"); err != nil || len(e.fenceOwed) != 0 {
		t.Errorf("after both ACKs: %v, %d initiators owing; want nil and 0", err, len(e.fenceOwed))
	}
}

// Abort warns once per initiator that writes without request ids; past
// maxNoRIDWarned initiators the set starts afresh, so a warning may repeat
// but never goes missing.
func TestNoRIDWarningRepeatsOnlyAfterTheSetStartsAfresh(t *testing.T) {
	e := newCacheEngine(t, Options{})
	if !e.firstNoRIDWarning("10.0.0.1:1") || e.firstNoRIDWarning("10.0.0.1:1") {
		t.Fatal("want a first warning, then none")
	}
	for i := range maxNoRIDWarned {
		if !e.firstNoRIDWarning(fmt.Sprintf("10.1.%d.%d:1", i>>8, i&255)) {
			t.Fatal("a new initiator was taken for warned")
		}
	}
	if !e.firstNoRIDWarning("10.0.0.1:1") {
		t.Error("after the set started afresh the initiator was still taken for warned")
	}
}
