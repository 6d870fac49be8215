package bounded_test

import (
	"slices"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/internal/bounded"
)

// clock is a hand-moved clock.
type clock struct{ t time.Time }

func (c *clock) now() time.Time       { return c.t }
func (c *clock) step(d time.Duration) { c.t = c.t.Add(d) }
func newClock() *clock                { return &clock{t: time.Unix(1_000_000, 0)} }
func keys(s *bounded.Set[int, int]) []int {
	return slices.Collect(func(y func(int) bool) { s.All()(func(k, _ int) bool { return y(k) }) })
}

// protect returns a policy that keeps the keys marked true in kept.
func protect(kept map[int]bool) bounded.Policy[int, int] {
	return func(k, _ int, _ bounded.Reason) bounded.Verdict {
		if kept[k] {
			return bounded.Keep
		}
		return bounded.Evict
	}
}

func TestPutAtTheCapEvictsTheOldestEntryThePolicyLetsGo(t *testing.T) {
	kept := map[int]bool{1: true}
	s := bounded.New(bounded.Options[int, int]{Cap: 3, Policy: protect(kept)})
	for k := 1; k <= 3; k++ {
		if !s.Put(k, k) {
			t.Fatalf("Put %d below the cap refused", k)
		}
	}
	if !s.Put(4, 4) {
		t.Fatal("Put at the cap refused with an evictable entry present")
	}
	if got := keys(s); !slices.Equal(got, []int{1, 3, 4}) {
		t.Fatalf("entries %v, want the protected 1 kept and the oldest evictable 2 gone", got)
	}
	if st := s.Stats(); st.Evicted != 1 || st.Spared != 1 || st.Refused != 0 {
		t.Fatalf("stats %+v", st)
	}
}

func TestPutRefusesRatherThanEvictAProtectedEntry(t *testing.T) {
	kept := map[int]bool{1: true, 2: true}
	s := bounded.New(bounded.Options[int, int]{Cap: 2, Policy: protect(kept)})
	s.Put(1, 1)
	s.Put(2, 2)
	if s.Put(3, 3) {
		t.Fatal("Put made room by evicting a protected entry")
	}
	if got := keys(s); !slices.Equal(got, []int{1, 2}) {
		t.Fatalf("entries %v after a refused Put", got)
	}
	if s.Has(3) {
		t.Fatal("a refused Put stored its entry")
	}
	if st := s.Stats(); st.Refused != 1 || st.Evicted != 0 || st.Len != 2 {
		t.Fatalf("stats %+v", st)
	}
	// A key already present renews without needing room.
	if !s.Put(1, 10) {
		t.Fatal("renewing a present key was refused")
	}
	if got := keys(s); !slices.Equal(got, []int{2, 1}) {
		t.Fatalf("entries %v: a renewed key moves to the young end", got)
	}
	// The caller overrides the protection explicitly, and it is counted.
	kept[2] = false
	if !s.Put(3, 3) || s.Stats().Evicted != 1 {
		t.Fatalf("Put after a protection ended: %v, stats %+v", keys(s), s.Stats())
	}
}

func TestPushKeepsProtectedEntriesAboveTheCapAndForceIsCountedApart(t *testing.T) {
	// Keep under pressure, evictable when forced: a tombstone whose
	// acknowledgement is still owed.
	owed := map[int]bool{1: true, 2: true, 3: true}
	busy := map[int]bool{2: true} // never evicted, not even forced
	s := bounded.New(bounded.Options[int, int]{Cap: 2, Policy: func(k, _ int, why bounded.Reason) bounded.Verdict {
		switch {
		case busy[k], owed[k] && why != bounded.Forced:
			return bounded.Keep
		}
		return bounded.Evict
	}})
	s.Push(1, 1)
	s.Push(2, 2)
	if over := s.Push(3, 3); over != 1 {
		t.Fatalf("Push over a full protected set: over %d, want 1", over)
	}
	if got := keys(s); !slices.Equal(got, []int{1, 2, 3}) {
		t.Fatalf("entries %v", got)
	}
	if n := s.Force(0); n != 1 {
		t.Fatalf("Force evicted %d, want 1 (the busy entry and the newest stay)", n)
	}
	if got := keys(s); !slices.Equal(got, []int{2, 3}) {
		t.Fatalf("entries %v after Force", got)
	}
	if st := s.Stats(); st.Forced != 1 || st.Evicted != 0 || st.Over != 1 {
		t.Fatalf("stats %+v", st)
	}
}

func TestExpireEvictsOnlyAgedEntriesThePolicyLetsGo(t *testing.T) {
	c := newClock()
	kept := map[int]bool{1: true}
	released := 2
	s := bounded.New(bounded.Options[int, int]{TTL: time.Minute, Now: c.now, Policy: func(k, _ int, why bounded.Reason) bounded.Verdict {
		if why != bounded.Aged {
			t.Errorf("Expire asked with reason %d", why)
		}
		switch {
		case kept[k]:
			return bounded.Keep
		case k == released:
			return bounded.Release
		}
		return bounded.Evict
	}})
	for k := 1; k <= 4; k++ {
		s.Put(k, k)
		c.step(10 * time.Second)
	}
	// Ages now: 1: 40s, 2: 30s, 3: 20s, 4: 10s.
	if n := s.Expire(c.now()); n != 0 || s.Len() != 4 {
		t.Fatalf("Expire before the TTL evicted %d", n)
	}
	c.step(35 * time.Second) // 1: 75s, 2: 65s, 3: 55s, 4: 45s
	if n := s.Expire(c.now()); n != 0 {
		t.Fatalf("Expire evicted %d, want 0 (1 protected, 2 released)", n)
	}
	if got := keys(s); !slices.Equal(got, []int{1, 3, 4}) {
		t.Fatalf("entries %v", got)
	}
	if st := s.Stats(); st.Aged != 0 || st.Released != 1 || st.Spared != 1 {
		t.Fatalf("stats %+v", st)
	}
	c.step(time.Hour)
	kept[1] = false
	if n := s.Expire(c.now()); n != 3 || s.Len() != 0 || s.Stats().Aged != 3 {
		t.Fatalf("Expire at the end evicted %d, stats %+v", n, s.Stats())
	}
}

func TestEntriesExpireAtExactlyTheirTTL(t *testing.T) {
	c := newClock()
	s := bounded.New(bounded.Options[int, int]{TTL: time.Minute, Now: c.now})
	s.Put(1, 1)
	if !s.Fresh(1, c.now().Add(time.Minute-1)) || s.Fresh(1, c.now().Add(time.Minute)) {
		t.Fatal("an entry is fresh for its TTL, and no longer")
	}
	if s.Expire(c.now().Add(time.Minute-1)) != 0 || s.Expire(c.now().Add(time.Minute)) != 1 {
		t.Fatal("Expire must evict an entry once it is TTL old, not before")
	}
}

func TestKeepFreshProtectsEntriesWithinTheirTTLAtTheCap(t *testing.T) {
	c := newClock()
	s := bounded.New(bounded.Options[int, int]{Cap: 2, TTL: time.Minute, KeepFresh: true, Now: c.now})
	s.Put(1, 1)
	c.step(2 * time.Minute)
	s.Put(2, 2)
	if !s.Put(3, 3) {
		t.Fatal("Put refused though an aged entry could go")
	}
	if got := keys(s); !slices.Equal(got, []int{2, 3}) {
		t.Fatalf("entries %v", got)
	}
	if s.Put(4, 4) || s.Force(0) != 0 {
		t.Fatal("a fresh entry was evicted")
	}
	if s.Trim(0, nil) != 0 || s.Len() != 2 {
		t.Fatal("Trim evicted a fresh entry")
	}
}

func TestTrimMarkMakesRoomForManyInsertions(t *testing.T) {
	s := bounded.New(bounded.Options[int, int]{Cap: 8, Trim: 4})
	for k := 1; k <= 9; k++ {
		s.Put(k, k)
	}
	if got := keys(s); !slices.Equal(got, []int{6, 7, 8, 9}) {
		t.Fatalf("entries %v, want the 4 youngest", got)
	}
	start := bounded.New(bounded.Options[int, int]{Cap: 3, Trim: 1})
	for k := 1; k <= 4; k++ {
		start.Put(k, k)
	}
	if got := keys(start); !slices.Equal(got, []int{4}) {
		t.Fatalf("a set with Trim 1 keeps %v past its cap, want only the newest", got)
	}
}

func TestTrimSelectsAndMayEvictTheNewest(t *testing.T) {
	s := bounded.New(bounded.Options[int, int]{})
	for k := 1; k <= 6; k++ {
		s.Put(k, k)
	}
	even := func(k, _ int) bool { return k%2 == 0 }
	if n := s.Trim(3, even); n != 3 {
		t.Fatalf("Trim evicted %d", n)
	}
	if got := keys(s); !slices.Equal(got, []int{1, 3, 5}) {
		t.Fatalf("entries %v", got)
	}
}

func TestGetDoesNotRenewAndRemoveIsNotAnEviction(t *testing.T) {
	s := bounded.New(bounded.Options[int, int]{Cap: 2})
	s.Put(1, 10)
	s.Put(2, 20)
	if v, ok := s.Get(1); !ok || v != 10 {
		t.Fatalf("Get: %d %v", v, ok)
	}
	s.Put(3, 30)
	if s.Has(1) {
		t.Fatal("Get renewed an entry")
	}
	if v, ok := s.Remove(2); !ok || v != 20 {
		t.Fatalf("Remove: %d %v", v, ok)
	}
	if _, ok := s.Remove(2); ok {
		t.Fatal("Remove of an absent key")
	}
	if st := s.Stats(); st.Evicted != 1 || st.Len != 1 {
		t.Fatalf("stats %+v", st)
	}
	for k := range s.All() {
		s.Remove(k) // the loop may remove the entry it is at
	}
	if s.Len() != 0 {
		t.Fatal("entries left")
	}
}
