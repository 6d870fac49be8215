package engine

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/control"
	"github.com/kvferry/kvferry/engine/transport/transporttest"
)

// steeredUncertain is an uncertainty tracker whose answer the test sets
// per name, and whose next call can be held (armed) until the test lets
// it go.
type steeredUncertain struct {
	mu        sync.Mutex
	uncertain map[string]bool
	armed     bool
	entered   chan struct{}
	release   chan struct{}
	calls     atomic.Int64
}

func newSteeredUncertain() *steeredUncertain {
	return &steeredUncertain{uncertain: map[string]bool{}, entered: make(chan struct{}), release: make(chan struct{})}
}

func (s *steeredUncertain) Uncertain(name string, _ uint64) bool {
	s.calls.Add(1)
	s.mu.Lock()
	armed := s.armed
	s.armed = false
	s.mu.Unlock()
	if armed {
		close(s.entered)
		<-s.release
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.uncertain[name]
}

func (s *steeredUncertain) set(name string, v bool) {
	s.mu.Lock()
	s.uncertain[name] = v
	s.mu.Unlock()
}

// recheckEngine is an engine whose only uncertainty tracker is tr, and
// the helpers its tests share.
type recheckEngine struct {
	t *testing.T
	e *Engine
}

func newRecheckEngine(t *testing.T, tr *steeredUncertain) *recheckEngine {
	e, err := New(Options{Host: "127.0.0.1", IgnoreEnv: true, Protocol: "tcp"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close() })
	e.transports = append(e.transports, abilities{uncertain: tr})
	return &recheckEngine{t, e}
}

type tombState struct {
	gen                 uint32
	drained             bool
	outcome             control.AckOutcome
	recheck, rechecking bool
}

func (r *recheckEngine) state(k tombKey) (s tombState) {
	r.e.abortMu.Lock()
	defer r.e.abortMu.Unlock()
	if tb := r.e.tombOf(k); tb != nil {
		s = tombState{tb.minGen, tb.drained, tb.outcome, tb.recheck, tb.rechecking}
	}
	return s
}

func (r *recheckEngine) waitState(k tombKey, what string, ok func(tombState) bool) tombState {
	r.t.Helper()
	var s tombState
	if !transporttest.WaitFor(5*time.Second, func() bool { s = r.state(k); return ok(s) }) {
		r.t.Fatalf("%s: not within 5 s; tombstone %+v, rechecks %d", what, s, r.e.Stats().DrainsRechecked)
	}
	return s
}

// A recheck started for generation 1 that ends after the owner aborted
// the request again (generation 2) must change nothing, and must not keep
// generation 2 from being rechecked: that recheck used to leave its flag
// set, so a drain-aware owner never got the drained ACK it resends its
// ABORT for, even once the paths confirmed, and its Abort ended NotSafe.
func TestRecheckOfAnOlderGenerationDoesNotBlockTheNextOne(t *testing.T) {
	const owner, rid = "10.255.0.1:7000", 42
	tr := newSteeredUncertain()
	tr.set(owner, true)
	r := newRecheckEngine(t, tr)
	k := tombKey{owner, rid}
	abort := func(gen uint32) {
		r.e.handleAbort(owner, control.AbortMsg{RequestID: rid, Generation: gen}.Encode())
	}
	cutToRecheck := func(gen uint32) func(tombState) bool {
		return func(s tombState) bool {
			return s.gen == gen && s.drained && s.outcome == control.AckCut && s.recheck
		}
	}

	// Generation 1: the path cannot confirm yet: cut, to be rechecked.
	abort(1)
	r.waitState(k, "generation 1 ACKed cut, to be rechecked", cutToRecheck(1))
	// The owner resends: a recheck starts, and is held.
	tr.mu.Lock()
	tr.armed = true
	tr.mu.Unlock()
	abort(1)
	select {
	case <-tr.entered:
	case <-time.After(5 * time.Second):
		t.Fatal("the duplicate ABORT started no recheck")
	}
	// Meanwhile the owner aborts the request again: generation 2, also cut.
	abort(2)
	r.waitState(k, "generation 2 ACKed cut, to be rechecked", cutToRecheck(2))
	// The paths confirm now, and the generation 1 recheck ends: it must
	// not flip generation 2, which its drain did not cover.
	tr.set(owner, false)
	close(tr.release)
	r.waitState(k, "generation 1's recheck ended", func(s tombState) bool { return !s.rechecking })
	if s := r.state(k); s.outcome != control.AckCut {
		t.Fatalf("generation 1's recheck flipped generation 2 to %v", s.outcome)
	}
	// The owner resends generation 2's ABORT, as it does until it hears a
	// drained ACK: the recheck confirms it.
	abort(2)
	r.waitState(k, "generation 2 drained after its recheck", func(s tombState) bool {
		return s.gen == 2 && s.outcome == control.AckDrained && !s.recheck
	})
	if n := r.e.Stats().DrainsRechecked; n != 1 {
		t.Fatalf("%d drains rechecked, want 1", n)
	}
}

// A recheck asks again about every name the drain found the owner's paths
// under, even once their segments closed: marks of a path outlive it (the
// transport keeps them after the path died before its broken QP was
// replaced), and a recheck that asked only about the names open now would
// ACK drained what a closed alias's path left uncertain.
func TestRecheckAsksAboutTheNamesTheDrainSaw(t *testing.T) {
	const owner, alias, rid = "10.255.0.1:7000", "decode-alias:7000", 43
	tr := newSteeredUncertain()
	tr.set(alias, true)
	r := newRecheckEngine(t, tr)
	k := tombKey{owner, rid}
	// The drain of an owner known by an alias: set by hand, as a drain
	// with the alias's segment open would leave it.
	r.e.abortMu.Lock()
	tb := r.e.newTomb(k, true)
	tb.minGen, tb.drained, tb.outcome, tb.recheck, tb.names = 1, true, control.AckCut, true, []string{alias}
	r.e.abortMu.Unlock()
	before := tr.calls.Load()
	r.e.handleAbort(owner, control.AbortMsg{RequestID: rid, Generation: 1}.Encode())
	r.waitState(k, "the recheck ended", func(s tombState) bool { return !s.rechecking && tr.calls.Load() > before })
	if s := r.state(k); s.outcome != control.AckCut {
		t.Fatalf("a recheck ACKed %v while the closed alias's path still leaves the request uncertain", s.outcome)
	}
	// Once the alias's marks are settled, the next resend confirms it.
	tr.set(alias, false)
	r.e.handleAbort(owner, control.AbortMsg{RequestID: rid, Generation: 1}.Encode())
	r.waitState(k, "drained after the alias settled", func(s tombState) bool { return s.outcome == control.AckDrained })
}
