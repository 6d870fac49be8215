package rdma

import (
	"fmt"
	"testing"
)

// The uncertain set is what keeps an initiator from promising a drain of
// a request whose work requests ended without the responder's answer
// (their bytes may still land). At its cap it may forget only entries
// whose uncertainTTL passed: forgetting a fresh one would let the next
// Drain of that request report "drained" while its bytes can still land,
// and an owner relying on the drain-aware ACK would report Safe early.
// Here every entry is fresh, so none may be forgotten, however many there
// are. The test needs no NIC: only the set's bookkeeping runs.
func TestRDMAUncertainSetAtItsCapNeverForgetsAFreshRequest(t *testing.T) {
	tr := &Transport{uncertain: newUncertainSet(nil)}
	const extra = 256
	n := maxUncertain + extra
	peers := []string{"10.0.0.1:5000", "10.0.0.2:5000"}
	for i := 0; i < n; i++ {
		tr.markUncertain(peers[i%len(peers)], uint64(i+1))
	}
	forgot := 0
	var first string
	for i := 0; i < n; i++ {
		peer, rid := peers[i%len(peers)], uint64(i+1)
		if !tr.Uncertain(peer, rid) {
			if forgot == 0 {
				first = fmt.Sprintf("(%s, %d)", peer, rid)
			}
			forgot++
		}
	}
	if forgot > 0 {
		t.Fatalf("%d of %d requests marked uncertain moments ago (cap %d) are no longer uncertain, the first %s: their drain would be promised while their bytes may still land",
			forgot, n, maxUncertain, first)
	}
}
