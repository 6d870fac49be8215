package fence

// Bounds of the fence table and of what an initiator knows: stamps the
// owner never issued, and the ranges kept.

import (
	"testing"
)

// An owner's Table lets through any access stamped at or above its own
// epoch, so a stamp it never issued (an initiator that learned a higher
// epoch from an older incarnation of the owner, or from a FENCE forged
// under the owner's name) passes every fence until the owner's epoch
// catches up with it. "Planned before" must be decided by what the owner
// issued: a stamp above the owner's epoch is not one of them and must be
// refused (the initiator then refreshes and starts over from the owner's
// real epoch). See TestFenceRefusesAStampTheOwnerNeverIssued
// for the corruption it causes end to end.
func TestCheckRefusesAStampTheOwnerNeverIssued(t *testing.T) {
	tb := New(0)
	r := Range{Addr: 0x10000, Len: 0x1000}
	ep, _, err := tb.Fence([]Range{r})
	if err != nil {
		t.Fatal(err)
	}
	for _, stamp := range []uint64{ep + 1, 1 << 40, ^uint64(0)} {
		if err := tb.Check(stamp, r.Addr, 16); err == nil {
			t.Errorf("Check(stamp %d, fenced range) passed at owner epoch %d: a stamp the owner never issued goes through its fence", stamp, ep)
		}
		g := tb.Guard(nopGuard{}, stamp, r.Addr, 16)
		if err := g.Enter(); err == nil {
			g.Leave()
			t.Errorf("guard of stamp %d entered the fenced range at owner epoch %d", stamp, ep)
		}
	}
}

type nopGuard struct{}

func (nopGuard) Enter() error { return nil }
func (nopGuard) Leave()       {}

// What an initiator keeps of an owner's fences is bounded in entries
// (MaxEntries) but not in bytes: each entry keeps every range of its
// notice, and a notice may carry control.MaxFenceRanges (2^19) ranges,
// eight times what an owner's Table ever issues in one fence (MaxRanges,
// 2^16). So any peer that can send FENCE under an owner's name (the
// control plane takes a peer's claimed name as given) makes every
// initiator that has that owner's segment open keep up to 4096 x 2^19 x 16
// bytes = 32 GiB, and an honest owner fencing 2^16 ranges at a time makes
// each of them keep 4 GiB. This test holds Known to MaxTotalRanges (2^21
// ranges, 32 MiB) in all, folding into the floor past it as for entries.
func TestKnownBoundsTheRangesItKeeps(t *testing.T) {
	const perNotice = 1 << 19 // control.MaxFenceRanges
	const budget = MaxTotalRanges
	var k Known
	for ep := uint64(1); ep <= 6; ep++ {
		rs := make([]Range, perNotice)
		for i := range rs {
			rs[i] = Range{Addr: uint64(i) * 4096, Len: 1} // disjoint: Normalize keeps them all
		}
		k.Apply(0, []Fenced{{Epoch: ep, Ranges: rs}})
	}
	k.mu.Lock()
	kept := 0
	for _, e := range k.log {
		kept += len(e.ranges)
	}
	k.mu.Unlock()
	if kept > budget {
		t.Fatalf("Known keeps %d ranges (%d MiB) after 6 notices; at MaxEntries notices it would keep %d GiB", kept, kept*16>>20, MaxEntries*perNotice*16>>30)
	}
}
