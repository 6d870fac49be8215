package transporttest

// Abort of a path: queued slices, slices in flight, a busy stream and a
// long post all end when Abort returns, and nothing of them touches memory
// afterwards; a Post after Abort fails at once.

import (
	"bytes"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/transport"
)

// abortPromptly is how long Abort may take on a path whose owner keeps up:
// it stops copies "now", so anything near a socket timeout is a hang.
const abortPromptly = 3 * time.Second

// abort calls Abort on another goroutine, lets the owner go once the
// endpoint reports Dead (Abort may wait for a copy held at admission), and
// waits for Abort to return.
func (e *env) abort(t *testing.T, release func()) { e.abortN(t, release, 1) }

// abortN is abort with n callers of Abort at once (the engine may abort a
// path from several goroutines); every one of them must return.
func (e *env) abortN(t *testing.T, release func(), n int) {
	t.Helper()
	aborted := make(chan struct{})
	var callers sync.WaitGroup
	for i := range n {
		callers.Add(1)
		go func() {
			defer callers.Done()
			e.ep.Abort(fmt.Errorf("transporttest: abort %d", i))
		}()
	}
	go func() {
		callers.Wait()
		close(aborted)
	}()
	if !waitFor(5*time.Second, e.ep.Dead) {
		t.Errorf("Dead() is still false 5 s after Abort was called")
	}
	if release != nil {
		release()
	}
	select {
	case <-aborted:
	case <-time.After(10 * time.Second):
		e.leak.Store(true)
		dumpGoroutines(t)
		t.Fatalf("Abort hangs for 10 s")
	}
	if !e.ep.Dead() {
		t.Errorf("Dead() is false after Abort returned")
	}
}

// checkAfterAbort checks that the initiator's memory is what it was when
// Abort returned (snapshot), then posts slices to the aborted endpoint: each
// must fail with a connection error before Post returns.
func (e *env) checkAfterAbort(t *testing.T, snapshot []byte, owner, local *buffer) {
	t.Helper()
	compare(t, "initiator memory after Abort returned", snapshot, local.all)
	// Only the initiator's memory is checked: the owner may still be
	// applying bytes of an aborted WRITE that had reached its socket.
	localBefore := bytes.Clone(local.all)
	ss := []*slice{
		e.newSlice(transport.Write, local, 0, owner, 0, 4096),
		e.newSlice(transport.Read, local, 8192, owner, 8192, 4096),
		e.newSlice(transport.Write, local, mib, owner, mib, mib+1),
	}
	e.ep.Post(base(ss))
	for _, s := range ss {
		select {
		case <-s.done:
			if !errors.Is(s.err, transport.ErrConnection) {
				t.Errorf("slice %s posted after Abort ended with %v; want an error matching transport.ErrConnection", s.name, s.err)
			}
		default:
			t.Errorf("slice %s posted after Abort did not fail at once", s.name)
		}
	}
	e.endAborted(t, ss, 5*time.Millisecond)
	compare(t, "initiator memory after a Post after Abort", localBefore, local.all)
}

func testAbortQueuedAndInFlight(t *testing.T, f Factory) {
	e := newEnv(t, f)
	owner := e.alloc(e.ownerReg, 32*mib, 41)
	local := e.alloc(e.initReg, 48*mib, 42)
	tail := e.tail(owner, local, 16)
	head, release := e.stalled(t, owner, local, tail)
	// Two are canceled first: Abort must then leave them alone.
	canceled := tail[:2]
	for _, s := range canceled {
		if !s.TryCancel() {
			t.Fatalf("TryCancel of queued slice %s failed", s.name)
		}
	}
	live := append(append([]*slice(nil), head...), tail[2:]...)

	e.abort(t, release)
	snapshot := bytes.Clone(local.all)
	for _, s := range live {
		select {
		case <-s.done:
		default:
			t.Errorf("slice %s had not ended when Abort returned (state %d)", s.name, s.State())
		}
	}
	e.endAborted(t, live, 50*time.Millisecond)
	for _, s := range live {
		if !errors.Is(s.err, transport.ErrConnection) {
			t.Errorf("slice %s ended with %v; want an error matching transport.ErrConnection", s.name, s.err)
		} else if !transport.Retryable(s.err) {
			t.Errorf("slice %s: connection error %q is not retryable", s.name, s.err)
		}
	}
	for _, s := range canceled {
		if n := s.calls.Load(); n != 0 {
			t.Errorf("slice %s canceled before Abort: Done called %d times, want never", s.name, n)
		}
	}
	e.checkAfterAbort(t, snapshot, owner, local)
}

// testAbortBusyStream aborts a path while several goroutines post to it.
func testAbortBusyStream(t *testing.T, f Factory) {
	e := newEnv(t, f)
	owner, local := e.alloc(e.ownerReg, 8*mib, 51), e.alloc(e.initReg, 8*mib, 52)
	const (
		goroutines = 4
		posts      = 64
		window     = 2 * mib
		n          = 128 << 10
	)
	var mu sync.Mutex
	var all []*slice
	var wg sync.WaitGroup
	start := make(chan struct{})
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			for p := range posts {
				off := g*window + (p*2*n)%window
				ss := []*slice{
					e.newSlice(transport.Write, local, off, owner, off, n),
					e.newSlice(transport.Read, local, off+n, owner, off+n, n),
				}
				mu.Lock()
				all = append(all, ss...)
				mu.Unlock()
				e.ep.Post(base(ss))
			}
		}()
	}
	close(start)
	waitFor(time.Second, func() bool { return e.owner.Admits.Load() >= 8 })
	e.abortN(t, nil, 3)
	snapshot := bytes.Clone(local.all)
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	e.endAborted(t, all, 50*time.Millisecond)
	ok, conn := tally(t, all)
	t.Logf("%d slices completed, %d failed by the abort", ok, conn)
	e.checkAfterAbort(t, snapshot, owner, local)
}

// testAbortLongPost aborts a path busy sending one long Post and, the
// moment it is dead, stops the owner reading (as a slow or paused peer
// would). The Post starts with tiny WRITEs alternating between two
// initiator regions (so a sender cannot gather them into one write) and
// tiny READs, which the owner answers as fast as they come, so the sender
// is busy writing rather than waiting when Abort strikes; big READs and
// WRITEs follow, so a sender that goes on after Abort fills every buffer.
// Abort must cut the path at once, whatever the owner does; the owner is
// let go after a moment, since a transport that copies in the caller's
// process (local) may rightly wait for an admission in progress.
func testAbortLongPost(t *testing.T, f Factory) {
	e := newEnv(t, f)
	owner := e.alloc(e.ownerReg, 4*mib, 61)
	localA := e.alloc(e.initReg, 4*mib, 62)
	localB := e.alloc(e.initReg, 64<<10, 63)
	const tinyGroups, bigReads, bigWrites = 10000, 500, 200
	ss := make([]*slice, 0, 4*tinyGroups+bigReads+bigWrites)
	for range tinyGroups {
		ss = append(ss,
			e.newSlice(transport.Write, localA, 0, owner, 0, 64),
			e.newSlice(transport.Read, localA, 4096, owner, 4096, 64),
			e.newSlice(transport.Write, localB, 0, owner, 64, 64),
			e.newSlice(transport.Read, localA, 8192, owner, 8192, 64),
		)
	}
	for range bigReads {
		ss = append(ss, e.newSlice(transport.Read, localA, mib, owner, mib, mib))
	}
	for range bigWrites {
		ss = append(ss, e.newSlice(transport.Write, localA, 2*mib, owner, 2*mib, mib))
	}
	e.ep.Post(base(ss))
	if !waitFor(5*time.Second, func() bool { return e.owner.Admits.Load() >= 2000 || e.owner.progress() >= 2000 }) {
		t.Fatalf("the owner admitted only %d slices in 5 s (progress %d)", e.owner.Admits.Load(), e.owner.progress())
	}
	start := time.Now()
	aborted := make(chan struct{})
	go func() {
		e.ep.Abort(errors.New("transporttest: abort"))
		close(aborted)
	}()
	for !e.ep.Dead() {
		if time.Since(start) > 5*time.Second {
			t.Fatalf("Dead() is still false 5 s after Abort was called")
		}
		runtime.Gosched()
	}
	release := e.owner.Hold()
	t.Cleanup(release)
	select {
	case <-aborted:
	case <-time.After(500 * time.Millisecond):
		release()
		select {
		case <-aborted:
		case <-time.After(abortPromptly):
			dumpGoroutines(t)
			// The factory's teardown cuts the path from the owner's side,
			// which ends this Abort; waiting here for a socket timeout
			// would only slow the suite down.
			e.leak.Store(true)
			t.Fatalf("Abort has not returned %v after it was called, nor %v after the owner was let go",
				time.Since(start).Round(time.Millisecond), abortPromptly)
		}
	}
	t.Logf("Abort returned after %v", time.Since(start).Round(time.Microsecond))
	release()
	if !wait(t, ss, doneTimeout) {
		e.leak.Store(true)
		t.FailNow()
	}
	checkOnce(t, ss)
	ok, conn := tally(t, ss)
	t.Logf("%d slices completed, %d failed by the abort", ok, conn)
}
