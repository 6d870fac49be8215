package netfault

import (
	"context"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
)

// TestRateLimitedLinkKeepsDeadlines: with lo shaped to 200 Mbit/s (tc tbf;
// both directions share it), a WRITE that fits its deadline completes
// intact at about that rate, and a WRITE and a READ that cannot finish in
// time (64 MiB in 500 ms) end TIMEOUT by their deadline + deadlineSlack
// although the peer is alive and taking bytes all along. After they
// returned the engine reads nothing more from the WRITE's source (the
// target never receives the marker written into it afterwards) and writes
// nothing more into the READ's destination.
func TestRateLimitedLinkKeepsDeadlines(t *testing.T) {
	f := useFaults(t)
	const (
		mb       = 1 << 20
		size     = 64 * mb
		rateMbit = 200
		deadline = 500 * time.Millisecond
		// Patterns.
		seedOld, seedFit, seedSent, seedMarker, seedMarkerR = 31, 32, 33, 34, 35
	)
	tp := startPeer(t, peerConfig{size: 2 * size})
	e := newEngine(t, engine.Options{})
	src, dst := alloc(t, e, size), alloc(t, e, size)
	seg := openSegment(t, e, tp.name)
	wAt, rAt := tp.addr, tp.addr+size // the target's WRITE and READ ranges
	tp.fill(0, size, seedOld)
	tp.fill(size, size, seedOld)
	// Every path dialed before the limit.
	transfer(t, e, 30*time.Second, req(engine.Read, dst[:16*mb], seg, rAt))

	f.limit(rateMbit)
	fillPattern(src[:8*mb], seedFit)
	took := transfer(t, e, time.Minute, req(engine.Write, src[:8*mb], seg, wAt))
	if m := tp.check(0, 8*mb, seedFit, 0); m.bad != 0 {
		t.Errorf("the WRITE over the shaped link: the target holds %v", m)
	}
	mbit := float64(8*mb) * 8 / took.Seconds() / 1e6
	t.Logf("8 MiB WRITE over lo shaped to %d Mbit/s (%s): %v, %.0f Mbit/s of payload", rateMbit, where, took.Round(time.Millisecond), mbit)
	if mbit > 1.5*rateMbit {
		t.Fatalf("%.0f Mbit/s through a %d Mbit/s limit: the shaping is not in force, so this test tests nothing", mbit, rateMbit)
	}
	tp.fill(0, 8*mb, seedOld)

	run := func(op engine.Op, local []byte, remote uint64) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), deadline)
		defer cancel()
		start := time.Now()
		res, err := e.Transfer(ctx, []engine.Request{req(op, local, seg, remote)})
		took := time.Since(start)
		t.Logf("%v of 64 MiB with a %v deadline over the shaped link: %v after %v, %d bytes confirmed", op, deadline, err, took.Round(time.Microsecond), res[0].Transferred)
		if len(res) != 1 || res[0].Status != engine.Timeout {
			t.Errorf("%v: %+v, want TIMEOUT", op, res)
		}
		if took > deadline+deadlineSlack {
			t.Errorf("%v returned %v past its deadline, want at most %v", op, took-deadline, deadlineSlack)
		}
	}
	fillPattern(src, seedSent)
	run(engine.Write, src, wAt)
	fillPattern(src, seedMarker)
	run(engine.Read, dst, rAt)
	fillPattern(dst, seedMarkerR)
	f.unlimit()

	// One slice on every path: each path is FIFO, so once these are done
	// every frame sent before them was handled.
	probe := alloc(t, e, 4*mb)
	transfer(t, e, 30*time.Second, req(engine.Read, probe, seg, rAt))
	c := tp.classify(0, size, seedOld, seedSent, seedMarker)
	t.Logf("the target's range after the timed-out WRITE: %d words old, %d sent before it returned, %d of the source after it returned, %d mixed, %d other",
		c[0], c[1], c[2], c[3], c[4])
	if c[2] != 0 || c[4] != 0 {
		t.Errorf("the target's range: %d words of the source written after the WRITE returned, %d words of nothing sent", c[2], c[4])
	}
	if n := countPattern(dst, seedMarkerR); n != size/8 {
		t.Errorf("the timed-out READ's destination: %d of %d words changed after it returned", size/8-n, size/8)
	}
}
