package engine

import (
	"testing"

	"github.com/kvferry/kvferry/engine/fence"
)

// An owner answers a resync's PING with the epoch it had then. A FENCE
// notice it sent a moment later can reach us before the answer does: the
// answer is then below what we know, yet the owner did not restart. Taking
// it for a restart would forget the fence just learned, and the next
// request, planned after that fence returned, would be stamped below it
// and refused.
func TestAResyncAnswerOvertakenByAFenceNoticeKeepsTheNotice(t *testing.T) {
	s := &Segment{}
	s.fences.Learn(7) // what we knew when the PING went out
	s.fences.Apply(0, []fence.Fenced{{Epoch: 8, Ranges: []fence.Range{{Addr: 0x1000, Len: 0x1000}}}})
	s.resyncTo(7, 7) // the owner answered before it published fence 8
	if got := s.fences.Epoch(); got != 8 {
		t.Fatalf("known epoch after the late answer = %d, want 8 (the notice's)", got)
	}
}

// An answer below what we knew before asking is a restart (or an epoch the
// owner never issued, from a forged notice): what we knew starts afresh.
func TestAResyncAnswerBelowWhatWeKnewBeforeAskingStartsAfresh(t *testing.T) {
	s := &Segment{}
	s.fences.Learn(1000) // forged, or an earlier incarnation's
	s.resyncTo(1000, 3)
	if got := s.fences.Epoch(); got != 3 {
		t.Fatalf("known epoch = %d, want the owner's 3", got)
	}
}
