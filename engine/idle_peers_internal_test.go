package engine

import (
	"context"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/memory"
)

// idleWrite writes n bytes from src to dst at seg and requires success.
func idleWrite(t *testing.T, e *Engine, seg *Segment, src, dst []byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	res, err := e.Transfer(ctx, []Request{{Op: Write, Local: memory.AddrOf(src), Segment: seg, Remote: memory.AddrOf(dst), Length: uint64(len(src))}})
	if err != nil || res[0].Status != Completed {
		t.Fatalf("write to %s: %v, %+v", seg.name, err, res)
	}
}

func idleWaitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(15 * time.Second); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 15 s", what)
		}
	}
}

func idleAlloc(t *testing.T, e *Engine, n int) []byte {
	t.Helper()
	b, err := e.AllocBuffer(n, "cpu")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.FreeBuffer(memory.AddrOf(b)) })
	return b
}

// Paths to a peer left idle past PathIdleTimeout are closed, and the next
// transfer dials again and completes.
func TestIdlePeersPathsAreClosedAndRedialedOnUse(t *testing.T) {
	owner := newCacheEngine(t, Options{})
	init := newCacheEngine(t, Options{HeartbeatInterval: 20 * time.Millisecond, PathIdleTimeout: 100 * time.Millisecond})
	dst := idleAlloc(t, owner, 4<<20)
	src := idleAlloc(t, init, 4<<20)
	seg, err := init.OpenSegment(context.Background(), owner.Name())
	if err != nil {
		t.Fatal(err)
	}
	idleWrite(t, init, seg, src, dst)
	idleWaitUntil(t, "idle paths closed", func() bool { return seg.openPaths() == 0 && init.Stats().PathsClosedIdle > 0 })
	idleWrite(t, init, seg, src, dst)
	if st := init.Stats(); st.Retries != 0 || st.TasksFailed != 0 {
		t.Fatalf("a transfer after the idle close retried or failed: %+v", st)
	}
}

// A peer with a transfer in flight is never idle, however long the transfer
// takes: its paths stay, and the transfer completes without a retry. The
// same test with the in-flight count left out (the paths closed under the
// transfer) fails: the owner's apply delay holds the WRITE well past
// PathIdleTimeout and many heartbeat ticks.
func TestPathsOfAPeerWithATransferInFlightAreNeverClosedAsIdle(t *testing.T) {
	owner := newCacheEngine(t, Options{Testing: Testing{ApplyDelay: 400 * time.Millisecond}})
	init := newCacheEngine(t, Options{HeartbeatInterval: 10 * time.Millisecond, PathIdleTimeout: time.Millisecond,
		IdlePaths: -1, MaxRetries: -1})
	dst := idleAlloc(t, owner, 1<<20)
	src := idleAlloc(t, init, 1<<20)
	seg, err := init.OpenSegment(context.Background(), owner.Name())
	if err != nil {
		t.Fatal(err)
	}
	idleWrite(t, init, seg, src, dst)
	if st := init.Stats(); st.Retries != 0 || st.PathsClosedIdle != 0 {
		t.Fatalf("paths closed under a transfer in flight: %+v", st)
	}
}

// Past IdlePaths, the least recently used idle peers lose their paths first;
// the most recently used keeps its own.
func TestIdlePathBudgetClosesTheLeastRecentlyUsedPeersFirst(t *testing.T) {
	init := newCacheEngine(t, Options{HeartbeatInterval: 20 * time.Millisecond, PathIdleTimeout: time.Hour,
		PathsPerPeer: 2, IdlePaths: 2, SliceSize: 64 << 10})
	src := idleAlloc(t, init, 1<<20)
	var segs []*Segment
	for range 3 {
		owner := newCacheEngine(t, Options{})
		dst := idleAlloc(t, owner, 1<<20)
		seg, err := init.OpenSegment(context.Background(), owner.Name())
		if err != nil {
			t.Fatal(err)
		}
		idleWrite(t, init, seg, src, dst)
		segs = append(segs, seg)
	}
	last := segs[2]
	if last.openPaths() == 0 {
		t.Fatal("the last peer used has no path open")
	}
	idleWaitUntil(t, "idle paths within the budget", func() bool {
		return segs[0].openPaths()+segs[1].openPaths()+segs[2].openPaths() <= 2
	})
	if segs[0].openPaths() != 0 || segs[1].openPaths() != 0 || last.openPaths() == 0 {
		t.Fatalf("paths kept: %d, %d, %d; want only the most recently used peer's", segs[0].openPaths(), segs[1].openPaths(), last.openPaths())
	}
}

// An idle segment is pinged once per IdleHeartbeatInterval, one in use (or
// with work in flight) at every tick.
func TestIdleSegmentsArePingedSeldom(t *testing.T) {
	const sec = int64(time.Second)
	every := 15 * time.Second
	s := &Segment{}
	s.lastUsed.Store(100 * sec)
	if !s.pingDue(101*sec, every) || !s.pingDue(102*sec, every) {
		t.Fatal("a segment used a second ago is not pinged at every tick")
	}
	// Idle from 115 s on; its last ping was at 102 s: the next at 117 s,
	// then none for 15 s.
	if s.pingDue(116*sec, every) {
		t.Fatal("an idle segment pinged 14 s after its last ping")
	}
	if !s.pingDue(117*sec, every) {
		t.Fatal("an idle segment not pinged IdleHeartbeatInterval after its last ping")
	}
	for now := 118 * sec; now < 132*sec; now += sec {
		if s.pingDue(now, every) {
			t.Fatalf("an idle segment pinged again %v after its last ping", time.Duration(now-117*sec))
		}
	}
	if !s.pingDue(132*sec, every) {
		t.Fatal("an idle segment not pinged IdleHeartbeatInterval after its last ping")
	}
	s.inflight.Store(1)
	if !s.pingDue(133*sec, every) {
		t.Fatal("a segment with work in flight is not pinged at every tick")
	}
	s.inflight.Store(0)
	s.lastPing.Store(0) // its store entry went: ping at the next tick
	if !s.pingDue(134*sec, every) {
		t.Fatal("a segment marked for a ping is not pinged")
	}
}
