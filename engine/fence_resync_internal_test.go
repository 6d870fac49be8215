package engine

import (
	"testing"

	"github.com/kvferry/kvferry/engine/fence"
)

// answers returns an ask for Segment.resync that gives the owner's answers
// in turn, running before[i] (if any) while question i is out.
func answers(eps []uint64, during ...func()) func() (uint64, bool) {
	i := 0
	return func() (uint64, bool) {
		if i < len(during) && during[i] != nil {
			during[i]()
		}
		ep := eps[min(i, len(eps)-1)]
		i++
		return ep, true
	}
}

// An owner answers a resync's PING with the epoch it had then. A FENCE
// notice it sent a moment later can reach us before the answer does: the
// answer is then below what we know, yet the owner did not restart. Taking
// it for a restart would forget the fence just learned, and the next
// request, planned after that fence returned, would be stamped below it
// and refused (a rare failure of the PD fence stress). Asked again, the
// owner confirms the notice.
func TestAResyncAnswerOvertakenByAFenceNoticeKeepsTheNotice(t *testing.T) {
	s := &Segment{}
	s.fences.Learn(7)
	notice := func() {
		s.fences.Apply(0, []fence.Fenced{{Epoch: 8, Ranges: []fence.Range{{Addr: 0x1000, Len: 0x1000}}}})
	}
	s.resync(answers([]uint64{7, 8}, notice)) // answered before fence 8, then after
	if got := s.fences.Epoch(); got != 8 {
		t.Fatalf("known epoch = %d, want 8 (the notice's)", got)
	}
}

// An epoch the owner never issued (a forged notice, a late one of its
// previous incarnation) that arrives while the question is out must not
// survive the resync: a transfer stamped with it would pass the owner's
// check once the owner's own epoch reaches it, though planned before that
// fence.
func TestAnEpochTheOwnerNeverIssuedDoesNotSurviveAResync(t *testing.T) {
	owner := fence.New(0)
	for i := range 9 {
		owner.Fence([]fence.Range{{Addr: 0x100000 + uint64(i)*0x1000, Len: 0x1000}})
	}
	s := &Segment{}
	s.fences.Learn(owner.Epoch())
	forged := func() {
		s.fences.Apply(0, []fence.Fenced{{Epoch: 10, Ranges: []fence.Range{{Addr: 0x900000, Len: 0x1000}}}})
	}
	s.resync(answers([]uint64{owner.Epoch()}, forged))
	stamp := s.fences.Epoch()
	r := fence.Range{Addr: 0x2000, Len: 0x1000}
	ep, _, _ := owner.Fence([]fence.Range{r})
	if err := owner.Check(stamp, r.Addr, r.Len); err == nil {
		t.Fatalf("a transfer stamped %d, planned before fence %d of its range, passed the owner's check", stamp, ep)
	}
}

// An answer below what we knew before asking is a restart (or an epoch the
// owner never issued): what we know starts afresh.
func TestAResyncAnswerBelowWhatWeKnewStartsAfresh(t *testing.T) {
	s := &Segment{}
	s.fences.Learn(1000) // forged, or an earlier incarnation's
	s.resync(answers([]uint64{3}))
	if got := s.fences.Epoch(); got != 3 {
		t.Fatalf("known epoch = %d, want the owner's 3", got)
	}
}

// A failed question leaves the resync owed.
func TestAResyncWithoutAnAnswerIsAskedAgainLater(t *testing.T) {
	s := &Segment{}
	s.fences.Learn(5)
	s.resync(func() (uint64, bool) { return 0, false })
	if !s.fencedStale.Load() || s.fences.Epoch() != 5 {
		t.Fatalf("after a failed question: stale %v, epoch %d; want true, 5", s.fencedStale.Load(), s.fences.Epoch())
	}
}
