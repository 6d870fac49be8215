package engine

import "testing"

// Initiator tombstones are capped per owner, and a tombstone whose drain
// has not finished or whose ACK is still owed is never forgotten to make
// room: the owner may be waiting on it, and a submit of its request would
// otherwise slip past the abort. One owner's aborts never push out
// another owner's tombstones.
func TestInitiatorTombstonesAreCappedPerOwnerAndKeptWhileOwed(t *testing.T) {
	e, err := New(Options{IgnoreEnv: true, Protocol: "tcp", MaxTombstones: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close() })
	const a, b = "10.0.0.1:1", "10.0.0.2:1"
	add := func(owner string, rid uint64, drained, owed bool) {
		e.abortMu.Lock()
		tb := e.newTombLocked(tombKey{owner, rid})
		tb.minGen, tb.drained, tb.owed = 1, drained, owed
		e.abortMu.Unlock()
	}
	has := func(owner string, rid uint64) bool {
		e.abortMu.RLock()
		defer e.abortMu.RUnlock()
		return e.abortedLocked(owner, rid, 0)
	}
	add(b, 1, true, false)
	add(a, 1, false, true) // draining, ACK owed
	add(a, 2, true, true)  // drained, ACK not yet sent
	add(a, 3, true, false) // over the cap: nothing of a may go
	for rid := uint64(1); rid <= 3; rid++ {
		if !has(a, rid) {
			t.Errorf("owner a's tombstone %d was forgotten while its drain or ACK was pending", rid)
		}
	}
	e.abortMu.Lock()
	e.tombOf(tombKey{a, 1}).drained, e.tombOf(tombKey{a, 1}).owed = true, false
	e.abortMu.Unlock()
	add(a, 4, true, false) // now a's oldest settled one goes
	if has(a, 1) || !has(a, 4) {
		t.Errorf("past the cap owner a kept %v its oldest settled tombstone and has %v the new one", has(a, 1), has(a, 4))
	}
	if !has(b, 1) {
		t.Error("owner a's aborts pushed out owner b's tombstone")
	}
}
