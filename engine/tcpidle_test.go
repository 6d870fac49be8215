package engine_test

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
)

// An owner closes its idle data connections (TCPIdleTimeout); the
// initiator's next transfers complete all the same, even with retries off:
// slices the owner never read are posted again on a new connection without
// spending a retry. Transfers are also started at random moments around
// the idle timeout, where a request may cross the owner's GOAWAY.
func TestIdledOutPathsNeverFailATransfer(t *testing.T) {
	const idle = 30 * time.Millisecond
	const size = 4 << 20
	owner := newEngineWith(t, engine.Options{TCPIdleTimeout: idle})
	init := newEngineWith(t, engine.Options{MaxRetries: -1})
	dst := alloc(t, owner, size)
	src := alloc(t, init, size)
	fillPattern(src, 3)
	seg := openSegment(t, init, owner.Name())
	transfer(t, init, 30*time.Second, write(src, seg, engine.AddrOf(dst), size))
	if !waitUntil(10*time.Second, func() bool {
		return owner.Stats().IdleClosed >= engine.DefaultPathsPerPeer && init.Stats().PathsIdledOut >= engine.DefaultPathsPerPeer
	}) {
		t.Fatalf("the idle paths were not closed: owner %+v, initiator %+v", owner.Stats(), init.Stats())
	}
	transfer(t, init, 30*time.Second, read(src, seg, engine.AddrOf(dst), size))
	requireEqual(t, "read back after the paths idled out", src, pattern(size, 3))

	idledBefore := init.Stats().PathsIdledOut
	rng := rand.New(rand.NewPCG(1, 2))
	deadline := time.Now().Add(3 * time.Second)
	rounds := 0
	for ; time.Now().Before(deadline); rounds++ {
		time.Sleep(idle - idle/4 + time.Duration(rng.Int64N(int64(idle/2)))) // about when the owner finds the paths idle
		op := write
		if rounds%2 == 1 {
			op = read
		}
		transfer(t, init, 30*time.Second, op(src, seg, engine.AddrOf(dst), size))
	}
	st := init.Stats()
	if st.Retries != 0 || st.TasksFailed != 0 {
		t.Fatalf("stats %+v: a transfer failed or retried", st)
	}
	t.Logf("%d transfers around the idle timeout; %d paths idled out", rounds, st.PathsIdledOut)
	// The sleeps only aim at the idle timeout; on a slow machine they may
	// miss it every time, and then the rounds proved nothing.
	if st.PathsIdledOut == idledBefore {
		t.Fatal("no path idled out between the rounds: no transfer met the owner's idle close")
	}
}
