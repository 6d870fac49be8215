// Tombstones: how they age out, and what the cap forgets first.

package requests_test

import (
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/requests"
)

// TestSweepTombstones: Sweep forgets an acknowledged tombstone once it is
// older than the TTL, and keeps one not acknowledged (or renewed by a later
// abort, or with a chunk in progress).
func TestSweepTombstones(t *testing.T) {
	reg, r := testRegion(t, 4096)
	const ttl = time.Minute
	tbl := requests.New(requests.Options{TombstoneTTL: ttl})
	if _, _, err := tbl.Abort(31, true); err != nil { // no initiator named: may age out
		t.Fatal(err)
	}
	if _, _, err := tbl.Abort(32, false); err != nil { // waits for ACKs
		t.Fatal(err)
	}
	tbl.Sweep(time.Now().Add(ttl / 2))
	if s := tbl.Stats(); s.Tombstones != 2 || s.Evicted != 0 || tbl.Len() != 2 {
		t.Fatalf("young tombstones swept: %+v, Len %d", s, tbl.Len())
	}
	later := time.Now().Add(2 * ttl)
	tbl.Sweep(later)
	if tbl.Generation(31) != 0 {
		t.Fatal("acknowledged tombstone older than the TTL was kept")
	}
	if tbl.Generation(32) != 1 {
		t.Fatal("tombstone not acknowledged was forgotten")
	}
	if s := tbl.Stats(); s.Tombstones != 1 || s.Evicted != 1 || s.ForcedEvictions != 0 || tbl.Len() != 1 {
		t.Fatalf("after the first sweep: %+v, Len %d", s, tbl.Len())
	}
	// An acknowledgement of another generation changes nothing.
	tbl.Acked(32, 0)
	tbl.Acked(32, 2)
	tbl.Sweep(later)
	if tbl.Generation(32) != 1 {
		t.Fatal("an ACK of the wrong generation let the tombstone age out")
	}
	tbl.Acked(32, 1)
	tbl.Sweep(later)
	if tbl.Generation(32) != 0 || tbl.Len() != 0 {
		t.Fatalf("acknowledged tombstone kept: generation %d, Len %d", tbl.Generation(32), tbl.Len())
	}

	t.Run("renewed by a later abort", func(t *testing.T) {
		const rid = 34
		if _, _, err := tbl.Abort(rid, true); err != nil {
			t.Fatal(err)
		}
		if _, _, err := tbl.Abort(rid, false); err != nil {
			t.Fatal(err)
		}
		tbl.Sweep(time.Now().Add(2 * ttl))
		if tbl.Generation(rid) != 2 {
			t.Fatal("the first abort's queue entry evicted the tombstone of the second, not acknowledged")
		}
		tbl.Acked(rid, 2)
		tbl.Sweep(time.Now().Add(2 * ttl))
		if tbl.Generation(rid) != 0 {
			t.Fatal("acknowledged renewed tombstone kept")
		}
	})
	t.Run("chunk in progress", func(t *testing.T) {
		const rid = 35
		if _, _, err := tbl.Abort(rid, true); err != nil {
			t.Fatal(err)
		}
		g := admit(t, tbl, acc(r, "p:1", rid, 1, 0, 0, 64), r)
		must(t, g.Enter())
		tbl.Sweep(time.Now().Add(2 * ttl))
		if tbl.Generation(rid) != 1 {
			t.Fatal("tombstone swept with a chunk of it in progress")
		}
		g.Leave() // must find its state
		tbl.Sweep(time.Now().Add(2 * ttl))
		if tbl.Generation(rid) != 0 {
			t.Fatal("tombstone not swept once its chunk left")
		}
	})
	t.Run("revoked grants age out", func(t *testing.T) {
		const rid = 36
		g, err := tbl.Grant("p:1", rid, []requests.Range{{Addr: r.Addr, Len: 64}})
		if err != nil {
			t.Fatal(err)
		}
		tbl.Sweep(time.Now().Add(2 * ttl))
		if tbl.Len() != 1 {
			t.Fatal("a request id with a live grant was swept")
		}
		if _, err := tbl.Revoke(g.ID); err != nil {
			t.Fatal(err)
		}
		tbl.Sweep(time.Now().Add(ttl / 2))
		if tbl.Len() != 1 {
			t.Fatal("revoked request id swept before the TTL")
		}
		tbl.Sweep(time.Now().Add(2 * ttl))
		if tbl.Len() != 0 {
			t.Fatalf("Len = %d after the revoked request id aged out", tbl.Len())
		}
	})
	if s := tbl.Stats(); s.Tombstones != 0 || s.ForcedEvictions != 0 {
		t.Fatalf("final stats %+v", s)
	}
	requireUnpinned(t, reg, r)
}

// TestTombstoneCap: past MaxTombstones the table forgets tombstones down to
// 7/8 of the cap: acknowledged ones first (oldest first), then, counted as
// forced, the oldest not acknowledged; never one with a chunk in progress.
func TestTombstoneCap(t *testing.T) {
	reg, r := testRegion(t, 4096)
	const max = 8 // trimmed to 7 when exceeded
	t.Run("oldest unacknowledged are forced out", func(t *testing.T) {
		tbl := requests.New(requests.Options{MaxTombstones: max, TombstoneTTL: time.Hour})
		for rid := uint64(1); rid <= max+1; rid++ {
			if _, _, err := tbl.Abort(rid, false); err != nil {
				t.Fatal(err)
			}
			if s := tbl.Stats(); s.Tombstones > max {
				t.Fatalf("after %d aborts: %d tombstones, cap %d", rid, s.Tombstones, max)
			}
		}
		for rid := uint64(1); rid <= max+1; rid++ {
			if want := map[bool]uint32{true: 0, false: 1}[rid <= 2]; tbl.Generation(rid) != want {
				t.Errorf("request %d: generation %d, want %d (the oldest are forced out)", rid, tbl.Generation(rid), want)
			}
		}
		if s := tbl.Stats(); s.Tombstones != 7 || s.Evicted != 2 || s.ForcedEvictions != 2 || tbl.Len() != 7 {
			t.Fatalf("stats %+v, Len %d; want 7 tombstones, 2 evicted, 2 forced", s, tbl.Len())
		}
	})
	t.Run("acknowledged go first and are not counted as forced", func(t *testing.T) {
		tbl := requests.New(requests.Options{MaxTombstones: max, TombstoneTTL: time.Hour})
		for rid := uint64(1); rid <= max+1; rid++ {
			if _, _, err := tbl.Abort(rid, rid > 4); err != nil { // 1..4 not acknowledged
				t.Fatal(err)
			}
		}
		for rid := uint64(1); rid <= max+1; rid++ {
			if want := map[bool]uint32{true: 0, false: 1}[rid == 5 || rid == 6]; tbl.Generation(rid) != want {
				t.Errorf("request %d: generation %d, want %d (the oldest acknowledged go first)", rid, tbl.Generation(rid), want)
			}
		}
		if s := tbl.Stats(); s.Tombstones != 7 || s.Evicted != 2 || s.ForcedEvictions != 0 {
			t.Fatalf("stats %+v; want 7 tombstones, 2 evicted, 0 forced", s)
		}
	})
	t.Run("a tombstone with a chunk in progress stays", func(t *testing.T) {
		tbl := requests.New(requests.Options{MaxTombstones: max, TombstoneTTL: time.Hour})
		if _, _, err := tbl.Abort(100, false); err != nil {
			t.Fatal(err)
		}
		g := admit(t, tbl, acc(r, "p:1", 100, 1, 0, 0, 64), r)
		must(t, g.Enter())
		for rid := uint64(101); rid <= 100+max; rid++ {
			if _, _, err := tbl.Abort(rid, false); err != nil {
				t.Fatal(err)
			}
		}
		if tbl.Generation(100) != 1 {
			t.Fatal("the cap forced out a tombstone with a chunk in progress")
		}
		if tbl.Generation(101) != 0 || tbl.Generation(102) != 0 || tbl.Generation(103) != 1 {
			t.Fatal("the cap did not force out the oldest idle tombstones")
		}
		if s := tbl.Stats(); s.Tombstones != 7 {
			t.Fatalf("stats %+v, want 7 tombstones", s)
		}
		g.Leave()
	})
	requireUnpinned(t, reg, r)
}
