package requests_test

import (
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/requests"
)

// An access admitted under a grant keeps its guard across chunks (tcp:
// one WRITE frame, copied chunk by chunk). Once the grant is revoked (by
// Revoke, or by an Abort, which revokes every grant of the request) the
// guard must refuse every later chunk, whatever happened to the request's
// state since: Revoke and Abort return as soon as no chunk is in progress,
// and the application reuses the range. When the cap forgets the request's
// state (revoked ones are forgotten first, as "acknowledged"; an abort
// naming no initiator is forced out after MaxTombstones/8 more), the guard
// finds no state, and check(nil, 0, grant) alone would let the chunk
// through: it ignores the revoked grant the guard itself holds.
func TestGuardUnderARevokedGrantStaysRefusedAfterTheCapForgetsTheRequest(t *testing.T) {
	const max = 8
	const init = "10.0.0.1:1"
	for _, how := range []string{"revoke", "abort naming no initiator"} {
		t.Run(how, func(t *testing.T) {
			reg, r := testRegion(t, 1<<16)
			tbl := requests.New(requests.Options{MaxTombstones: max, TombstoneTTL: time.Hour})
			const rid = 1
			g, err := tbl.Grant(init, rid, []requests.Range{{Addr: r.Addr, Len: 4096}})
			if err != nil {
				t.Fatal(err)
			}
			guard := admit(t, tbl, acc(r, init, rid, 0, g.ID, 0, 4096), r)
			if err := guard.Enter(); err != nil { // the first chunk
				t.Fatalf("first chunk: %v", err)
			}
			guard.Leave()
			switch how {
			case "revoke":
				if wait, err := tbl.Revoke(g.ID); err != nil || wait != nil {
					t.Fatalf("Revoke = %v, %v; want nothing to wait for", wait, err)
				}
			default:
				if _, wait, err := tbl.Abort(rid, false); err != nil || wait != nil {
					t.Fatalf("Abort = %v, %v; want nothing to wait for", wait, err)
				}
			}
			if err := guard.Enter(); err == nil { // refused while the state is remembered
				guard.Leave()
				t.Fatal("a chunk under the withdrawn grant was let through right after the withdrawal")
			}
			// Other requests go on as usual: each revoked (or aborted
			// naming no initiator), MaxTombstones of them.
			for other := uint64(100); other < 100+max+1; other++ {
				if how == "revoke" {
					og, err := tbl.Grant(init, other, []requests.Range{{Addr: r.Addr + 8192, Len: 4096}})
					if err != nil {
						t.Fatal(err)
					}
					if _, err := tbl.Revoke(og.ID); err != nil {
						t.Fatal(err)
					}
				} else if _, _, err := tbl.Abort(other, false); err != nil {
					t.Fatal(err)
				}
			}
			s := tbl.Stats()
			err = guard.Enter()
			if err == nil {
				guard.Leave()
				t.Fatalf("after %d more of %q (table %+v, request %d's generation now %d), the next chunk of the access admitted under grant %d, withdrawn by the %s, was let through: it lands in memory the application reused",
					max+1, how, s, rid, tbl.Generation(rid), g.ID, how)
			}
			requireUnpinned(t, reg, r)
		})
	}
}
