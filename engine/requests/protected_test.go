package requests_test

// The age queue evicts only what its policy lets go. These tests drive it
// hard at a small cap and check, after every step, the promises that make
// an abort safe: a request with a chunk in progress is never forgotten
// (Abort and Revoke wait on it), the request just aborted is never the one
// forgotten to make room for it, and a tombstone not acknowledged never
// ages out (only the cap forces it out, and counts it).

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/requests"
	"github.com/kvferry/kvferry/engine/transport"
)

// A random mix of aborts, acknowledgements, chunks and sweeps over few
// request ids presses a cap of 8 both ways (acknowledged evictions and
// forced ones); the checks run after every step.
func TestProtectedRequestsAreNeverForgottenAtTheCapOrBySweeps(t *testing.T) {
	const max = 8
	tbl := requests.New(requests.Options{MaxTombstones: max, TombstoneTTL: time.Hour})
	reg, r := testRegion(t, 4096)
	rng := rand.New(rand.NewPCG(5, 8))
	busy := map[uint64]transport.Guard{} // request ids with a chunk in progress
	acked := map[uint64]bool{}           // whether the last abort of each is acknowledged
	for i := 0; i < 20_000; i++ {
		rid := uint64(rng.IntN(48) + 1)
		switch op := rng.IntN(8); {
		case op < 3:
			ack := rng.IntN(3) == 0
			gen, _, err := tbl.Abort(rid, ack)
			if err != nil {
				t.Fatal(err)
			}
			acked[rid] = ack
			if got := tbl.Generation(rid); got != gen {
				t.Fatalf("step %d: request %d just aborted at generation %d reads %d: the cap forgot the abort it made room for", i, rid, gen, got)
			}
		case op < 4:
			tbl.Acked(rid, tbl.Generation(rid))
			acked[rid] = true
		case op < 5 && len(busy) < 6 && busy[rid] == nil:
			// A chunk of the request's current generation, entered
			// after an abort so that the request has state to lose.
			if _, _, err := tbl.Abort(rid, true); err != nil {
				t.Fatal(err)
			}
			acked[rid] = true
			g, err := tbl.Admit(acc(r, "p:1", rid, tbl.Generation(rid), 0, 0, 64), r)
			if err != nil {
				t.Fatal(err)
			}
			must(t, g.Enter())
			busy[rid] = g
		case op < 6:
			for id, g := range busy {
				g.Leave()
				delete(busy, id)
				break
			}
		case op < 7:
			// A sweep alone (no abort pressing on the cap) never forgets
			// a tombstone not acknowledged, however old.
			owed := map[uint64]uint32{}
			for id := uint64(1); id <= 48; id++ {
				if gen := tbl.Generation(id); gen != 0 && !acked[id] {
					owed[id] = gen
				}
			}
			before := tbl.Stats()
			tbl.Sweep(time.Now().Add(2 * time.Hour))
			for id, gen := range owed {
				if tbl.Generation(id) != gen {
					t.Fatalf("step %d: a sweep forgot request %d, whose abort is not acknowledged", i, id)
				}
			}
			if s := tbl.Stats(); s.ForcedEvictions != before.ForcedEvictions {
				t.Fatalf("step %d: a sweep forced %d evictions", i, s.ForcedEvictions-before.ForcedEvictions)
			}
		default:
			tbl.Sweep(time.Now().Add(time.Duration(rng.IntN(3)) * time.Hour))
		}
		for id := range busy {
			if tbl.Generation(id) == 0 {
				t.Fatalf("step %d: request %d with a chunk in progress was forgotten", i, id)
			}
		}
	}
	if s := tbl.Stats(); s.ForcedEvictions == 0 || s.Evicted == s.ForcedEvictions {
		t.Fatalf("stats %+v: the run never pressed the cap both ways", s)
	}
	for _, g := range busy {
		g.Leave()
	}
	requireUnpinned(t, reg, r)
}
