package engine

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"
)

// Tests of the initiator's handling of ABORT: the task index it looks the
// request's tasks up in, the drain pool it hands the waits to, and the
// bounds on the tombstones peers can make it keep.

// An ABORT looks up its request's tasks in the task index: it visits those
// and no other task in flight. It used to scan every task of every batch on
// the control plane's loop (243 us per ABORT with 100,000 tasks in flight).
func TestAbortVisitsOnlyTheTasksOfItsRequest(t *testing.T) {
	owner, init, seg, dst, src := inflightPair(t, Options{PathsPerPeer: 1, MaxRetries: -1}, 50*time.Millisecond)
	const unrelated, mine = 20_000, 3
	other := submitInFlight(t, init, seg, dst, src, 1, unrelated)
	b := submitInFlight(t, init, seg, dst, src, 7, mine)
	before := init.tasks.visited.Load()
	abortFrom(init, owner.Name(), 7, 1)
	if n := init.tasks.visited.Load() - before; n != mine {
		t.Fatalf("the ABORT of a request with %d tasks visited %d tasks (%d unrelated in flight)", mine, n, unrelated)
	}
	for rid := uint64(1000); rid < 11_000; rid++ {
		abortFrom(init, owner.Name(), rid, 1)
	}
	if n := init.tasks.visited.Load() - before; n != mine {
		t.Fatalf("10,000 ABORTs of requests without tasks visited %d tasks", n-mine)
	}
	if err := b.Wait(testDeadline(t, 10*time.Second)); err != nil {
		t.Fatal(err)
	}
	for i, r := range b.Results() {
		if r.Status != Aborted {
			t.Errorf("task %d of the aborted request ended %s", i, r.Status)
		}
	}
	if err := other.Cancel(); err != nil {
		t.Fatal(err)
	}
	_ = b.Free()
	_ = other.Free()
	if n := init.tasks.len(); n != 0 {
		t.Fatalf("the task index lists %d tasks after every batch ended", n)
	}
}

// ABORTs racing submits of their request: every task of the request either
// is found by the ABORT's handler in the task index, or sees the tombstone
// and ends ABORTED unposted; none slips through. The owner holds each WRITE
// for a while, so no task can have completed before the ABORT; a task the
// handler missed would go on (and complete, or fail when the drain cuts its
// path) instead of ending ABORTED. Many rounds, each with its own request.
func TestAbortFindsEveryTaskSubmittedConcurrently(t *testing.T) {
	owner, init, seg, dst, src := inflightPair(t, Options{PathsPerPeer: 2, MaxRetries: -1, AbortDrainTimeout: 20 * time.Millisecond}, 100*time.Millisecond)
	rounds := 20
	if testing.Short() {
		rounds = 5
	}
	for round := range rounds {
		rid := uint64(100 + round)
		const submitters, each = 4, 25
		var wg sync.WaitGroup
		batches := make([][]*Batch, submitters)
		started := make(chan struct{}, submitters)
		for g := range submitters {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range each {
					bt, err := init.AllocateBatch(1)
					if err != nil {
						t.Error(err)
						return
					}
					off := uint64(g*each+i) * 4096
					if err := bt.Submit(context.Background(), []Request{{Op: Write, Local: AddrOf(src) + off, Segment: seg,
						Remote: AddrOf(dst) + off, Length: 4096, RequestID: rid}}); err != nil {
						t.Error(err)
						return
					}
					batches[g] = append(batches[g], bt)
					if i == 0 {
						started <- struct{}{}
					}
				}
			}()
		}
		for range submitters {
			<-started // every submitter is under way
		}
		abortFrom(init, owner.Name(), rid, 1)
		wg.Wait()
		for g := range batches {
			for i, bt := range batches[g] {
				if err := bt.Wait(testDeadline(t, 10*time.Second)); err != nil {
					t.Fatal(err)
				}
				if r := bt.Results()[0]; r.Status != Aborted {
					t.Fatalf("round %d: submitter %d's task %d ended %s (%v): the ABORT missed it", round, g, i, r.Status, r.Err)
				}
				_ = bt.Free()
			}
		}
		if t.Failed() {
			return
		}
	}
	if n := init.tasks.len(); n != 0 {
		t.Fatalf("the task index lists %d tasks after every batch ended", n)
	}
}

// A flood of ABORTs, each of a request with a task whose drain has to wait
// for the owner's answer, runs on a bounded pool: the handler never starts
// a goroutine per ABORT, and never waits for a drain itself.
func TestAbortFloodRunsABoundedDrainPool(t *testing.T) {
	owner, init, seg, dst, src := inflightPair(t, Options{PathsPerPeer: 1, MaxRetries: -1, AbortDrainTimeout: 300 * time.Millisecond}, 50*time.Millisecond)
	const n = 1000
	batches := make([]*Batch, n)
	for i := range batches {
		batches[i] = submitInFlight(t, init, seg, dst, src, uint64(1000+i), 1)
	}
	base := runtime.NumGoroutine()
	start := time.Now()
	for i := range batches {
		abortFrom(init, owner.Name(), uint64(1000+i), 1)
	}
	took := time.Since(start)
	peak := runtime.NumGoroutine() - base
	init.drainMu.Lock()
	drainers, backlog := init.drainers, len(init.drainQ)
	init.drainMu.Unlock()
	t.Logf("%d ABORTs handled in %v; %d goroutines more than before, %d drainers, %d drains waiting", n, took, peak, drainers, backlog)
	if peak > maxDrainers+16 {
		t.Errorf("%d ABORTs left %d goroutines more than before (the pool has %d drainers)", n, peak, maxDrainers)
	}
	for i, b := range batches {
		if err := b.Wait(testDeadline(t, 30*time.Second)); err != nil {
			t.Fatal(err)
		}
		if r := b.Results()[0]; r.Status != Aborted {
			t.Errorf("task of request %d ended %s", 1000+i, r.Status)
		}
		_ = b.Free()
	}
	until(t, 30*time.Second, "every drain answered", func() bool {
		init.abortMu.RLock()
		defer init.abortMu.RUnlock()
		for _, tb := range allTombs(init) {
			if !tb.settled() {
				return false
			}
		}
		return true
	})
}

// ABORTs from made-up owners (any peer may send one, naming itself as it
// likes) leave a bounded number of tombstone queues, and a bounded number of
// tombstones each: each made-up name used to keep a queue of up to
// MaxTombstones for ever. The tombstones of an owner we have open survive
// the flood.
func TestAbortsFromMadeUpOwnersAreBounded(t *testing.T) {
	owner, init, _, _, _ := inflightPair(t, Options{}, 0)
	abortFrom(init, owner.Name(), 5, 1)
	for i := range 20_000 {
		abortFrom(init, fmt.Sprintf("10.%d.%d.%d:1", i>>16, (i>>8)&255, i&255), 5, 1)
	}
	for rid := uint64(1); rid <= 10_000; rid++ {
		abortFrom(init, "10.255.255.255:9", rid, 1)
	}
	init.abortMu.RLock()
	tombs, owners := init.tombCounts()
	kept := init.tombOf(tombKey{owner.Name(), 5}) != nil
	unknown := ownerTombCount(init, "10.255.255.255:9")
	init.abortMu.RUnlock()
	if owners > MaxTombstoneOwners {
		t.Errorf("ABORTs from 20,001 made-up owners left %d tombstone queues (cap %d)", owners, MaxTombstoneOwners)
	}
	if unknown > unknownOwnerTombstones {
		t.Errorf("10,000 ABORTs from one made-up owner left %d of its tombstones (cap %d)", unknown, unknownOwnerTombstones)
	}
	if tombs > MaxTombstoneOwners*unknownOwnerTombstones {
		t.Errorf("%d initiator tombstones kept", tombs)
	}
	if !kept {
		t.Error("the flood pushed out the tombstone of an owner the initiator has open")
	}
	if s := init.Stats(); s.TombstoneOwners != owners || s.AbortsDropped != 0 {
		t.Errorf("stats: %d owners, %d ABORTs dropped; want %d and 0 (every made-up owner's tombstones were settled)",
			s.TombstoneOwners, s.AbortsDropped, owners)
	}
}

// When every owner slot holds a drain in progress, an ABORT from a new owner
// is dropped unanswered and counted, never recorded over the cap.
func TestAbortFromANewOwnerIsDroppedWhenNoOwnerCanGo(t *testing.T) {
	_, init, _, _, _ := inflightPair(t, Options{}, 0)
	init.abortMu.Lock()
	init.setMaxTombOwners(4)
	for i := range 4 {
		tb := init.newTombLocked(tombKey{fmt.Sprintf("10.0.0.%d:1", i), 1})
		tb.minGen, tb.owed = 1, true // draining
	}
	init.abortMu.Unlock()
	abortFrom(init, "10.0.1.1:1", 1, 1)
	init.abortMu.RLock()
	owners := init.tombOwners.Len()
	init.abortMu.RUnlock()
	if owners != 4 || init.Stats().AbortsDropped != 1 {
		t.Fatalf("%d owners, %d ABORTs dropped; want 4 and 1", owners, init.Stats().AbortsDropped)
	}
	init.abortMu.Lock()
	init.tombOf(tombKey{"10.0.0.2:1", 1}).drained = true
	init.tombOf(tombKey{"10.0.0.2:1", 1}).owed = false
	init.abortMu.Unlock()
	abortFrom(init, "10.0.1.1:1", 1, 1) // the owner resends: now one can go
	init.abortMu.RLock()
	in := init.tombOf(tombKey{"10.0.1.1:1", 1}) != nil
	gone := init.tombOf(tombKey{"10.0.0.2:1", 1}) != nil
	init.abortMu.RUnlock()
	if !in || gone {
		t.Fatalf("after a slot settled: new owner recorded %v, settled owner kept %v", in, gone)
	}
}
