package requests_test

// Tests that every kind of state the table keeps stays within its bound,
// whatever the application (or, through it, a peer) does many times over.

import (
	"errors"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/requests"
)

// requireBounded fails the test when the table keeps more request ids, or
// queues more, than max (the cap on remembered ids) plus extra (ids held by
// live grants or chunks in progress).
func requireBounded(t *testing.T, what string, tbl *requests.Table, max, extra int) {
	t.Helper()
	s := tbl.Stats()
	if n := tbl.Len(); n > max+extra {
		t.Fatalf("%s: the table keeps %d request ids, bound %d + %d (%+v)", what, n, max, extra, s)
	}
	if s.Queued > max+1 {
		t.Fatalf("%s: the age queue holds %d entries, bound %d + 1 (%+v)", what, s.Queued, max, s)
	}
}

// Grants revoked to the last leave their request id restricted (an access
// without a grant is still refused), so the table remembers it; those
// request ids count against MaxTombstones like tombstones. Outside the
// cap, 200,000 granted and revoked request ids would all be kept with a
// cap of 1,024, until the TTL.
func TestRevokedGrantsCountAgainstTheCap(t *testing.T) {
	const max, n = 1024, 200_000
	tbl := requests.New(requests.Options{MaxTombstones: max, TombstoneTTL: time.Hour})
	for rid := uint64(1); rid <= n; rid++ {
		g, err := tbl.Grant("10.0.0.1:1", rid, []requests.Range{{Addr: 4096, Len: 64}})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tbl.Revoke(g.ID); err != nil {
			t.Fatal(err)
		}
	}
	requireBounded(t, "after 200,000 grants revoked", tbl, max, 1)
	// The youngest are still remembered (restricted); the oldest went, as
	// acknowledged ones do at the cap, without counting as forced.
	if s := tbl.Stats(); s.Grants != 0 || s.Ranges != 0 || s.ForcedEvictions != 0 || s.Evicted < n-max-1 {
		t.Fatalf("stats %+v", s)
	}
}

// Aborting (or revoking the last grant of) one request id again and again
// renews its place in the age queue instead of adding an entry each time.
// An entry per abort would grow the queue without bound while the
// tombstone count stays at one and never triggers the cap.
func TestRepeatedAbortsAndRevokesOfOneRequestQueueItOnce(t *testing.T) {
	const max, n = 1024, 200_000
	tbl := requests.New(requests.Options{MaxTombstones: max, TombstoneTTL: time.Hour})
	for i := 0; i < n; i++ {
		if _, _, err := tbl.Abort(7, false); err != nil {
			t.Fatal(err)
		}
		g, err := tbl.Grant("10.0.0.1:1", 8, []requests.Range{{Addr: 4096, Len: 64}})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tbl.Revoke(g.ID); err != nil {
			t.Fatal(err)
		}
	}
	if s := tbl.Stats(); s.Queued != 2 || tbl.Len() != 2 || s.Tombstones != 1 {
		t.Fatalf("after %d aborts of one request id and %d revokes of another: %+v, Len %d; want 2 queued, Len 2, 1 tombstone",
			n, n, s, tbl.Len())
	}
	if tbl.Generation(7) != n {
		t.Fatalf("generation %d after %d aborts", tbl.Generation(7), n)
	}
	// Renewed, not stale: the request id ages from its last abort.
	tbl.Acked(7, n)
	tbl.Sweep(time.Now().Add(30 * time.Minute))
	if tbl.Generation(7) != n {
		t.Fatal("a renewed tombstone was swept before its TTL from the last abort")
	}
	tbl.Sweep(time.Now().Add(2 * time.Hour))
	if s := tbl.Stats(); tbl.Len() != 0 || s.Queued != 0 || s.Tombstones != 0 {
		t.Fatalf("after the TTL: %+v, Len %d; want nothing kept", s, tbl.Len())
	}
}

// Tombstones that got a new grant leave the age queue (they are bounded by
// MaxGrants) and stop counting against MaxTombstones. Counted while the
// trim cannot forget them, they would make every later abort force out the
// other tombstones, the one just made included: an abort not yet
// acknowledged would lose its refusal at once.
func TestGrantedTombstonesDoNotPushOutFreshAborts(t *testing.T) {
	const max, granted = 8, 16
	tbl := requests.New(requests.Options{MaxTombstones: max, MaxGrants: granted, TombstoneTTL: time.Hour})
	for rid := uint64(1); rid <= granted; rid++ {
		if _, _, err := tbl.Abort(rid, true); err != nil {
			t.Fatal(err)
		}
		if _, err := tbl.Grant("10.0.0.1:1", rid, []requests.Range{{Addr: 4096, Len: 64}}); err != nil {
			t.Fatal(err)
		}
	}
	for rid := uint64(100); rid < 100+max; rid++ {
		if _, _, err := tbl.Abort(rid, false); err != nil {
			t.Fatal(err)
		}
	}
	for rid := uint64(100); rid < 100+max; rid++ {
		if tbl.Generation(rid) != 1 {
			t.Errorf("request %d: its abort, not acknowledged and within the cap, was forgotten", rid)
		}
	}
	if s := tbl.Stats(); s.ForcedEvictions != 0 {
		t.Errorf("stats %+v: tombstones forced out below the cap", s)
	}
	// Past the grant cap nothing more is kept.
	for rid := uint64(1000); rid < 2000; rid++ {
		if _, _, err := tbl.Abort(rid, true); err != nil {
			t.Fatal(err)
		}
		if _, err := tbl.Grant("10.0.0.1:1", rid, []requests.Range{{Addr: 4096, Len: 64}}); err != nil && !errors.Is(err, requests.ErrFull) {
			t.Fatal(err)
		}
	}
	requireBounded(t, "after 1,000 more aborts and grants", tbl, max, granted+1)
}

// Every Abort and Revoke of a request id waiting for the same chunk shares
// one channel: an application aborting again and again while a chunk is
// stuck must not add a channel per call.
func TestRepeatedAbortsWhileAChunkIsInProgressShareOneChannel(t *testing.T) {
	reg, r := testRegion(t, 4096)
	tbl := requests.New(requests.Options{})
	const rid = 5
	g := admit(t, tbl, acc(r, "p:1", rid, 0, 0, 0, 64), r)
	must(t, g.Enter())
	chans := map[<-chan struct{}]bool{}
	for i := 0; i < 10_000; i++ {
		_, wait, err := tbl.Abort(rid, false)
		if err != nil {
			t.Fatal(err)
		}
		if wait == nil {
			t.Fatal("Abort with a chunk in progress did not wait for it")
		}
		chans[wait] = true
	}
	if len(chans) != 1 {
		t.Fatalf("10,000 aborts during one chunk made %d wait channels, want 1", len(chans))
	}
	g.Leave()
	for ch := range chans {
		closesSoon(t, "the shared channel once the chunk left", ch)
	}
	requireUnpinned(t, reg, r)
}

// The ranges of all live grants together are capped; revoking or aborting
// gives them back.
func TestGrantRangesAreCappedInAll(t *testing.T) {
	tbl := requests.New(requests.Options{MaxRanges: 100})
	ranges := make([]requests.Range, 60)
	for i := range ranges {
		ranges[i] = requests.Range{Addr: uint64(i+1) * 4096, Len: 64}
	}
	g1, err := tbl.Grant("10.0.0.1:1", 1, ranges)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tbl.Grant("10.0.0.1:1", 2, ranges); !errors.Is(err, requests.ErrFull) {
		t.Fatalf("a grant past the range cap: %v, want ErrFull", err)
	}
	if _, err := tbl.Revoke(g1.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := tbl.Grant("10.0.0.1:1", 2, ranges); err != nil {
		t.Fatalf("a grant after the revoke gave the ranges back: %v", err)
	}
	if _, _, err := tbl.Abort(2, false); err != nil {
		t.Fatal(err)
	}
	if s := tbl.Stats(); s.Ranges != 0 || s.Grants != 0 {
		t.Fatalf("stats %+v after the abort revoked the last grant, want no ranges", s)
	}
	if _, err := tbl.Grant("10.0.0.1:1", 3, ranges); err != nil {
		t.Fatalf("a grant after the abort gave the ranges back: %v", err)
	}
}

// A long random mix of aborts, acknowledgements, grants, revokes, chunks
// and sweeps over few and many request ids keeps every count within its
// bound at every step, and the counters agree with the states kept.
func TestRandomOperationsStayWithinTheBounds(t *testing.T) {
	reg, r := testRegion(t, 4096)
	const max, maxGrants = 64, 32
	tbl := requests.New(requests.Options{MaxTombstones: max, MaxGrants: maxGrants, TombstoneTTL: time.Hour})
	rng := rand.New(rand.NewPCG(1, 2))
	var live []requests.Grant
	type held struct {
		leave func()
	}
	var chunks []held
	n := 200_000
	if testing.Short() {
		n = 20_000
	}
	for i := 0; i < n; i++ {
		rid := uint64(rng.IntN(4096) + 1)
		if rng.IntN(4) == 0 {
			rid = uint64(rng.IntN(8) + 1) // a few request ids, over and over
		}
		switch op := rng.IntN(10); {
		case op < 3:
			if _, _, err := tbl.Abort(rid, rng.IntN(2) == 0); err != nil {
				t.Fatal(err)
			}
		case op < 4:
			tbl.Acked(rid, tbl.Generation(rid))
		case op < 6:
			g, err := tbl.Grant("p:1", rid, []requests.Range{{Addr: r.Addr, Len: 4096}})
			if err == nil {
				live = append(live, g)
			} else if !errors.Is(err, requests.ErrFull) {
				t.Fatal(err)
			}
		case op < 8 && len(live) > 0:
			k := rng.IntN(len(live))
			_, _ = tbl.Revoke(live[k].ID) // an abort may have revoked it already
			live = append(live[:k], live[k+1:]...)
		case op < 9 && len(chunks) < 4:
			if g, err := tbl.Admit(acc(r, "p:1", rid, tbl.Generation(rid), 0, 0, 64), r); err == nil && g.Enter() == nil {
				chunks = append(chunks, held{g.Leave})
			}
		case op < 9 && len(chunks) > 0:
			chunks[0].leave()
			chunks = chunks[1:]
		default:
			tbl.Sweep(time.Now().Add(time.Duration(rng.IntN(3)) * time.Hour))
		}
		if i%97 == 0 {
			requireBounded(t, "random operations", tbl, max, maxGrants+len(chunks)+1)
		}
	}
	for _, c := range chunks {
		c.leave()
	}
	tbl.Sweep(time.Now().Add(2 * time.Hour))
	requireBounded(t, "after the last sweep", tbl, max, maxGrants+1)
	requireUnpinned(t, reg, r)
}
