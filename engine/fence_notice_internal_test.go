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
// sorted before the lock; this benchmark reports the longest wait of a
// Submit for abortMu while one such notice is handled
// (go test ./engine -run '^$' -bench HandleFenceHoldsAbortMu).
func BenchmarkHandleFenceHoldsAbortMuBriefly(b *testing.B) {
	owner, init, _, _, _ := inflightPair(b, Options{}, 0)
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
			// Reported, not asserted: a figure to compare against the
			// time the notice takes to decode and sort (ns/op).
			b.ReportMetric(float64(worst.Microseconds()), "max-abortMu-wait-us")
			return
		default:
		}
		start := time.Now()
		init.abortMu.RLock()
		worst = max(worst, time.Since(start))
		init.abortMu.RUnlock()
	}
}
