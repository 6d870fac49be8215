package requests_test

import (
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/requests"
)

// A request aborted again goes to the young end of the age queue; the cap
// then forces out the oldest of the others, never it, and never more than
// the trim mark asks: a re-abort must not make an older tombstone, still
// not acknowledged, go before its turn, nor spare one whose turn came.
func TestReabortedTombstoneIsYoungestAndTheCapForcesOutTheOldestOthers(t *testing.T) {
	const max = 8 // trimmed to 7 when exceeded
	tbl := requests.New(requests.Options{MaxTombstones: max, TombstoneTTL: time.Hour})
	for rid := uint64(1); rid <= max; rid++ {
		if _, _, err := tbl.Abort(rid, false); err != nil {
			t.Fatal(err)
		}
	}
	if _, _, err := tbl.Abort(1, false); err != nil { // 1 is now the youngest, at generation 2
		t.Fatal(err)
	}
	if _, _, err := tbl.Abort(max+1, false); err != nil {
		t.Fatal(err)
	}
	// Queue before the cap: 2..8, 1, 9 (10 > 8): forced down to 7, the
	// oldest first: 2, 3 go.
	want := map[uint64]uint32{1: 2, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1, 7: 1, 8: 1, 9: 1}
	for rid, gen := range want {
		if got := tbl.Generation(rid); got != gen {
			t.Errorf("request %d: generation %d, want %d", rid, got, gen)
		}
	}
	if s := tbl.Stats(); s.Tombstones != 7 || s.Queued != 7 || s.ForcedEvictions != 2 || s.Evicted != 2 {
		t.Fatalf("stats %+v; want 7 tombstones queued, 2 forced out", s)
	}
}

// An acknowledged tombstone lives TombstoneTTL from its abort: a sweep
// before that keeps it, one once it is that old forgets it (the stamp is
// read from the wall clock, bracketed here, so the exact instant is left to
// the bounded set's own tests). A tombstone not acknowledged outlives any
// sweep.
func TestAcknowledgedTombstoneAgesOutAfterItsTTLAndNotBefore(t *testing.T) {
	const ttl = time.Minute
	tbl := requests.New(requests.Options{TombstoneTTL: ttl})
	before := time.Now()
	if _, _, err := tbl.Abort(1, true); err != nil {
		t.Fatal(err)
	}
	if _, _, err := tbl.Abort(2, false); err != nil {
		t.Fatal(err)
	}
	after := time.Now()
	tbl.Sweep(before.Add(ttl - time.Nanosecond)) // younger than the TTL whenever it was stamped
	if tbl.Generation(1) != 1 {
		t.Fatal("an acknowledged tombstone was swept before its TTL")
	}
	tbl.Sweep(after.Add(ttl)) // at least the TTL old
	if tbl.Generation(1) != 0 {
		t.Fatal("an acknowledged tombstone outlived its TTL")
	}
	tbl.Sweep(after.Add(1000 * ttl))
	if tbl.Generation(2) != 1 {
		t.Fatal("a tombstone not acknowledged aged out")
	}
	if s := tbl.Stats(); s.Tombstones != 1 || s.Evicted != 1 || s.ForcedEvictions != 0 {
		t.Fatalf("stats %+v", s)
	}
}
