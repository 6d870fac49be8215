package requests

import (
	"testing"
	"time"
)

// TestRevokeRacingGrantNeverPanics: a Revoke of the id a concurrent Grant is
// about to hand out must see either no grant or a whole one. A grant
// published before its request state existed would make Revoke panic with
// the shard locked, which then hangs every access of 1/64 of the request
// ids (the window is narrow: -race, as make test runs it, widens it).
func TestRevokeRacingGrantNeverPanics(t *testing.T) {
	tb := New(Options{})
	n := 20000
	if testing.Short() {
		n = 2000
	}
	for i := range n {
		next := tb.grantID.Load() + 1
		done := make(chan struct{})
		go func() {
			defer close(done)
			defer func() {
				if r := recover(); r != nil {
					t.Errorf("iteration %d: Revoke panicked: %v", i, r)
				}
			}()
			_, _ = tb.Revoke(next)
		}()
		if _, err := tb.Grant("a:1", uint64(i+1), []Range{{4096, 10}}); err != nil {
			t.Fatal(err)
		}
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Fatalf("iteration %d: Revoke hung (a shard lock left held?)", i)
		}
		if t.Failed() {
			return
		}
	}
}
