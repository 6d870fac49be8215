package pd

// SAFETY.md's fence rows (promise 7) across two processes: the prefill
// passes no request id (0 on every transfer, as SGLang's and vLLM's
// Mooncake wrappers do), so decode cannot abort its requests; it protects
// the pages of a request it gives up with Engine.Fence of the request's
// slots (every page in every layer) and reuses them at once. With the
// protection off (Options.Testing.UnsafeFence) the prefill's bytes in
// flight land in reused slots; with it on none do, and the next requests,
// which the prefill hears of only after the fence returned, never fail.

import (
	"context"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
)

// fencing makes a stress shape a fence row's: decode fences instead of
// aborting. No request is given up before the prefill hears of it (a
// writer told of pages after their fence writes them: that is the next
// request's normal flow).
func fencing(cfg stressConfig) stressConfig {
	cfg.fence = true
	cfg.before, cfg.during, cfg.after = 0, 25, 10
	return cfg
}

// fenceStress is the tcp fence rows' shape.
func fenceStress() stressConfig { return fencing(baseStress()) }

// rdmaFenceStress is the rdma fence rows' shape.
func rdmaFenceStress() stressConfig { return fencing(rdmaStress()) }

// TestFenceStressUnprotectedFindsCorruption: SAFETY.md's row "tcp, Fence
// of the pages, writer passes no request id, protection off". Fence reports
// Safe at once and refuses nothing; the prefill's frames still on their way
// land in slots decode had reused. The run must find a given-up request's
// pattern in a reused slot, or the protected row proves nothing.
func TestFenceStressUnprotectedFindsCorruption(t *testing.T) {
	cfg := fenceStress()
	cfg.requests = 300
	// A long pause per frame: when decode fences, frames are certainly
	// still on the wire.
	cfg.applyDelay = 2 * time.Millisecond
	runUnprotected(t, cfg, "given-up request's", "the unsafe fence should let late writes land")
}

// TestFenceStressIsSafe: SAFETY.md's row "tcp, Fence on". Decode fences
// the pages of requests it gives up at random moments (fixed seed) while
// the prefill, passing no request id, writes them; it reuses them at once
// and hands them to later requests. No byte of a slot's current holder is
// ever overwritten, every fence is Safe, some fences refused frames in
// flight (the prefill's tasks ended refused as fenced), and no request the
// prefill heard of after the fence of its pages fails.
func TestFenceStressIsSafe(t *testing.T) {
	r := runWithFramesInFlight(t, fenceStress(), requests(3000, 1000))
	checkProtectedFence(t, r)
	if r.decode.OwnerRefused == 0 {
		t.Errorf("decode refused no frame (fence refusals at admission %d): no fence struck bytes in flight", r.decode.FenceRefused)
	}
}

// checkProtectedFence: what a protected fence row must show. Requests not
// given up that did not complete (the next requests into fenced pages
// among them) already failed the run in runStress, one error each.
func checkProtectedFence(t *testing.T, r *stressResult) {
	t.Helper()
	checkSafeGiveUps(t, r, "a given-up request's", "with the fence on", "fences", r.fenceNotSafe, r.fences)
	if r.notCompleted != 0 {
		t.Errorf("%d requests not given up failed (%d of %d fences returned without the prefill's FENCE_ACK); want 0", r.notCompleted, r.fenceUnacked, r.fences)
	}
	if r.prefill["tasks_fenced"] == 0 || r.outcomes[fateDuring]["FENCED"] == 0 {
		t.Errorf("no task of the prefill was refused as fenced (during: %v): the race this test is for never happened", r.outcomes[fateDuring])
	}
}

// TestFenceBeforeThePrefillPlannedLetsLaterLayersLand: the limit of
// promise 7, and why the other fence rows fence a request only once the
// prefill said "planned". With the fence on, decode fences requests while
// they are written without waiting for that: a layer the prefill submits
// after the fence (or a whole request whose line it reads after it) is
// planned after the fence and passes, by the promise, into pages decode
// reused. The run must find such bytes. A writer that passes no request id
// and plans a request's transfers over time (layer by layer, or chunk by
// chunk as a chunked prefill does) is thus protected by Fence only for
// what it planned before the call; the rest needs the writer to stop.
func TestFenceBeforeThePrefillPlannedLetsLaterLayersLand(t *testing.T) {
	cfg := fenceStress()
	cfg.fenceEarly = true
	cfg.during, cfg.after = 50, 5
	r := runWithFramesInFlight(t, cfg, 300)
	requireLateWritesFound(t, r, "fenced request's", "layers planned after a fence should pass")
	if r.fenceNotSafe != 0 {
		t.Errorf("%d of %d fences not Safe", r.fenceNotSafe, r.fences)
	}
}

// TestRDMAFenceStressUnprotectedFindsCorruption: SAFETY.md's row "fake
// rdma, Fence of the pages, writer passes no request id, protection off".
// Decode's NICs go on executing the WRITEs the prefill posted after Fence
// reported Safe; the run must find a given-up request's pattern in reused
// slots.
func TestRDMAFenceStressUnprotectedFindsCorruption(t *testing.T) {
	cfg := rdmaFenceStress()
	// As TestRDMAStressACKOnHeardFindsCorruption: pages of 4 chunks, 1 ms
	// apart, queued behind each other at decode's two NICs.
	cfg.slowPages()
	runUnprotected(t, cfg, "given-up request's", "the unsafe fence should let posted WRITEs land")
}

// TestRDMAFenceStressIsSafe: SAFETY.md's row "fake rdma, Fence on". Each
// fence cuts decode's responder QPs of the prefill (its rkeys for request
// id 0 reach whole registrations), so WRITEs in flight stop; the prefill's
// other requests go on over new QPs. 0 corrupted bytes, every fence Safe,
// some fences struck WRITEs in flight (tasks refused as fenced), and no
// request the prefill heard of after the fence of its pages fails.
func TestRDMAFenceStressIsSafe(t *testing.T) {
	cfg := rdmaFenceStress()
	cfg.delayUs = 300
	cfg.budget = 45 * time.Second
	cfg.requests = requests(600, 200)
	r := runStress(t, cfg)
	checkProtectedFence(t, r)
	if r.decode.RDMAFences == 0 {
		t.Errorf("decode cut no QP of the prefill in %d fences", r.fences)
	}
}

// TestRDMAFencesOfOtherPagesLetARequestInFlightComplete: a request the
// prefill writes (no request id) into pages decode never fences must
// complete, however many fences of other pages strike while it is in
// flight: each fence cuts decode's responder QPs of the prefill, and the
// prefill's work on them is posted again on new QPs (Engine.Fence's doc).
// Decode fences one other page MaxRetries+2 times while the request is
// being placed, each time once the request's WRITEs were posted again on
// new QPs (decode answered a keys request for them).
func TestRDMAFencesOfOtherPagesLetARequestInFlightComplete(t *testing.T) {
	const (
		size    = 32 << 20 // the request: one page, 32 WRITEs of 1 MiB on one path
		slice   = 1 << 20
		other   = 64 << 10 // the page decode fences
		delayUs = 2000     // 15 gaps per WRITE, two NICs: about half a second to land
		rid     = 1
		fences  = 2 + 2 // the prefill's Options.MaxRetries (default 2), plus 2
	)
	pcfg := rdmaPrefill(t, prefillConfig{slice: slice, paths: 1, workers: 2, srcSize: size, noRID: true})
	d, _ := newDecode(t, pcfg.decodeOptions())
	mem, _ := allocDecode(t, d, size+other)
	slot, page := mem[:size:size], mem[size:]
	pp := startSlowPrefill(t, pcfg, d, delayUs)

	req := holder{tag: rid}
	ch := pp.send(t, rid, 0, 1, 1, size, []uint64{engine.AddrOf(slot)})
	var end *outcome // the request's, once it ended
	if end = waitFor(t, 30*time.Second, "the request's first bytes to land", ch, func() bool { return landedBytes(slot, req, 0) > 0 }); end != nil {
		t.Fatalf("the request ended before any byte of it landed: %s", end.line)
	}
	done := 0
	for done < fences && end == nil {
		keys := d.Stats().RDMAKeyRequests
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		fr, err := d.Fence(ctx, []engine.FenceRange{{Addr: engine.AddrOf(page), Len: other}})
		cancel()
		if err != nil || !fr.Safe {
			t.Fatalf("fence %d of the other page = %+v, %v; want Safe", done+1, fr, err)
		}
		done++
		t.Logf("fence %d: epoch %d, cut %v, acked %v; %d KiB of the request landed", done, fr.Epoch, fr.Cut, fr.Acked, landedBytes(slot, req, 0)>>10)
		if done < fences {
			// Posted again on new QPs: they asked decode for keys.
			end = waitFor(t, 30*time.Second, "the request's WRITEs to be posted again", ch, func() bool { return d.Stats().RDMAKeyRequests > keys })
		}
	}
	if end == nil {
		select {
		case o := <-ch:
			end = &o
		case <-time.After(30 * time.Second):
			t.Fatal("the request did not end within 30s of the last fence")
		}
	}
	t.Logf("the request, after %d fences of the other page: %s", done, end.line)
	if end.status != engine.Completed.String() {
		t.Fatalf("a request into pages never fenced ended %s after %d fences of another page struck while it was in flight: %s", end.status, done, end.line)
	}
	if done < fences {
		t.Fatalf("the request completed after only %d of the %d fences: too little in flight to test", done, fences)
	}
	if n := landedBytes(slot, req, 0); n != size {
		t.Errorf("%d of the request's %d bytes landed", n, size)
	}
	bye := pp.finish(t, 30*time.Second)
	t.Logf("prefill: retries %d, rdma error completions %d, fence notices %d", bye["retries"], bye["rdma_error_wcs"], bye["fences_received"])
}
