package pd

// The fence rows with the writer paused by SIGSTOP or killed by SIGKILL in
// the middle of a request (SAFETY.md promise 7: "whatever its initiator
// does next"). The prefill passes no request id; decode fences the
// request's pages and reuses them at once.

import (
	"context"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/internal/childproc"
	"github.com/kvferry/kvferry/internal/fakeverbs"
)

// defaultFenceGrace is Options.FenceGrace's default, which decode keeps:
// how long a Fence waits for a planner's FENCE_ACK, and so all a paused
// writer may cost it.
const defaultFenceGrace = 50 * time.Millisecond

// fenceSignalRig is decode and the prefill of a signal row: two pages of
// decode's, which a request A writes (one layer of two pages) and decode
// then fences.
type fenceSignalRig struct {
	rdma bool
	d    *engine.Engine
	// closeDecode closes d once (see newDecode).
	closeDecode func() error
	pcfg        prefillConfig
	pp          *prefillProc
	pages       [2][]byte
	pageSize    int
	slice       int
	rid         uint64 // the last request id used
	// freeMem frees the pages' memory once (see allocDecode).
	freeMem func() error
	g0, f0  int // decode's goroutines and file descriptors before it started
}

// newFenceSignalRig starts decode and the prefill (no request ids). Over
// tcp decode applies each 256 KiB frame after 5 ms, so frames the prefill
// sent wait in decode's socket; over rdma decode's NICs place each 64 KiB
// of a WRITE 2 ms apart, so posted WRITEs go on landing while the prefill
// is stopped. Either way a request of 8 MiB takes over 100 ms to land.
func newFenceSignalRig(t *testing.T, rdma bool) *fenceSignalRig {
	t.Helper()
	r := &fenceSignalRig{rdma: rdma, pageSize: 4 << 20, slice: 256 << 10}
	if rdma {
		r.slice = 1 << 20
	}
	r.pcfg = prefillConfig{slice: r.slice, paths: 1, workers: 4, srcSize: 2 * r.pageSize, noRID: true}
	if rdma {
		r.pcfg = rdmaPrefill(t, r.pcfg)
	}
	// Leak baseline, before anything of the row exists.
	r.g0, r.f0, _ = leakBaseline(t, r.pcfg.decodeOptions())
	dopts := r.pcfg.decodeOptions()
	if !rdma {
		dopts.Testing.ApplyDelay = 5 * time.Millisecond
	}
	d, closeDecode := newDecode(t, dopts)
	r.d, r.closeDecode = d, closeDecode
	mem, freeMem := allocDecode(t, d, 2*r.pageSize)
	r.freeMem = freeMem
	r.pages = [2][]byte{mem[:r.pageSize:r.pageSize], mem[r.pageSize:]}
	if rdma {
		fakeverbs.SlowPlacement(t, 2000)
	}
	r.pp = startPrefill(t, r.pcfg, d.Name())
	return r
}

// send asks pp to write a new request into the first n pages; it returns
// the request's id and outcome channel.
func (r *fenceSignalRig) send(t *testing.T, pp *prefillProc, n int) (uint64, <-chan outcome) {
	r.rid++
	addrs := make([]uint64, n)
	for i := range addrs {
		addrs[i] = engine.AddrOf(r.pages[i])
	}
	return r.rid, pp.send(t, r.rid, 0, 1, n, r.pageSize, addrs)
}

// landed counts the bytes of request rid's pattern in the pages.
func (r *fenceSignalRig) landed(rid uint64) int {
	return landedBytes(r.pages[0], holder{tag: rid}, 0) + landedBytes(r.pages[1], holder{tag: rid, pos: 1}, 0)
}

// fence fences both pages and checks that the call is Safe and does not
// wait for the stopped or dead prefill (its deadline) but only FenceGrace.
func (r *fenceSignalRig) fence(t *testing.T) engine.FenceResult {
	t.Helper()
	const deadline = 5 * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), deadline)
	defer cancel()
	ranges := []engine.FenceRange{
		{Addr: engine.AddrOf(r.pages[0]), Len: uint64(r.pageSize)},
		{Addr: engine.AddrOf(r.pages[1]), Len: uint64(r.pageSize)},
	}
	called := time.Now()
	fr, err := r.d.Fence(ctx, ranges)
	took := time.Since(called)
	if err != nil || !fr.Safe {
		t.Fatalf("Fence with the prefill stopped or dead = %+v, %v after %v; want Safe", fr, err, took)
	}
	// Not a performance bound: a Fence that waited for the stopped or dead
	// prefill would run to its deadline; one that waits FenceGrace (50 ms)
	// returns far before half of it, even on a loaded machine.
	if bound := deadline / 2; took > bound {
		t.Errorf("Fence took %v with the prefill stopped or dead: it waited for the prefill, not FenceGrace (%v); deadline %v",
			took, defaultFenceGrace, deadline)
	}
	if slices.Contains(fr.Acked, r.pp.name) {
		t.Errorf("Fence acked by %s, which is stopped or dead", r.pp.name)
	}
	t.Logf("Fence: Safe after %v, epoch %d, told %v, acked %v, cut %v", took.Round(time.Microsecond), fr.Epoch, fr.Told, fr.Acked, fr.Cut)
	return fr
}

// reuse makes both pages decode's, with its own pattern after request rid.
func (r *fenceSignalRig) reuse(rid uint64) {
	for i, p := range r.pages {
		fillSlot(p, holder{tag: reuseTag(rid), pos: i}, 0)
	}
}

// check compares page i with h's pattern; hist names the earlier
// holders whose late bytes would be corruption.
func (r *fenceSignalRig) check(t *testing.T, when string, i int, h holder, hist ...holder) {
	t.Helper()
	if dmg := checkSlot(r.pages[i], h, 0, hist); dmg.bad != 0 {
		t.Errorf("%s: page %d (holder %#x): %d bytes overwritten (%d of them an earlier request's), first at byte %d: %#016x, want %#016x",
			when, i, h.tag, dmg.bad, dmg.old, dmg.at, dmg.got, dmg.exp)
	}
}

// await returns the outcome on ch, failing the test after 30 s.
func await(t *testing.T, what string, ch <-chan outcome) outcome {
	t.Helper()
	o, ok := childproc.Receive(ch, 30*time.Second)
	if !ok {
		t.Fatalf("%s: no outcome within 30s", what)
	}
	return o
}

// startA sends request A into both pages and waits until its first bytes
// landed: the prefill is certainly in the middle of it.
func (r *fenceSignalRig) startA(t *testing.T) (uint64, <-chan outcome) {
	t.Helper()
	a, chA := r.send(t, r.pp, 2)
	if o := waitFor(t, 30*time.Second, "request A's first bytes to land", chA, func() bool { return r.landed(a) > 0 }); o != nil {
		t.Fatalf("request A ended before any byte of it landed: %s", o.line)
	}
	return a, chA
}

// TestFenceIsSafeWithThePrefillStopped: over tcp.
func TestFenceIsSafeWithThePrefillStopped(t *testing.T) { testFenceStopped(t, false) }

// TestRDMAFenceIsSafeWithThePrefillStopped: over rdma (the fake, or real
// devices with KVFERRY_TEST_RDMA=1).
func TestRDMAFenceIsSafeWithThePrefillStopped(t *testing.T) { testFenceStopped(t, true) }

// testFenceStopped: the prefill, passing no request id, is stopped by
// SIGSTOP in the middle of request A, with A's bytes still going into
// decode's pages (tcp: frames waiting in decode's socket; rdma: WRITEs
// decode's NICs place). Decode fences both pages: Safe, without waiting for
// the stopped prefill beyond FenceGrace. It reuses the pages at once, and
// tells the still stopped prefill of request B into the first page (the
// normal flow: after Fence returned). Then SIGCONT. A ends refused as
// fenced; the second page, which nothing else writes, keeps decode's
// pattern; B completes intact, or is refused as fenced (below); request C
// into both pages, sent once B ended, completes intact. Several rounds,
// to measure how often B is refused.
//
// B races the fence notice: the prefill, resumed, finds B's line on its
// stdin and the FENCE notice on its control socket, both sent while it
// was stopped, and handles them in either order. Planned before the
// prefill handled the notice, B is stamped with the old fence epoch, so
// decode refuses it as fenced (safely: nothing of it lands) and the
// prefill refreshes decode's descriptor, so C passes. A promise 7 "normal
// flow" assumes the writer acknowledged the fence within FenceGrace; a
// stopped writer cannot, which is the case Fence's doc names ("learns the
// epoch ... from the refusal of its first stale transfer").
func testFenceStopped(t *testing.T, rdma bool) {
	rounds := 8
	if testing.Short() {
		rounds = 3
	}
	if rdma && fakeverbs.Real() {
		rounds = 2
	}
	r := newFenceSignalRig(t, rdma)
	pp := r.pp
	raced := 0
	for round := range rounds {
		began := time.Now()
		a, chA := r.startA(t)
		pp.signal(t, syscall.SIGSTOP)
		// The hazard: decode goes on taking the stopped prefill's bytes.
		atStop := r.landed(a)
		if o := waitFor(t, 2*time.Second, "more of request A to land after SIGSTOP", chA, func() bool { return r.landed(a) > atStop }); o != nil {
			t.Fatalf("request A ended with the prefill stopped: %s", o.line)
		}
		if got := r.landed(a); got >= 2*r.pageSize-4*r.slice {
			t.Fatalf("%d of request A's %d bytes landed already: too little left in flight to test", got, 2*r.pageSize)
		}
		r.fence(t)
		r.reuse(a)
		mine := [2]holder{{tag: reuseTag(a)}, {tag: reuseTag(a), pos: 1}}
		b, chB := r.send(t, pp, 1)
		pp.signal(t, syscall.SIGCONT)
		resumed := time.Since(began)

		oA := await(t, "request A", chA)
		aEnded := time.Since(began)
		if !oA.fencedOnly() {
			t.Errorf("round %d: request A, fenced in its middle, ended %s; want refused as fenced: %s", round, oA.status, oA.line)
		}
		// Nothing of A is in flight any more: its tasks ended. The second
		// page is decode's alone.
		r.check(t, "after A ended", 1, mine[1], holder{tag: a, pos: 1})
		oB := await(t, "request B", chB)
		bEnded := time.Since(began)
		switch {
		case oB.status == engine.Completed.String():
			// B's frames follow A's on the path: the first page shows B's
			// landing, A's late bytes would be overwritten; the second
			// page above is the witness for A.
			r.check(t, "B completed", 0, holder{tag: b}, holder{tag: a})
		case oB.fencedOnly():
			raced++
			t.Logf("round %d: request B, told after the fence while the prefill was stopped, raced the fence notice and was refused: %s", round, oB.line)
			r.check(t, "B refused", 0, mine[0], holder{tag: a})
		default:
			t.Errorf("round %d: request B ended %s; want COMPLETED, or refused as fenced: %s", round, oB.status, oB.line)
		}
		c, chC := r.send(t, pp, 2)
		if oC := await(t, "request C", chC); oC.status != engine.Completed.String() {
			t.Errorf("round %d: request C, sent after B ended, ended %s: %s", round, oC.status, oC.line)
		}
		r.check(t, "C completed", 0, holder{tag: c}, holder{tag: a}, holder{tag: b})
		r.check(t, "C completed", 1, holder{tag: c, pos: 1}, holder{tag: a, pos: 1})
		t.Logf("round %d: SIGCONT after %v; A ended after %v, B (%s) after %v, C after %v", round, resumed.Round(time.Millisecond),
			aEnded.Round(time.Millisecond), oB.status, bEnded.Round(time.Millisecond), time.Since(began).Round(time.Millisecond))
	}
	t.Logf("%d of %d requests B (told after a fence, while the prefill was stopped) raced the fence notice and were refused as fenced", raced, rounds)

	// Every fence is acknowledged once the prefill runs again (the notice
	// waits on its connection, and the owner matches late ACKs of its last
	// 1024 fences).
	waitUntil(5*time.Second, 5*time.Millisecond, func() bool { return r.d.Stats().FenceAcks >= uint64(rounds) })
	st := r.d.Stats()
	t.Logf("decode: fences safe %d not safe %d, FENCE_ACKs %d (unmatched %d), refused %d (at admission as fenced %d, mid-frame %d), rdma fences %d",
		st.FencesSafe, st.FencesNotSafe, st.FenceAcks, st.FenceAcksUnmatched, st.OwnerRefused, st.FenceRefused, st.RefusedInFlight, st.RDMAFences)
	if st.FencesSafe != uint64(rounds) || st.FencesNotSafe != 0 || st.FenceAcks != uint64(rounds) {
		t.Errorf("decode counted %d safe and %d unsafe fences, %d FENCE_ACKs; want %d, 0 and %d", st.FencesSafe, st.FencesNotSafe, st.FenceAcks, rounds, rounds)
	}
	bye := pp.finish(t, 30*time.Second)
	t.Logf("prefill: %v", bye)
	if bye["inflight"] != 0 || bye["tasks_fenced"] == 0 {
		t.Errorf("prefill: %d tasks in flight, %d fenced at the end; want 0 and some", bye["inflight"], bye["tasks_fenced"])
	}
	r.closeAndCheck(t, "C", holder{tag: r.rid}, holder{tag: r.rid, pos: 1})
}

// closeAndCheck closes decode (every connection cut, no goroutine of its
// left: nothing can land afterwards), checks the pages a last time, and
// checks decode for leaks.
func (r *fenceSignalRig) closeAndCheck(t *testing.T, who string, h0, h1 holder) {
	t.Helper()
	if err := r.closeDecode(); err != nil {
		t.Errorf("decode close: %v", err)
	}
	r.check(t, who+", at the end", 0, h0)
	r.check(t, who+", at the end", 1, h1)
	if err := r.freeMem(); err != nil {
		t.Error(err)
	}
	checkLeaks(t, r.g0, r.f0)
}

// TestFenceIsSafeWithThePrefillKilled: over tcp.
func TestFenceIsSafeWithThePrefillKilled(t *testing.T) { testFenceKilled(t, false) }

// TestRDMAFenceIsSafeWithThePrefillKilled: over rdma.
func TestRDMAFenceIsSafeWithThePrefillKilled(t *testing.T) { testFenceKilled(t, true) }

// testFenceKilled: the prefill, passing no request id, is killed by
// SIGKILL in the middle of request A. Decode fences both pages: Safe,
// within FenceGrace and slack. It reuses them at once; a new prefill
// writes request C into them, which completes intact, and after decode
// closed no byte of A is found.
func testFenceKilled(t *testing.T, rdma bool) {
	r := newFenceSignalRig(t, rdma)
	a, chA := r.startA(t)
	pp := r.pp
	pp.signal(t, syscall.SIGKILL)
	_ = pp.waitKilled(t)
	select {
	case o := <-chA:
		t.Fatalf("the killed prefill reported request A: %s", o.line)
	default:
	}
	atKill := r.landed(a)
	if atKill >= 2*r.pageSize-4*r.slice {
		t.Fatalf("%d of request A's %d bytes landed already: too little left in flight to test", atKill, 2*r.pageSize)
	}
	r.fence(t)
	atFence := r.landed(a)
	r.reuse(a)
	t.Logf("%d KiB of request A landed when the prefill was killed, %d KiB when Fence returned", atKill>>10, atFence>>10)
	mine := [2]holder{{tag: reuseTag(a)}, {tag: reuseTag(a), pos: 1}}

	// The next request, from a new prefill: it opens decode's segment
	// after the fence, and passes.
	pp2 := startPrefill(t, r.pcfg, r.d.Name())
	r.check(t, "before C", 0, mine[0], holder{tag: a})
	r.check(t, "before C", 1, mine[1], holder{tag: a, pos: 1})
	c, chC := r.send(t, pp2, 2)
	if oC := await(t, "request C", chC); oC.status != engine.Completed.String() {
		t.Errorf("request C, after the fence, ended %s: %s", oC.status, oC.line)
	}
	pp2.finish(t, 30*time.Second)
	st := r.d.Stats()
	t.Logf("decode: fences safe %d not safe %d, refused %d (at admission as fenced %d, mid-frame %d), rdma fences %d",
		st.FencesSafe, st.FencesNotSafe, st.OwnerRefused, st.FenceRefused, st.RefusedInFlight, st.RDMAFences)
	if st.FencesSafe != 1 || st.FencesNotSafe != 0 {
		t.Errorf("decode counted %d safe and %d unsafe fences; want 1 and 0", st.FencesSafe, st.FencesNotSafe)
	}
	r.closeAndCheck(t, "C", holder{tag: c}, holder{tag: c, pos: 1})
}

// waitFor waits up to d for cond, polling, and returns nil; or the
// outcome of the request whose outcome arrives on ch, if it ends first.
func waitFor(t *testing.T, d time.Duration, what string, ch <-chan outcome, cond func() bool) *outcome {
	t.Helper()
	for end := time.Now().Add(d); !cond(); {
		select {
		case o := <-ch:
			return &o
		case <-time.After(200 * time.Microsecond):
		}
		if time.Now().After(end) {
			t.Fatalf("no %s within %v", what, d)
		}
	}
	return nil
}
