package engine

import (
	"testing"
	"time"
)

// waitAdmitted polls until owner has admitted an access of request rid from
// init (with ApplyDelay the WRITE then sits admitted at the owner), and
// fails the test when that takes more than 10 s.
func waitAdmitted(t *testing.T, owner, init *Engine, rid uint64) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !owner.admitted.seen(init.Name(), rid) {
		if time.Now().After(deadline) {
			t.Fatalf("request %d of %s was never admitted", rid, init.Name())
		}
		time.Sleep(100 * time.Microsecond)
	}
}
