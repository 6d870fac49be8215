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
		if added, evict := h.add("a:1", rid); !added || evict != "" {
			t.Fatalf("entry %d: added %v, evict %q", rid, added, evict)
		}
	}
	if added, evict := h.add("a:1", maxHoldsPerInitiator+1); !added || evict != "a:1" {
		t.Fatalf("past the per-initiator bound: added %v, evict %q; want a:1 cut", added, evict)
	}
	if !h.holds("a:1", 1) || !slices.Equal(h.of(7), []string{"a:1"}) {
		t.Fatal("an entry went missing before its initiator was cut")
	}
	h.forget("a:1")
	if h.count() != 0 || h.holds("a:1", 1) || len(h.of(7)) != 0 {
		t.Fatalf("after the cut %d entries remain", h.count())
	}

	if added, _ := h.add("b:1", 5); !added {
		t.Fatal("first entry of b not added")
	}
	if added, _ := h.add("b:1", 5); added {
		t.Fatal("a second add of the same entry reports it new: a refusal would take back the first one's")
	}
	h.add("c:1", 5)
	h.remove("c:1", 5)
	if got := h.of(5); !slices.Equal(got, []string{"b:1"}) {
		t.Fatalf("holders of 5: %v, want [b:1]", got)
	}
}
