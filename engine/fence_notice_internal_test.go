package engine

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/control"
)

// handleFence runs on the control plane's loop (its handlers must not
// block) and takes abortMu exclusively, which every Submit takes shared. A
// FENCE may carry control.MaxFenceRanges = 2^19 ranges, and sorting that
// many takes about 100 ms of CPU: were it done under abortMu, every Submit
// of the initiator, to any peer, would wait that long per notice, and any
// peer that claims an owner's name can send such notices. The ranges are
// sorted before the lock; this test holds the lock to 20 ms.
func TestHandleFenceHoldsAbortMuBriefly(t *testing.T) {
	owner, init, _, _, _ := reviewPair(t, Options{}, 0)
	rs := make([]control.FenceRange, control.MaxFenceRanges)
	for i := range rs {
		rs[i] = control.FenceRange{Addr: uint64(i) * 8192, Len: 1}
	}
	rand.Shuffle(len(rs), func(i, j int) { rs[i], rs[j] = rs[j], rs[i] })
	body := control.FenceMsg{Epoch: 1, Ranges: rs}.Encode()

	done := make(chan struct{})
	go func() {
		defer close(done)
		init.handleFence(owner.Name(), body)
	}()
	var worst time.Duration
	for {
		select {
		case <-done:
			t.Logf("a Submit waited up to %v for abortMu while one FENCE of %d ranges was handled", worst, len(rs))
			if worst > 20*time.Millisecond {
				t.Fatalf("abortMu held %v by one FENCE notice: every Submit of the engine waits that long per notice", worst)
			}
			return
		default:
		}
		start := time.Now()
		init.abortMu.RLock()
		worst = max(worst, time.Since(start))
		init.abortMu.RUnlock()
	}
}
