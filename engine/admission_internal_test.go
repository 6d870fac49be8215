package engine

import (
	"fmt"
	"testing"
	"time"
)

// waitAdmitted polls until owner has admitted an access of request rid from
// init (with ApplyDelay the WRITE then sits admitted at the owner), and
// fails the test when that takes more than 10 s.
func waitAdmitted(t *testing.T, owner, init *Engine, rid uint64) {
	t.Helper()
	pollUntil(t, fmt.Sprintf("request %d of %s admitted", rid, init.Name()), func() bool {
		return owner.admitted.seen(init.Name(), rid)
	})
}

// pollUntil polls cond until it holds, and fails the test when that takes
// more than 10 s: what says what was waited for.
func pollUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 10s", what)
		}
		time.Sleep(100 * time.Microsecond)
	}
}
