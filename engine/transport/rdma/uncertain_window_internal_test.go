package rdma

import (
	"testing"
	"time"
)

// A mark is protected for exactly its window. Past the cap the set makes
// room only from marks whose window passed, renewed marks count from their
// renewal, and when every mark is fresh the new one is not dropped
// silently: every request of every peer counts as uncertain instead.
func TestRDMAUncertainMarkIsKeptForItsWholeWindowAndOnlyThen(t *testing.T) {
	clock := time.Unix(1_000_000, 0)
	tr := &Transport{uncertain: newUncertainSet(func() time.Time { return clock })}
	const peer, other = "10.0.0.1:5000", "10.0.0.2:5000"
	for rid := uint64(1); rid <= maxUncertain; rid++ {
		tr.markUncertain(peer, rid)
	}
	clock = clock.Add(uncertainTTL / 2)
	tr.markUncertain(peer, 1) // renewed: its window starts again
	clock = clock.Add(uncertainTTL/2 - time.Nanosecond)
	if !tr.Uncertain(peer, 2) {
		t.Fatal("a mark was forgotten within its window")
	}
	clock = clock.Add(2 * time.Nanosecond) // one tick past the window's last instant
	tr.markUncertain(other, 7)             // the cap is full: the marks whose window passed make room
	switch {
	case !tr.Uncertain(other, 7):
		t.Fatal("a new mark was dropped though expired marks could make room")
	case !tr.Uncertain(peer, 1):
		t.Fatal("a renewed mark was forgotten within its new window")
	case tr.Uncertain(peer, 2):
		t.Fatal("a mark whose window passed still counts")
	case tr.Uncertain(other, 8):
		t.Fatal("a request never marked counts as uncertain")
	}
	for rid := uint64(100); tr.uncertain.Len() < maxUncertain; rid++ {
		tr.markUncertain(other, rid)
	}
	tr.markUncertain(other, 1<<40) // every mark is fresh: no room
	if !tr.Uncertain(other, 1<<40) || !tr.Uncertain("10.0.0.3:5000", 9) {
		t.Fatal("a mark refused at the cap must make every request uncertain")
	}
	if !tr.Uncertain(peer, 1) || !tr.uncertain.Fresh(uncertainKey{peer, 1}, clock) {
		t.Fatal("a fresh mark was forgotten at the cap")
	}
	if st := tr.uncertain.Stats(); st.Refused != 1 || st.Evicted != 0 {
		t.Fatalf("uncertain set stats %+v: one mark refused, none evicted to make room (the expired ones aged out)", st)
	}
}
