package rdma

import (
	"testing"
	"time"
)

// A mark counts as uncertain through the last instant of its window: a
// mark exactly uncertainTTL old still counts, and the expiry a later mark
// runs does not forget it then; only past the window does it stop
// counting. Reporting it certain at that instant would let a drain promise
// "drained" for work whose bytes may still land, one tick early.
func TestRDMAUncertainMarkCountsAtTheLastInstantOfItsWindow(t *testing.T) {
	clock := time.Unix(1_000_000, 0)
	tr := &Transport{uncertain: newUncertainSet(func() time.Time { return clock })}
	const peer = "10.0.0.1:5000"
	tr.markUncertain(peer, 1)
	clock = clock.Add(uncertainTTL)
	if !tr.Uncertain(peer, 1) {
		t.Fatal("a mark exactly uncertainTTL old no longer counts as uncertain")
	}
	tr.markUncertain(peer, 2) // expires marks past their window, not mark 1
	if !tr.Uncertain(peer, 1) {
		t.Fatal("marking another request forgot a mark at the last instant of its window")
	}
	clock = clock.Add(time.Nanosecond)
	if tr.Uncertain(peer, 1) {
		t.Fatal("a mark still counts past its window")
	}
	if !tr.Uncertain(peer, 2) {
		t.Fatal("a fresh mark does not count")
	}
}
