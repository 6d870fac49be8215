package rdma

import (
	"slices"
	"testing"
)

// The holder table is bounded without losing safety: past its bounds it
// names an initiator to cut (whose rkeys a cut voids), never silently
// drops an entry, and a refused access's entry is taken back only if the
// access made it.
func TestHoldersAreBoundedByCuttingNotByForgetting(t *testing.T) {
	h := newHolders()
	for rid := uint64(1); rid <= maxHoldsPerInitiator; rid++ {
		if added, evict := h.add("a:1", 1, rid, rid); !added || evict != "" {
			t.Fatalf("entry %d: added %v, evict %q", rid, added, evict)
		}
	}
	if added, evict := h.add("a:1", 1, 0, maxHoldsPerInitiator+1); !added || evict != "a:1" {
		t.Fatalf("past the per-initiator bound: added %v, evict %q; want a:1 cut", added, evict)
	}
	if !h.holds("a:1", 1) || !slices.Equal(h.of(7), []string{"a:1"}) {
		t.Fatal("an entry went missing before its initiator was cut")
	}
	h.forget("a:1")
	if h.count() != 0 || h.holds("a:1", 1) || len(h.of(7)) != 0 {
		t.Fatalf("after the cut %d entries remain", h.count())
	}

	if added, _ := h.add("b:1", 1, 1, 5); !added {
		t.Fatal("first entry of b not added")
	}
	if added, _ := h.add("b:1", 1, 2, 5); added {
		t.Fatal("a second request of the same path reports its hold new: a refusal would take back the first one's")
	}
	h.add("c:1", 1, 1, 5)
	h.remove("c:1", 1, 5)
	if got := h.of(5); !slices.Equal(got, []string{"b:1"}) {
		t.Fatalf("holders of 5: %v, want [b:1]", got)
	}
}

// A release drops a path's hold only up to the keys request it follows: a
// release that overtakes a later request of the same request id (they
// travel as separate control messages) leaves that request's hold, and a
// hold of another path of the same initiator stays.
func TestHoldersReleaseUndoesNoLaterRequest(t *testing.T) {
	h := newHolders()
	h.add("a:1", 1, 3, 9) // path 1, its 3rd keys request
	h.add("a:1", 2, 1, 9) // path 2
	h.add("a:1", 1, 5, 9) // path 1 asks again (after releasing at 4)
	h.release("a:1", 1, 4, []uint64{9})
	if !h.holds("a:1", 9) {
		t.Fatal("a release at 4 dropped path 1's hold from its request 5")
	}
	h.release("a:1", 1, 5, []uint64{9})
	if !h.holds("a:1", 9) {
		t.Fatal("path 1's release dropped path 2's hold")
	}
	h.dropConn("a:1", 2)
	if h.holds("a:1", 9) || h.count() != 0 || len(h.of(9)) != 0 {
		t.Fatalf("after both paths let go: holds %v, %d entries", h.holds("a:1", 9), h.count())
	}
}
