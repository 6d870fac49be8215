// Grants: who may touch which ranges of a request, and their arguments.

package requests_test

import (
	"errors"
	"testing"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/requests"
)

// TestGrantArguments: Grant refuses request id 0, a missing initiator,
// bad range counts and empty or wrapping ranges, and past MaxGrants.
func TestGrantArguments(t *testing.T) {
	tbl := requests.New(requests.Options{MaxGrants: 2})
	ok := []requests.Range{{Addr: 0x1000, Len: 16}}
	many := make([]requests.Range, requests.MaxGrantRanges+1)
	for i := range many {
		many[i] = requests.Range{Addr: uint64(i+1) << 12, Len: 16}
	}
	for _, c := range []struct {
		name   string
		who    string
		rid    uint64
		ranges []requests.Range
	}{
		{"request id 0", "p:1", 0, ok},
		{"no initiator", "", 1, ok},
		{"no ranges", "p:1", 1, nil},
		{"too many ranges", "p:1", 1, many},
		{"empty range", "p:1", 1, []requests.Range{{Addr: 0x1000}}},
		{"wrapping range", "p:1", 1, []requests.Range{{Addr: 1<<64 - 8, Len: 16}}},
	} {
		if g, err := tbl.Grant(c.who, c.rid, c.ranges); !errors.Is(err, memory.ErrInvalidArg) {
			t.Errorf("%s: %+v, %v; want ErrInvalidArg", c.name, g, err)
		}
	}
	if _, err := tbl.Grant("p:1", 1, many[:requests.MaxGrantRanges]); err != nil {
		t.Fatalf("grant of MaxGrantRanges ranges: %v", err)
	}
	if _, err := tbl.Grant("p:1", 1, []requests.Range{{Addr: 1<<64 - 17, Len: 16}}); err != nil {
		t.Fatalf("grant of a range ending at the last address: %v", err)
	}
	if _, err := tbl.Grant("p:1", 2, ok); !errors.Is(err, requests.ErrFull) {
		t.Fatalf("grant past MaxGrants: %v, want ErrFull", err)
	}
	if s := tbl.Stats(); s.Grants != 2 {
		t.Fatalf("stats %+v, want 2 grants", s)
	}
	if _, err := tbl.Revoke(12345); !errors.Is(err, requests.ErrUnknownGrant) {
		t.Fatalf("Revoke of an unknown id: %v", err)
	}
}

// TestGrants: from a request's first grant on, every access needs a live
// grant of its initiator covering it, at the grant's generation.
func TestGrants(t *testing.T) {
	reg, r := testRegion(t, 4096)
	tbl := requests.New(requests.Options{})
	const rid = 11
	a, b := "10.0.0.1:1", "10.0.0.2:2"

	// Without grants the range is open to every peer.
	admit(t, tbl, acc(r, b, rid, 0, 0, 3000, 8), r)

	ranges := []requests.Range{{Addr: r.Addr, Len: 1024}, {Addr: r.Addr + 2048, Len: 1024}}
	ga, err := tbl.Grant(a, rid, ranges)
	if err != nil {
		t.Fatal(err)
	}
	ranges[0].Len = 4096 // the grant keeps its own copy
	if ga.ID == 0 || ga.Initiator != a || ga.RequestID != rid || ga.Generation != 0 || len(ga.Ranges) != 2 || ga.Ranges[0].Len != 1024 {
		t.Fatalf("grant %+v", ga)
	}
	gb, err := tbl.Grant(b, rid, []requests.Range{{Addr: r.Addr + 1024, Len: 1024}})
	if err != nil {
		t.Fatal(err)
	}
	gOther, err := tbl.Grant(a, rid+1, []requests.Range{{Addr: r.Addr, Len: 4096}})
	if err != nil {
		t.Fatal(err)
	}
	if s := tbl.Stats(); s.Grants != 3 {
		t.Fatalf("stats %+v, want 3 grants", s)
	}

	t.Run("inside", func(t *testing.T) {
		for _, c := range []struct {
			grant   uint64
			off, n  uint64
			comment string
		}{
			{0, 0, 1024, "first range whole, any grant"},
			{ga.ID, 0, 1024, "first range whole, its grant named"},
			{0, 1023, 1, "last byte of the first range"},
			{0, 2048, 1024, "second range whole"},
			{ga.ID, 3071, 1, "last byte of the second range"},
		} {
			g := admit(t, tbl, acc(r, a, rid, 0, c.grant, c.off, c.n), r)
			if err := g.Enter(); err != nil {
				t.Fatalf("%s: Enter: %v", c.comment, err)
			}
			g.Leave()
		}
		admit(t, tbl, acc(r, b, rid, 0, gb.ID, 1024, 1024), r)
	})
	t.Run("outside", func(t *testing.T) {
		for _, c := range []struct {
			who     string
			grant   uint64
			off, n  uint64
			comment string
		}{
			{a, 0, 1024, 1, "first byte past the first range"},
			{a, 0, 1000, 100, "straddles the end of the first range"},
			{a, 0, 0, 3072, "spans both ranges and the gap"},
			{a, 0, 3072, 1, "past the second range"},
			{a, 0, 1024, 1024, "b's range"},
			{b, 0, 0, 16, "a's range, by b"},
			{b, ga.ID, 0, 16, "a's range, by b naming a's grant"},
			{a, gb.ID, 0, 16, "a's range, naming b's grant"},
			{a, gb.ID, 1024, 16, "b's range, by a naming b's grant"},
			{a, gOther.ID, 0, 16, "a grant of another request id"},
			{a, 1 << 60, 0, 16, "a grant id never issued"},
			{"", 0, 0, 16, "no initiator"},
		} {
			admitRefused(t, tbl, acc(r, c.who, rid, 0, c.grant, c.off, c.n), r, requests.ErrNotGranted)
		}
	})
	t.Run("revoke waits for chunks", func(t *testing.T) {
		in := admit(t, tbl, acc(r, a, rid, 0, ga.ID, 0, 64), r)
		notYet := admit(t, tbl, acc(r, a, rid, 0, 0, 2048, 64), r)
		if err := in.Enter(); err != nil {
			t.Fatal(err)
		}
		wait, err := tbl.Revoke(ga.ID)
		if err != nil {
			t.Fatal(err)
		}
		if wait == nil || isClosed(wait) {
			t.Fatal("Revoke with a chunk in progress did not wait for it")
		}
		refused(t, "Enter under a revoked grant", notYet.Enter(), requests.ErrNotGranted)
		admitRefused(t, tbl, acc(r, a, rid, 0, 0, 0, 64), r, requests.ErrNotGranted)
		admitRefused(t, tbl, acc(r, a, rid, 0, ga.ID, 0, 64), r, requests.ErrNotGranted)
		in.Leave()
		closesSoon(t, "Revoke after the chunk left", wait)
		if _, err := tbl.Revoke(ga.ID); !errors.Is(err, requests.ErrUnknownGrant) {
			t.Fatalf("second Revoke: %v, want ErrUnknownGrant", err)
		}
		// b's grant is still live.
		admit(t, tbl, acc(r, b, rid, 0, 0, 1024, 64), r)
		if wait, err := tbl.Revoke(gb.ID); err != nil || wait != nil {
			t.Fatalf("Revoke with nothing in progress = chan %v, %v; want nil, nil", wait != nil, err)
		}
		// Every grant is gone, but the request id stays restricted: an
		// access without a grant is still refused.
		admitRefused(t, tbl, acc(r, b, rid, 0, 0, 1024, 64), r, requests.ErrNotGranted)
		if s := tbl.Stats(); s.Grants != 1 {
			t.Fatalf("stats %+v, want 1 grant (the other request's)", s)
		}
	})
	t.Run("abort revokes and a new grant carries the new generation", func(t *testing.T) {
		const rid = 21
		g0, err := tbl.Grant(a, rid, []requests.Range{{Addr: r.Addr, Len: 4096}})
		if err != nil {
			t.Fatal(err)
		}
		before := admit(t, tbl, acc(r, a, rid, 0, g0.ID, 0, 64), r)
		gen, _, err := tbl.Abort(rid, true)
		if err != nil || gen != 1 {
			t.Fatalf("Abort = %d, %v", gen, err)
		}
		refused(t, "Enter under a grant revoked by the abort", before.Enter(), requests.ErrAborted)
		if _, err := tbl.Revoke(g0.ID); !errors.Is(err, requests.ErrUnknownGrant) {
			t.Fatalf("Revoke of a grant the abort revoked: %v, want ErrUnknownGrant", err)
		}
		admitRefused(t, tbl, acc(r, a, rid, 1, 0, 0, 64), r, requests.ErrNotGranted)
		g1, err := tbl.Grant(a, rid, []requests.Range{{Addr: r.Addr, Len: 4096}})
		if err != nil || g1.Generation != 1 {
			t.Fatalf("grant after the abort: %+v, %v; want generation 1", g1, err)
		}
		g := admit(t, tbl, acc(r, a, rid, 1, g1.ID, 0, 64), r)
		if err := g.Enter(); err != nil {
			t.Fatal(err)
		}
		g.Leave()
		admitRefused(t, tbl, acc(r, a, rid, 0, g1.ID, 0, 64), r, requests.ErrAborted)
		admitRefused(t, tbl, acc(r, a, rid, 1, g0.ID, 0, 64), r, requests.ErrNotGranted)
	})
	requireUnpinned(t, reg, r)
}

// TestGrantResultIsACopy: the Grant value returned to the caller (the
// engine hands it on to the application) must not share memory with the
// table's live grant. Otherwise a caller that reuses or edits
// Grant.Ranges widens what the owner enforces, and races with Admit.
func TestGrantResultIsACopy(t *testing.T) {
	reg, r := testRegion(t, 4096)
	tbl := requests.New(requests.Options{})
	g, err := tbl.Grant("p:1", 40, []requests.Range{{Addr: r.Addr, Len: 64}})
	if err != nil {
		t.Fatal(err)
	}
	g.Ranges[0].Len = 4096 // the caller's copy, not the owner's grant
	admitRefused(t, tbl, acc(r, "p:1", 40, 0, 0, 64, 64), r, requests.ErrNotGranted)
	requireUnpinned(t, reg, r)
}
