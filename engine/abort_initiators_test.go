package engine_test

// Safe abort (SAFETY.md promises 1 to 5) as initiators see it: an abort
// naming several initiators, and submits that reach an initiator after the
// ABORT did.

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
)

// An abort naming two initiators gets an ABORT_ACK from each; each one's
// tasks of the request end ABORTED and it gets an EventAborted; the range
// the owner reuses after Safe is untouched; tasks of another request id
// queued behind the aborted ones complete with their data intact.
func TestAbortNamingTwoInitiatorsStopsBothAndSparesOtherRequests(t *testing.T) {
	const (
		blk        = 1 << 20
		nAbort     = 8 // tasks of the aborted request, per initiator
		nKeep      = 4 // tasks of another request, per initiator (one per path, behind the aborted ones)
		per        = (nAbort + nKeep) * blk
		rid, other = 101, 202
	)
	// The owner sleeps before applying each WRITE, so the aborted request's
	// frames are certainly in flight when it aborts.
	owner := newEngineWith(t, engine.Options{Testing: engine.Testing{ApplyDelay: 100 * time.Millisecond}})
	inits := []*engine.Engine{newEngineWith(t, engine.Options{}), newEngineWith(t, engine.Options{})}
	dst := alloc(t, owner, len(inits)*per)
	srcs := make([][]byte, len(inits))
	segs := make([]*engine.Segment, len(inits))
	for i, in := range inits {
		srcs[i] = alloc(t, in, per)
		fillPattern(srcs[i], uint64(10+i))
		segs[i] = openSegment(t, in, owner.Name())
	}
	before := owner.Stats()
	batches := make([]*engine.Batch, len(inits))
	for i, in := range inits {
		reqs := make([]engine.Request, 0, nAbort+nKeep)
		for j := range nAbort + nKeep {
			id := uint64(rid)
			if j >= nAbort {
				id = other
			}
			reqs = append(reqs, withRID(write(srcs[i][j*blk:], segs[i], engine.AddrOf(dst)+uint64(i*per+j*blk), blk), id, 0))
		}
		batches[i] = submit(t, in, reqs...)
	}

	var res engine.AbortResult
	took := within(t, 10*time.Second, "Abort", func() {
		var err error
		res, err = owner.Abort(testCtx(t, 10*time.Second), rid, []string{inits[0].Name(), inits[1].Name()})
		if err != nil {
			t.Errorf("abort: %v", err)
		}
	})
	if !res.Safe {
		t.Fatalf("abort = %+v; want Safe", res)
	}
	t.Logf("Abort took %v; acked before returning: %v", took, res.Acked)
	// The owner reuses the aborted request's ranges at once.
	for i := range inits {
		fillByte(dst[i*per:i*per+nAbort*blk], reusedByte)
	}

	for i, in := range inits {
		results := waitBatch(t, batches[i], 60*time.Second)
		aborted := 0
		for j, r := range results {
			switch {
			case j >= nAbort:
				if r.Status != engine.Completed || r.Transferred != blk {
					t.Errorf("initiator %d, task %d of request %d: %v, %d bytes, %v; want COMPLETED", i, j, other, r.Status, r.Transferred, r.Err)
				}
			case r.Status == engine.Aborted:
				aborted++
				if !errors.Is(r.Err, engine.ErrAborted) {
					t.Errorf("initiator %d, task %d: ABORTED with %v, want ErrAborted", i, j, r.Err)
				}
			case r.Status == engine.Completed:
				t.Logf("initiator %d, task %d completed before the abort", i, j)
			default:
				t.Errorf("initiator %d, task %d of the aborted request: %v (%v); want ABORTED", i, j, r.Status, r.Err)
			}
		}
		if aborted == 0 {
			t.Errorf("initiator %d: no task of the aborted request ended ABORTED", i)
		}
		ev := nextEvent(t, in, 5*time.Second)
		if ev.Kind != engine.EventAborted || ev.Peer != owner.Name() || ev.RequestID != rid || ev.Generation != res.Generation {
			t.Errorf("initiator %d: event %+v; want ABORTED of %d at generation %d from %s", i, ev, rid, res.Generation, owner.Name())
		}
		if st := in.Stats(); st.AbortsReceived == 0 || st.TasksAborted != uint64(aborted) || st.TasksInFlight != 0 {
			t.Errorf("initiator %d: %d ABORTs received, %d tasks aborted (want %d), %d in flight", i, st.AbortsReceived, st.TasksAborted, aborted, st.TasksInFlight)
		}
		requireAll(t, fmt.Sprintf("initiator %d's aborted range, reused by the owner", i), dst[i*per:i*per+nAbort*blk], reusedByte)
		requireEqual(t, fmt.Sprintf("initiator %d's other request", i), dst[i*per+nAbort*blk:(i+1)*per], srcs[i][nAbort*blk:])
	}
	waitFor(t, 10*time.Second, "an ABORT_ACK from each initiator", func() bool {
		return owner.Stats().AbortAcks-before.AbortAcks >= 2
	})
	// A Notify from each initiator to the owner travels behind any ACK it
	// sent, and the owner's control loop handles them in order: once each
	// Notify returned, an extra ACK would be counted.
	for i, in := range inits {
		if err := in.Notify(testCtx(t, 10*time.Second), segs[i], other, nil); err != nil {
			t.Fatalf("initiator %d: notify: %v", i, err)
		}
	}
	st := owner.Stats()
	if n := st.AbortAcks - before.AbortAcks; n != 2 {
		t.Errorf("owner counted %d ABORT_ACKs, want 2 (one per initiator)", n)
	}
	if st.OwnerRefused == before.OwnerRefused {
		t.Error("the owner refused no frame of the aborted request: nothing was in flight, the test proved little")
	}
	if st.AbortsSafe-before.AbortsSafe != 1 || st.AbortsNotSafe != before.AbortsNotSafe {
		t.Errorf("owner stats: %d safe, %d not safe aborts", st.AbortsSafe-before.AbortsSafe, st.AbortsNotSafe-before.AbortsNotSafe)
	}
	t.Logf("owner: %d refused (%d in flight), %d acks unmatched", st.OwnerRefused-before.OwnerRefused,
		st.RefusedInFlight-before.RefusedInFlight, st.AcksUnmatched-before.AcksUnmatched)
}

// Once an initiator heard an ABORT, its submits of the request below the new
// generation end ABORTED unposted (the owner sees no byte and no frame of
// them), READs included, while other request ids in the same submit run;
// submits at the new generation are admitted, and a generation the owner
// never issued is refused.
func TestSubmitAfterAbortEndsAbortedUnpostedAndNewGenerationIsAdmitted(t *testing.T) {
	const blk = 1 << 20
	const rid, other = 77, 78
	p := newAbortPair(t, engine.Options{}, 4*blk)
	fillPattern(p.src, 21)
	fillPattern(p.dst[blk:2*blk], 22) // what an aborted READ would fetch
	back := alloc(t, p.init, blk)
	fillByte(back, landByte)
	dstAddr := engine.AddrOf(p.dst)

	res, err := p.owner.Abort(testCtx(t, 5*time.Second), rid, []string{p.init.Name()})
	if err != nil || !res.Safe || res.Generation != 1 {
		t.Fatalf("abort = %+v, %v; want Safe at generation 1", res, err)
	}
	if ev := nextEvent(t, p.init, 5*time.Second); ev.Kind != engine.EventAborted || ev.RequestID != rid {
		t.Fatalf("event %+v, want ABORTED of %d", ev, rid)
	}
	before := p.owner.Stats()
	results := waitBatch(t, submit(t, p.init,
		withRID(write(p.src, p.seg, dstAddr, blk), rid, 0),
		withRID(read(back, p.seg, dstAddr+blk, blk), rid, 0),
		withRID(write(p.src[2*blk:], p.seg, dstAddr+2*blk, blk), other, 0),
	), 30*time.Second)
	requireAborted(t, "WRITE of the aborted request", results[0])
	requireAborted(t, "READ of the aborted request", results[1])
	if r := results[2]; r.Status != engine.Completed {
		t.Fatalf("WRITE of another request: %v (%v)", r.Status, r.Err)
	}
	requireAll(t, "owner range of the aborted WRITE", p.dst[:blk], 0)
	requireAll(t, "initiator range of the aborted READ", back, landByte)
	requireEqual(t, "owner range of the other request", p.dst[2*blk:3*blk], p.src[2*blk:3*blk])
	after := p.owner.Stats()
	if after.OwnerRefused != before.OwnerRefused || after.OwnerBytesIn-before.OwnerBytesIn != blk || after.OwnerBytesOut != before.OwnerBytesOut {
		t.Errorf("owner saw the aborted tasks: refused %d -> %d, bytes in +%d (want %d), bytes out +%d (want 0)",
			before.OwnerRefused, after.OwnerRefused, after.OwnerBytesIn-before.OwnerBytesIn, blk, after.OwnerBytesOut-before.OwnerBytesOut)
	}

	// The new generation is admitted, both ways.
	transfer(t, p.init, 30*time.Second,
		withRID(write(p.src, p.seg, dstAddr, blk), rid, res.Generation),
		withRID(read(back, p.seg, dstAddr+blk, blk), rid, res.Generation))
	requireEqual(t, "WRITE at the new generation", p.dst[:blk], p.src[:blk])
	requireEqual(t, "READ at the new generation", back, p.dst[blk:2*blk])

	// A generation the owner never issued is refused by the owner.
	r, err := p.init.Transfer(testCtx(t, 30*time.Second), []engine.Request{
		withRID(write(p.src[3*blk:], p.seg, dstAddr+3*blk, blk), rid, res.Generation+1)})
	if err == nil || !errors.Is(err, engine.ErrRefused) || r[0].Status == engine.Completed {
		t.Fatalf("WRITE at generation %d (never issued): %+v, %v; want refused", res.Generation+1, r, err)
	}
	requireAll(t, "owner range of the refused WRITE", p.dst[3*blk:], 0)
}
