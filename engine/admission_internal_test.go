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
	until(t, 10*time.Second, fmt.Sprintf("request %d of %s admitted", rid, init.Name()), func() bool {
		return owner.admitted.seen(init.Name(), rid)
	})
}
