package pd

import (
	"testing"
	"time"
)

// baseStress is the shape both stress tests share: 4 layers of 2 pages of
// 32 KiB, cut into 16 KiB slices (16 slices a request, 4 batches), over 8
// paths.
func baseStress() stressConfig {
	return stressConfig{
		lanes: 8, layers: 4, pages: 2, pageSize: 32 << 10, slice: 16 << 10, paths: 8,
		poolPages: 8 * 2 * 4, seed: 0x5eed_4b1d,
		before: 10, during: 20, after: 10, duringMax: 4 * time.Millisecond,
		abortDeadline: 10 * time.Second,
	}
}

// runWithFramesInFlight runs n requests of cfg with each path's owner
// pausing 50 µs after it admitted a frame, so that frames are in flight at
// most give-ups. (Go sleeps at least about 1 ms there.)
func runWithFramesInFlight(t *testing.T, cfg stressConfig, n int) *stressResult {
	t.Helper()
	cfg.requests = n
	cfg.applyDelay = 50 * time.Microsecond
	return runStress(t, cfg)
}

// runUnprotected runs cfg with the protection off, half the requests
// given up while written (up to 20 ms into their flight) and 5 in 100
// after they completed, so that late writes meet reused slots often; the
// run must find them (see requireLateWritesFound).
func runUnprotected(t *testing.T, cfg stressConfig, whose, why string) {
	t.Helper()
	cfg.unsafe = true
	cfg.during, cfg.after = 50, 5
	cfg.duringMax = 20 * time.Millisecond
	requireLateWritesFound(t, runStress(t, cfg), whose, why)
}

// requireLateWritesFound fails the test unless the run found the pattern
// of a request decode gave up (whose) in a slot it had reused: an
// unprotected row that finds none proves nothing, and neither does the
// protected row it stands beside. why says what should have let them land.
func requireLateWritesFound(t *testing.T, r *stressResult, whose, why string) {
	t.Helper()
	if bad, old := r.totalBad(); old == 0 {
		t.Errorf("no %s pattern found in a reused slot (%d corrupted bytes in all): %s", whose, bad, why)
	}
}

// checkAbortsProtected: no byte of a slot's current holder overwritten,
// and every abort Safe.
func checkAbortsProtected(t *testing.T, r *stressResult) {
	t.Helper()
	checkSafeGiveUps(t, r, "an aborted request's", "with protection on", "aborts", r.notSafe, r.aborts)
}

// checkSafeGiveUps: no byte of a slot's current holder overwritten (whose:
// the pattern that would be found there; protection: what was on), and
// every one of decode's calls (kind: aborts or fences) Safe.
func checkSafeGiveUps(t *testing.T, r *stressResult, whose, protection, kind string, notSafe, calls int) {
	t.Helper()
	if bad, old := r.totalBad(); bad != 0 {
		t.Errorf("%d corrupted bytes (%d of them %s pattern) %s; want 0", bad, old, whose, protection)
	}
	if notSafe != 0 {
		t.Errorf("%d of %d %s not Safe", notSafe, calls, kind)
	}
}

// TestPDStressProtected: with protection on, decode aborts thousands of
// requests at random moments and reuses their slots at once; no byte of a
// slot's current holder is ever overwritten, every abort is Safe, and some
// aborts refused bytes that were already in flight.
func TestPDStressProtected(t *testing.T) {
	r := runWithFramesInFlight(t, baseStress(), requests(10000, 2000))
	checkAbortsProtected(t, r)
	if r.decode.RefusedInFlight == 0 {
		t.Errorf("no refusal struck a frame in flight (refused %d in all): the race this test is for never happened", r.decode.OwnerRefused)
	}
}

// TestPDStressProtectedWithAuthentication: the same protection holds with
// both ends authenticating (CURVE on the control plane, authenticated data
// connections), and authentication refuses none of the legitimate peers.
func TestPDStressProtectedWithAuthentication(t *testing.T) {
	cfg := baseStress()
	cfg.auth = true
	r := runWithFramesInFlight(t, cfg, requests(3000, 1000))
	checkAbortsProtected(t, r)
	if r.decode.AuthRefused != 0 {
		t.Errorf("decode refused %d connections of its own prefill", r.decode.AuthRefused)
	}
}

// TestPDStressUnprotectedFindsCorruption: the same run with the protection
// off (no owner refusal, ABORT_ACK on "heard", as SGLang's abort works
// today) finds an aborted request's pattern in slots decode had reused: the
// checks of TestPDStressProtected can fail, and what they guard against is
// real.
func TestPDStressUnprotectedFindsCorruption(t *testing.T) {
	cfg := baseStress()
	cfg.requests = 300
	// A long pause per frame: when decode aborts, frames are certainly
	// still on the wire, and land after the slots were reused.
	cfg.applyDelay = 2 * time.Millisecond
	cfg.before = 5
	runUnprotected(t, cfg, "aborted request's", "the unsafe abort should let late writes land")
}
