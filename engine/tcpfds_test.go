package engine_test

import (
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
)

// waitUntil polls cond until it holds or d passes, and reports whether it
// held.
func waitUntil(d time.Duration, cond func() bool) bool {
	for deadline := time.Now().Add(d); ; time.Sleep(time.Millisecond) {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
	}
}

// fdsBesidesChildren counts this process's open descriptors like countFDs,
// leaving out the pipes and pidfds that connect the test to its child
// processes (they stay open until the test ends).
func fdsBesidesChildren(t *testing.T) (int, []string) {
	t.Helper()
	_, all := countFDs(t)
	var names []string
	for _, n := range all {
		if !strings.Contains(n, "pipe:") && !strings.Contains(n, "[pidfd]") {
			names = append(names, n)
		}
	}
	return len(names), names
}

// An initiator whose targets are killed one after another keeps no
// descriptor for any of them: its data paths to a dead target are closed
// (the kernel resets them), and so is its control socket (a ZMQ DEALER that
// would otherwise stay open, reconnecting for ever, as long as the segment
// is open). The targets are child processes, killed with SIGKILL.
func TestInitiatorKeepsNoDescriptorsForKilledTargets(t *testing.T) {
	const size = 4 << 20
	a := newEngineWith(t, engine.Options{HeartbeatInterval: 50 * time.Millisecond, HeartbeatMisses: 3})
	local := alloc(t, a, size)
	cycle := func() {
		t.Helper()
		tp := startTarget(t, targetConfig{size: size})
		seg := openSegment(t, a, tp.name)
		warmPaths(t, a, seg, local, tp.addr)
		tp.signal(t, syscall.SIGKILL)
		if _, err := a.Transfer(testCtx(t, 10*time.Second), []engine.Request{write(local, seg, tp.addr, size)}); err == nil {
			t.Fatal("a transfer to a killed target succeeded")
		}
	}
	f0, before := fdsBesidesChildren(t)
	for range 4 {
		cycle()
	}
	var f int
	var after []string
	if !waitUntil(15*time.Second, func() bool { f, after = fdsBesidesChildren(t); return f <= f0 }) {
		t.Fatalf("open file descriptors: %d before, %d after four killed targets\nbefore:\n%s\nafter:\n%s",
			f0, f, strings.Join(before, "\n"), strings.Join(after, "\n"))
	}
	t.Logf("open file descriptors: %d before, %d after four killed targets", f0, f)
}
