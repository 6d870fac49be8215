package pd

import (
	"syscall"
	"testing"
	"time"
)

// SAFETY.md's rows on the same-host transport (shm): decode, the owner,
// copies from the prefill's shared buffers itself, chunk by chunk under its
// guard, so its refusal is the fence, as on tcp.

// shmStress is the tcp stress shape over shm.
func shmStress() stressConfig {
	cfg := baseStress()
	cfg.shm = true
	return cfg
}

// TestSHMPDStressProtected: TestPDStressProtected over shm.
func TestSHMPDStressProtected(t *testing.T) {
	r := runWithFramesInFlight(t, shmStress(), requests(10000, 2000))
	checkAbortsProtected(t, r)
	if r.decode.RefusedInFlight == 0 {
		t.Errorf("no refusal struck a slice decode had admitted (refused %d in all): the race this test is for never happened", r.decode.OwnerRefused)
	}
	if r.prefill["shm_slices"] == 0 || r.prefill["shm_over_tcp"] != 0 {
		t.Errorf("the prefill sent %d slices over shm and %d over tcp; want all over shm", r.prefill["shm_slices"], r.prefill["shm_over_tcp"])
	}
}

// TestSHMPDStressUnprotectedFindsCorruption: the same run over shm with
// the protection off finds an aborted request's pattern in reused slots.
func TestSHMPDStressUnprotectedFindsCorruption(t *testing.T) {
	cfg := shmStress()
	cfg.requests = 300
	cfg.applyDelay = 2 * time.Millisecond
	cfg.before = 5
	runUnprotected(t, cfg, "aborted request's", "the unsafe abort should let late writes land")
}

// TestSHMFenceStressUnprotectedFindsCorruption: the fence row with the
// protection off, over shm.
func TestSHMFenceStressUnprotectedFindsCorruption(t *testing.T) {
	cfg := fencing(shmStress())
	cfg.requests = 300
	cfg.applyDelay = 2 * time.Millisecond
	runUnprotected(t, cfg, "given-up request's", "the unsafe fence should let late writes land")
}

// TestSHMFenceStressIsSafe: the fence row with the fence on, over shm.
func TestSHMFenceStressIsSafe(t *testing.T) {
	r := runWithFramesInFlight(t, fencing(shmStress()), requests(3000, 1000))
	checkProtectedFence(t, r)
	if r.decode.OwnerRefused == 0 {
		t.Errorf("decode refused no slice (fence refusals at admission %d): no fence struck bytes in flight", r.decode.FenceRefused)
	}
}

// TestSHMSIGSTOPPrefillAbortIsSafe: TestSIGSTOPPrefillAbortIsSafe over shm.
func TestSHMSIGSTOPPrefillAbortIsSafe(t *testing.T) { testSignalAbort(t, syscall.SIGSTOP, true) }

// TestSHMSIGKILLPrefillAbortIsSafe: TestSIGKILLPrefillAbortIsSafe over shm:
// decode still maps the killed prefill's buffer, and refuses what is left.
func TestSHMSIGKILLPrefillAbortIsSafe(t *testing.T) { testSignalAbort(t, syscall.SIGKILL, true) }
