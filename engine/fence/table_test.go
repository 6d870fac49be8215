package fence

import (
	"errors"
	"testing"
)

func TestNormalizeSortsAndMergesTouchingRanges(t *testing.T) {
	got := Normalize([]Range{{100, 10}, {0, 10}, {10, 5}, {105, 20}, {200, 1}})
	want := []Range{{0, 15}, {100, 25}, {200, 1}}
	if len(got) != len(want) {
		t.Fatalf("Normalize = %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("Normalize = %v, want %v", got, want)
		}
	}
}

func TestAccessPlannedBeforeAFenceIsRefusedOnlyWhereItTouchesTheRanges(t *testing.T) {
	tb := New(1000)
	if err := tb.Check(1000, 0, 1<<20); err != nil {
		t.Fatalf("no fence yet: %v", err)
	}
	ep, wait, err := tb.Fence([]Range{{4096, 4096}})
	if err != nil || ep != 1001 || wait != nil {
		t.Fatalf("Fence = %d, %v, %v; want epoch 1001, nothing to wait for", ep, wait, err)
	}
	for _, c := range []struct {
		stamp, addr, n uint64
		refused        bool
	}{
		{1000, 4096, 1, true},      // first byte
		{1000, 8191, 1, true},      // last byte
		{1000, 0, 4097, true},      // straddles the start
		{1000, 0, 4096, false},     // ends where the range begins
		{1000, 8192, 4096, false},  // begins where it ends
		{1001, 4096, 4096, false},  // planned after the fence
		{1002, 4096, 4096, true},   // an epoch not issued yet
		{999, 1 << 30, 4096, true}, // below the base: the floor
	} {
		err := tb.Check(c.stamp, c.addr, c.n)
		if (err != nil) != c.refused || (err != nil && !errors.Is(err, ErrFenced)) {
			t.Errorf("Check(stamp %d, [%d, +%d)) = %v; refused want %v", c.stamp, c.addr, c.n, err, c.refused)
		}
	}
}

func TestFenceWaitsForAChunkInProgressAndRefusesTheNext(t *testing.T) {
	tb := New(0)
	g := tb.Guard(nopGuard{}, 0, 0, 8192)
	other := tb.Guard(nopGuard{}, 0, 1<<20, 8192) // elsewhere: not waited for
	if err := g.Enter(); err != nil {
		t.Fatal(err)
	}
	if err := other.Enter(); err != nil {
		t.Fatal(err)
	}
	_, wait, err := tb.Fence([]Range{{4096, 1}})
	if err != nil || wait == nil {
		t.Fatalf("Fence = %v, %v; want a chunk to wait for", wait, err)
	}
	select {
	case <-wait:
		t.Fatal("the fence did not wait for the chunk in progress")
	default:
	}
	g.Leave()
	select {
	case <-wait:
	default:
		t.Fatal("the chunk left, the fence still waits")
	}
	if err := g.Enter(); !errors.Is(err, ErrFenced) {
		t.Fatalf("the access's next chunk: %v, want ErrFenced", err)
	}
	other.Leave()
	if err := other.Enter(); err != nil {
		t.Fatalf("an access elsewhere was refused: %v", err)
	}
	other.Leave()
}

// Past MaxEntries fences the oldest folds into the floor: a stamp below it
// is refused everywhere, never let through.
func TestFoldedFencesRefuseMoreNeverLess(t *testing.T) {
	tb := New(0)
	for i := 0; i < MaxEntries+10; i++ {
		if _, _, err := tb.Fence([]Range{{uint64(i) * 4096, 4096}}); err != nil {
			t.Fatal(err)
		}
	}
	if tb.Len() != MaxEntries || tb.Folded() != 10 || tb.Floor() != 10 {
		t.Fatalf("len %d folded %d floor %d; want %d, 10, 10", tb.Len(), tb.Folded(), tb.Floor(), MaxEntries)
	}
	if err := tb.Check(0, 1<<40, 1); err == nil {
		t.Fatal("a stamp below the floor passed an unfenced range")
	}
	if err := tb.Check(10, 1<<40, 1); err != nil {
		t.Fatalf("a stamp at the floor, unfenced range: %v", err)
	}
	if err := tb.Check(10, 20*4096, 1); err == nil {
		t.Fatal("a stamp at the floor passed a range fenced after it")
	}
}

func TestKnownFencesMirrorTheOwners(t *testing.T) {
	var k Known
	k.Learn(5)
	if k.Void(5, 0, 100) || k.Epoch() != 5 {
		t.Fatal("an epoch learned from a descriptor voids nothing")
	}
	// Out of order, duplicated: the log stays sorted, once per epoch.
	k.Apply(0, []Fenced{{Epoch: 8, Ranges: []Range{{100, 10}}}})
	k.Apply(0, []Fenced{{Epoch: 7, Ranges: []Range{{0, 10}}}})
	if k.Apply(0, []Fenced{{Epoch: 7, Ranges: []Range{{0, 10}}}}) {
		t.Fatal("a repeated notice counted as news")
	}
	if k.Epoch() != 8 {
		t.Fatalf("epoch %d, want 8", k.Epoch())
	}
	for _, c := range []struct {
		stamp, addr uint64
		void        bool
	}{{6, 0, true}, {7, 0, false}, {7, 100, true}, {8, 100, false}, {6, 50, false}} {
		if got := k.Void(c.stamp, c.addr, 1); got != c.void {
			t.Errorf("Void(%d, %d) = %v, want %v", c.stamp, c.addr, got, c.void)
		}
	}
	k.Reset()
	if k.Epoch() != 0 || k.Void(0, 0, 1) {
		t.Fatal("Reset kept something")
	}
}

// The ranges remembered are bounded too, whatever each fence names: past
// MaxTotalRanges the oldest fences fold into the floor.
func TestRangesRememberedAreBounded(t *testing.T) {
	tb := New(0)
	var k Known
	many := func(base uint64) []Range {
		rs := make([]Range, MaxRanges)
		for i := range rs {
			rs[i] = Range{base + uint64(i)*8192, 4096} // apart: nothing merges
		}
		return rs
	}
	for i := uint64(0); i < 6; i++ {
		ep, _, err := tb.Fence(many(i << 40))
		if err != nil {
			t.Fatal(err)
		}
		k.Apply(0, []Fenced{{Epoch: ep, Ranges: many(i << 40)}})
	}
	if tb.ranges > MaxTotalRanges || k.ranges > MaxTotalRanges {
		t.Fatalf("ranges remembered: owner %d, initiator %d; at most %d", tb.ranges, k.ranges, MaxTotalRanges)
	}
	if tb.Floor() == 0 || tb.Check(0, 5<<40, 1) == nil || !k.Void(0, 1<<41, 1) {
		t.Fatal("folded fences no longer refuse what they fenced")
	}
}
