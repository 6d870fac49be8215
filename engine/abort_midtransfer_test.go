package engine_test

// Abort in the middle of a READ or a WRITE: nothing of the reused memory is
// sent, nothing lands in it once Abort said Safe; with the protection off the
// WRITE does corrupt it.

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
)

// An owner that aborted a request refuses READs of it too. With no
// initiator named the initiator learns of the abort from that refusal: the
// READ ends ABORTED having moved nothing, an EventAborted tells the
// application, and the next READ of it ends ABORTED without reaching the
// owner. The new generation is served.
func TestOwnerRefusesReadsOfAnAbortedRequest(t *testing.T) {
	const size = 1 << 20
	const rid = 404
	p := newAbortPair(t, engine.Options{}, size)
	fillPattern(p.dst, 41)
	fillByte(p.src, landByte)
	res, err := p.owner.Abort(testCtx(t, 5*time.Second), rid, nil)
	if err != nil || !res.Safe {
		t.Fatalf("abort = %+v, %v", res, err)
	}
	before := p.owner.Stats()
	req := withRID(read(p.src, p.seg, engine.AddrOf(p.dst), size), rid, 0)
	requireAborted(t, "READ refused by the owner", waitBatch(t, submit(t, p.init, req), 30*time.Second)[0])
	requireAll(t, "initiator buffer after the refused READ", p.src, landByte)
	mid := p.owner.Stats()
	if mid.OwnerRefused == before.OwnerRefused || mid.OwnerBytesOut != before.OwnerBytesOut {
		t.Errorf("owner: refused %d -> %d, bytes out %d -> %d; want a refusal and no byte out",
			before.OwnerRefused, mid.OwnerRefused, before.OwnerBytesOut, mid.OwnerBytesOut)
	}
	ev := nextEvent(t, p.init, 5*time.Second)
	if ev.Kind != engine.EventAborted || ev.RequestID != rid || ev.Peer != p.owner.Name() || ev.Generation != res.Generation {
		t.Errorf("event %+v; want ABORTED of %d at generation %d", ev, rid, res.Generation)
	}
	// Learned: the next READ of it stops at the initiator.
	requireAborted(t, "second READ", waitBatch(t, submit(t, p.init, req), 30*time.Second)[0])
	if after := p.owner.Stats(); after.OwnerRefused != mid.OwnerRefused {
		t.Errorf("the second READ reached the owner (%d more refusals)", after.OwnerRefused-mid.OwnerRefused)
	}
	transfer(t, p.init, 30*time.Second, withRID(read(p.src, p.seg, engine.AddrOf(p.dst), size), rid, res.Generation))
	requireEqual(t, "READ at the new generation", p.src, p.dst)
}

// A large READ aborted mid-way: once Abort reported Safe the owner reuses
// the range, and not one byte of the new content reaches the initiator; the
// task ends ABORTED.
func TestAbortMidReadNeverSendsReusedMemory(t *testing.T) {
	size := 256 << 20
	if testing.Short() {
		size = 64 << 20
	}
	const rid = 405
	p := newAbortPair(t, engine.Options{}, size)
	fillByte(p.dst, oldByte)
	fillByte(p.src, landByte)
	b := submit(t, p.init, withRID(read(p.src, p.seg, engine.AddrOf(p.dst), size), rid, 0))
	waitFor(t, 30*time.Second, "first bytes read", func() bool {
		r, _ := b.Status(0)
		return p.owner.Stats().OwnerBytesOut > 0 || r.Status.Final()
	})
	took := p.requireSafeAbort(t, rid)
	fillByte(p.dst, reusedByte)
	r := waitBatch(t, b, 60*time.Second)[0]
	t.Logf("Abort took %v; task %v after %d of %d bytes", took, r.Status, r.Transferred, size)
	switch r.Status {
	case engine.Aborted:
		if !errors.Is(r.Err, engine.ErrAborted) {
			t.Errorf("ABORTED with %v, want ErrAborted", r.Err)
		}
	case engine.Completed:
		t.Log("the READ completed before the abort: nothing was in flight")
	default:
		t.Errorf("task %v (%v); want ABORTED", r.Status, r.Err)
	}
	if i := bytes.IndexByte(p.src, reusedByte); i >= 0 {
		t.Fatalf("initiator byte %d holds the owner's reused content %#02x: read after Abort reported Safe", i, reusedByte)
	}
}

// A 256 MiB WRITE slowed by the owner (ApplyDelay: each frame waits after
// admission) is aborted after its first bytes landed. With the protection
// on, Abort reports Safe at once, the owner reuses the range, and when the
// initiator's task ended ABORTED the range still holds only the new content:
// the frames in flight were refused. With the protection off (UnsafeAbort on
// both engines: no refusal, ACK on "heard") the same check must find the old
// request's bytes in the reused range, showing that the check can fail. Each
// path's first gathered write holds four 1 MiB frames and the owner applies
// one per ApplyDelay, so frames land at least 2*ApplyDelay after the abort:
// the unsafe run's corruption is deterministic.
func TestAbortMidWriteFencesTheReusedRangeAndUnsafeAbortDoesNot(t *testing.T) {
	const delay = 250 * time.Millisecond
	size := 256 << 20
	if testing.Short() {
		size = 64 << 20
	}
	for _, unsafe := range []bool{false, true} {
		name := map[bool]string{false: "protected", true: "unsafe"}[unsafe]
		t.Run(name, func(t *testing.T) {
			const rid = 9
			p := newAbortPair(t, engine.Options{Testing: engine.Testing{UnsafeAbort: unsafe, ApplyDelay: delay}}, size)
			fillByte(p.src, oldByte)
			b := submit(t, p.init, withRID(write(p.src, p.seg, engine.AddrOf(p.dst), size), rid, 0))
			waitFor(t, 30*time.Second, "first frame applied", func() bool { return p.owner.Stats().OwnerBytesIn > 0 })

			took := p.requireSafeAbort(t, rid)
			start := time.Now()
			fillByte(p.dst, reusedByte)
			fillTook := time.Since(start)
			r := waitBatch(t, b, 60*time.Second)[0]
			st := p.owner.Stats()
			old := bytes.Count(p.dst, []byte{oldByte})
			t.Logf("Abort took %v, refilling %d MiB %v; task %v after %d bytes; owner: %d bytes in, %d refused, %d refused in flight; %d old bytes in the reused range",
				took, size>>20, fillTook, r.Status, r.Transferred, st.OwnerBytesIn, st.OwnerRefused, st.RefusedInFlight, old)
			if r.Status != engine.Aborted || !errors.Is(r.Err, engine.ErrAborted) {
				t.Errorf("task %v (%v); want ABORTED", r.Status, r.Err)
			}
			if unsafe {
				if old == 0 {
					t.Errorf("with the protection off no byte of the aborted WRITE landed in the reused range: the protected run's check proves nothing")
				}
				return
			}
			requireAll(t, "reused range after a Safe abort", p.dst, reusedByte)
			if st.OwnerRefused == 0 && st.RefusedInFlight == 0 {
				t.Error("the owner refused nothing: no frame was in flight at the abort")
			}
		})
	}
}
