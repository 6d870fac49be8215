package engine_test

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/internal/fakeverbs"
)

// The mirror of TestRDMADrainAwareAckHoldsForASegmentOpenedByAnAlias: the
// request's WRITE goes through the segment opened by the owner's OWN name,
// and the initiator reaches the owner by an alias afterwards, so the
// owner's control socket routes the ABORT on the alias's (newer)
// connection: the initiator hears the ABORT from the alias. A segment
// opened by the alias is known by both names (Segment.knownAs), but the
// segment opened by the own name knows only its own name, so the task
// index misses the task, the drain drains only the alias segment's path
// (which holds nothing of the request) and the initiator answers
// "drained" while the WRITE goes on. With the owner's fence on, the
// drained ACK inside RDMAFenceGrace spares the initiator the fence; with
// it off, Safe rests on that ACK alone. Either way Abort reports Safe and
// bytes of the request land in the reused range.
func TestRDMAAbortHeardFromAnAliasStopsWorkOnTheOwnNameSegment(t *testing.T) {
	for _, row := range []struct {
		name    string
		noFence bool
		grace   time.Duration
	}{
		// A grace long enough for any drained ACK (a control plane
		// slower than loopback needs more than the default 10 ms): the
		// outcome does not depend on how fast the initiator drains.
		{"rdma fence", false, 2 * time.Second},
		{"rdma drain-aware ACK", true, 0},
	} {
		t.Run(row.name, func(t *testing.T) {
			const size, rid = 16 << 20, 93
			owner, init, alias := aliasedPair(t, engine.Options{RDMANoFence: row.noFence, RDMAFenceGrace: row.grace})
			dst, src := alloc(t, owner, size), alloc(t, init, size)
			fillByte(src, oldByte)
			own := openSegment(t, init, owner.Name())
			const probe = 64 << 10
			// A write without request id: the own-name path is dialed
			// (and with it the control connection to the own name).
			transfer(t, init, 30*time.Second, write(src[:probe], own, engine.AddrOf(dst), probe))
			fillByte(dst, 0)
			fakeverbs.SlowPlacement(t, 5000) // 64 KiB every 5 ms: the write takes over a second
			b := submit(t, init, withRID(write(src, own, engine.AddrOf(dst), size), rid, 0))
			waitFor(t, 20*time.Second, "first bytes landed", func() bool { return bytes.IndexByte(dst, oldByte) >= 0 })
			// Now the alias, for another range: its control connection is
			// the newest, and the owner routes the ABORT on it.
			aliasSeg := openSegment(t, init, alias)
			probeDst, probeSrc := alloc(t, owner, probe), alloc(t, init, probe)
			transfer(t, init, 30*time.Second, write(probeSrc, aliasSeg, engine.AddrOf(probeDst), probe))

			if r := b.Results()[0]; r.Status.Final() {
				t.Fatalf("setup: request %d's WRITE ended %v before the abort; nothing would be shown", rid, r.Status)
			}
			res, err := owner.Abort(testCtx(t, 20*time.Second), rid, []string{init.Name()})
			if err != nil || !res.Safe {
				t.Fatalf("abort of %d naming %s = %+v, %v; want Safe", rid, init.Name(), res, err)
			}
			fillByte(dst, reusedByte)
			r := waitBatch(t, b, 60*time.Second)[0]
			old := settledOldBytes(t, dst)
			var from []string
			for len(init.Events()) > 0 {
				if ev := <-init.Events(); ev.Kind == engine.EventAborted {
					from = append(from, ev.Peer)
				}
			}
			t.Logf("R through %s; ABORT heard from %v; abort %+v; task %v after %d bytes (%v); %d bytes of R in the reused range",
				own.Name(), from, res, r.Status, r.Transferred, r.Err, old)
			if old != 0 {
				t.Fatalf("%d bytes of request %d landed in the owner's reused range after a Safe abort (ABORT heard from %v, R written through %s)", old, rid, from, own.Name())
			}
			if r.Status != engine.Aborted || !errors.Is(r.Err, engine.ErrAborted) {
				t.Errorf("the initiator's task ended %v (%v); want ABORTED", r.Status, r.Err)
			}
		})
	}
}
