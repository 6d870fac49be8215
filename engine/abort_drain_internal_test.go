package engine

import (
	"context"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/control"
)

// ownerInitiatorPair starts an owner (with ApplyDelay, so WRITEs sit admitted at
// the owner for a while) and an initiator with opts, and a 1 MiB buffer on
// each; the initiator has the owner open.
func ownerInitiatorPair(t *testing.T, opts Options, delay time.Duration) (owner, init *Engine, seg *Segment, dst, src []byte) {
	t.Helper()
	// tcp: ApplyDelay, which these tests rest on, slows only tcp's copies.
	opts.Host, opts.IgnoreEnv, opts.Protocol = "127.0.0.1", true, "tcp"
	oo := opts
	oo.Testing.ApplyDelay = delay
	var err error
	if owner, err = New(oo); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = owner.Close() })
	if init, err = New(opts); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = init.Close() })
	if dst, err = owner.AllocBuffer(1<<20, "cpu"); err != nil {
		t.Fatal(err)
	}
	if src, err = init.AllocBuffer(1<<20, "cpu"); err != nil {
		t.Fatal(err)
	}
	if seg, err = init.OpenSegment(context.Background(), owner.Name()); err != nil {
		t.Fatal(err)
	}
	return owner, init, seg, dst, src
}

// TestAbortLearnedFromRefusalStillDrainsBeforeACK: an initiator that learns
// of an abort from the owner's refusal (the data path often outruns the
// ABORT) must still drain the request's other transfers before it answers
// the ABORT. It used to record the abort as drained and ACK at once while a
// task of the request was still on the wire.
func TestAbortLearnedFromRefusalStillDrainsBeforeACK(t *testing.T) {
	owner, init, seg, dst, src := ownerInitiatorPair(t, Options{PathsPerPeer: 2}, 50*time.Millisecond)
	ctx := context.Background()
	const rid = 77
	req := func(i int) Request {
		return Request{Op: Write, Local: AddrOf(src) + uint64(i*4096), Segment: seg,
			Remote: AddrOf(dst) + uint64(i*4096), Length: 4096, RequestID: rid}
	}
	b, err := init.AllocateBatch(2)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = b.Free() }()
	if err := b.Submit(ctx, []Request{req(0)}); err != nil { // admitted, then held by ApplyDelay
		t.Fatal(err)
	}
	waitAdmitted(t, owner, init, rid)
	gen, _, err := owner.reqs.Abort(rid, false) // refusal in force; no ABORT sent yet
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Submit(ctx, []Request{req(1)}); err != nil { // refused: the initiator learns
		t.Fatal(err)
	}
	until(t, 10*time.Second, "the initiator's tombstone from the refusal", func() bool {
		init.abortMu.RLock()
		defer init.abortMu.RUnlock()
		return init.tombOf(tombKey{owner.Name(), rid}) != nil
	})
	pa := &pendingAbort{rid: rid, gen: gen, wait: map[string]bool{init.Name(): true}, drainedOnly: true, done: make(chan struct{})}
	owner.pendMu.Lock()
	owner.pending[abortKey{rid, gen}] = pa
	owner.pendMu.Unlock()
	_ = owner.plane.Send(init.Name(), control.MsgAbort, control.AbortMsg{RequestID: rid, Generation: gen}.Encode())
	select {
	case <-pa.done:
	case <-time.After(10 * time.Second):
		t.Fatal("no ABORT_ACK")
	}
	for i, r := range b.Results() {
		if !r.Status.Final() {
			t.Errorf("task %d is %s when the ABORT_ACK arrived: the ACK did not wait for the drain", i, r.Status)
		}
	}
	_ = b.Wait(ctx)
}

// TestCutDuringDrainDoesNotAbortOtherRequests: when a drain times out and
// cuts a path, another request's slice on that path fails as a connection
// error, not as an abort: it used to end ABORTED, with a tombstone and an
// event for a request the owner never aborted.
func TestCutDuringDrainDoesNotAbortOtherRequests(t *testing.T) {
	owner, init, seg, dst, src := ownerInitiatorPair(t, Options{PathsPerPeer: 1, MaxRetries: -1, AbortDrainTimeout: 20 * time.Millisecond}, 300*time.Millisecond)
	ctx := context.Background()
	req := func(i int, rid uint64) Request {
		return Request{Op: Write, Local: AddrOf(src) + uint64(i*4096), Segment: seg,
			Remote: AddrOf(dst) + uint64(i*4096), Length: 4096, RequestID: rid}
	}
	b, err := init.AllocateBatch(2)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = b.Free() }()
	if err := b.Submit(ctx, []Request{req(0, 1), req(1, 2)}); err != nil {
		t.Fatal(err)
	}
	waitAdmitted(t, owner, init, 1) // request 1 sits admitted at the owner
	if res, err := owner.Abort(ctx, 1, []string{init.Name()}); err != nil || !res.Safe {
		t.Fatalf("abort = %+v, %v", res, err)
	}
	if err := b.Wait(testDeadline(t, 10*time.Second)); err != nil {
		t.Fatal(err)
	}
	res := b.Results()
	if res[0].Status != Aborted {
		t.Errorf("task of the aborted request: %s, want ABORTED", res[0].Status)
	}
	if res[1].Status == Aborted {
		t.Errorf("task of request 2, never aborted, ended ABORTED: %v", res[1].Err)
	}
	init.abortMu.RLock()
	tb := init.tombOf(tombKey{owner.Name(), 2})
	init.abortMu.RUnlock()
	if tb != nil {
		t.Errorf("tombstone for request 2, never aborted: %+v", tb)
	}
}

// TestOlderAbortIsAnsweredWithItsOwnGeneration: after aborts at generations
// 1 and 2, a resent ABORT at generation 1 is answered at generation 1 (the
// drain at 2 covers it); it used to be answered at 2, so the owner waiting
// for 1 never matched it.
func TestOlderAbortIsAnsweredWithItsOwnGeneration(t *testing.T) {
	owner, init, _, _, _ := ownerInitiatorPair(t, Options{}, 0)
	const rid = 5
	pas := map[uint32]*pendingAbort{}
	for gen := uint32(1); gen <= 2; gen++ {
		pas[gen] = &pendingAbort{rid: rid, gen: gen, wait: map[string]bool{init.Name(): true}, drainedOnly: true, done: make(chan struct{})}
		owner.pendMu.Lock()
		owner.pending[abortKey{rid, gen}] = pas[gen]
		owner.pendMu.Unlock()
	}
	send := func(gen uint32) {
		_ = owner.plane.Send(init.Name(), control.MsgAbort, control.AbortMsg{RequestID: rid, Generation: gen}.Encode())
	}
	send(2)
	select {
	case <-pas[2].done:
	case <-time.After(10 * time.Second):
		t.Fatal("no ABORT_ACK at generation 2")
	}
	send(1)
	select {
	case <-pas[1].done:
	case <-time.After(10 * time.Second):
		t.Fatal("the ABORT at generation 1 was never answered at generation 1")
	}
}

func testDeadline(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}
