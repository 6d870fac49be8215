// Package bounded is the one bounded set behind every safety-relevant cache
// of the engine: tombstones, uncertain requests, fence debts and the like.
// Each of them remembers something whose loss could let a byte land where a
// promise says it cannot (see docs/SAFETY.md), and each must stay bounded
// whatever peers do. A Set makes the same, reviewable promise for all of
// them: it has a capacity and a time to live, and it evicts an entry only
// when the owner's policy, asked about that entry at that moment, lets it
// go. An entry the policy protects is never evicted; when the set is full
// of protected entries it says so, and the caller decides (refuse the new
// entry, cut the peer, or force an eviction through Force, counted apart).
//
// Order: entries are kept oldest first by the time they were last put (a
// Put of a key already present renews it and moves it to the young end; a
// Get does not). Ages therefore grow along the order, so Expire stops at
// the first entry too young to go, and every walk that evicts (to make
// room, to expire, to force) takes the oldest candidates first, the same
// ones on every run: eviction is deterministic.
//
// Cost: Get, Put, Push and Remove are O(1) plus the evictions they make.
// A walk that makes room passes over the protected entries at the old end
// each time; Options.Trim (a mark below Cap) makes that walk pay for many
// insertions.
//
// A Set does not lock and starts no goroutine: its owner holds its own
// lock around every call (the caches live under mutexes that guard more
// than the set), and the set calls the policy synchronously, inside that
// lock.
package bounded

import (
	"iter"
	"time"
)

// Verdict is a policy's answer for one entry the set is about to evict.
type Verdict uint8

const (
	// Keep: the entry is protected now and stays, whatever the pressure.
	Keep Verdict = iota
	// Evict: the entry may go; the set forgets it as soon as the policy
	// returns, and counts the eviction by its Reason.
	Evict
	// Release: the entry no longer needs this set (something else bounds
	// and guards it now); it leaves the set without counting as an
	// eviction.
	Release
)

// Reason says why the set would evict an entry.
type Reason uint8

const (
	// Aged: the entry is older than the TTL (Expire).
	Aged Reason = iota + 1
	// Room: the set is above its capacity (Put, Push, Trim).
	Room
	// Forced: the caller asked for protection to be overridden (Force);
	// the policy still decides what may go even then.
	Forced
)

// Policy decides whether an entry may be evicted now, and why it would
// be. The set evicts the entry as soon as the policy returns Evict, so a
// policy may forget whatever the entry stands for in the same step (under
// a lock it takes for that), making the decision and the forgetting one
// atomic step. A policy must not call the set's methods.
type Policy[K comparable, V any] func(k K, v V, why Reason) Verdict

// Options configure a Set. Zero fields take the defaults.
type Options[K comparable, V any] struct {
	// Cap is how many entries the set holds before Put and Push make
	// room; 0 means no cap.
	Cap int
	// Trim is how many entries making room leaves at most (default and
	// at most Cap): a mark below Cap pays the walk once per many
	// insertions; 1 makes the set start afresh at the cap, keeping only
	// the entry just put.
	Trim int
	// TTL is how long an entry lives after its last Put before Expire
	// may evict it; 0 means entries never age.
	TTL time.Duration
	// KeepFresh protects every entry younger than TTL from any eviction,
	// whatever the policy says: a walk to make room (or to force) stops
	// at the first one.
	KeepFresh bool
	// Policy is asked about each entry the set would evict; nil lets
	// every entry go.
	Policy Policy[K, V]
	// Now is the clock that stamps entries (default time.Now); tests
	// inject one.
	Now func() time.Time
}

// Stats are a set's counters since it was made.
type Stats struct {
	Len      int   // entries now
	Aged     int64 // evicted by Expire, older than the TTL
	Evicted  int64 // evicted to make room at the cap
	Forced   int64 // evicted by Force
	Released int64 // left on the policy's Release
	Refused  int64 // Puts refused: no room without evicting a protected entry
	Over     int64 // Pushes that left the set above its cap: the entries that could have made room were protected
	Spared   int64 // protected entries an evicting walk passed over or stopped at (once per entry per walk)
}

type node[K comparable, V any] struct {
	k          K
	v          V
	at         time.Time
	prev, next *node[K, V]
}

// Set is a bounded map from K to V kept in the order entries were last
// put. Its zero value is not usable; make one with New. It is not safe for
// concurrent use: its owner serializes every call.
type Set[K comparable, V any] struct {
	o          Options[K, V]
	m          map[K]*node[K, V]
	head, tail *node[K, V] // oldest, newest
	st         Stats
}

// New returns an empty set.
func New[K comparable, V any](o Options[K, V]) *Set[K, V] {
	if o.Cap < 0 {
		o.Cap = 0
	}
	if o.Trim <= 0 || o.Trim > o.Cap {
		o.Trim = o.Cap
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return &Set[K, V]{o: o, m: map[K]*node[K, V]{}}
}

// Len returns the number of entries.
func (s *Set[K, V]) Len() int { return len(s.m) }

// Now reads the set's clock.
func (s *Set[K, V]) Now() time.Time { return s.o.Now() }

// Get returns k's value, without renewing it.
func (s *Set[K, V]) Get(k K) (V, bool) {
	if n := s.m[k]; n != nil {
		return n.v, true
	}
	var zero V
	return zero, false
}

// Has reports whether k is in the set.
func (s *Set[K, V]) Has(k K) bool { return s.m[k] != nil }

// Stamp returns when k was last put.
func (s *Set[K, V]) Stamp(k K) (time.Time, bool) {
	if n := s.m[k]; n != nil {
		return n.at, true
	}
	return time.Time{}, false
}

// Fresh reports whether k is in the set and younger than the TTL at now
// (any entry is fresh when the set has no TTL).
func (s *Set[K, V]) Fresh(k K, now time.Time) bool {
	n := s.m[k]
	return n != nil && !s.aged(n, now)
}

func (s *Set[K, V]) aged(n *node[K, V], now time.Time) bool {
	return s.o.TTL > 0 && now.Sub(n.at) >= s.o.TTL
}

// Put stores v under k, stamped now, at the young end (renewing k if it is
// present). When the set is then above its cap it makes room: it asks the
// policy about the other entries, oldest first, and evicts those it lets go
// until at most Options.Trim remain. It reports false, and stores nothing,
// when k is new and the set stays above its cap: every entry that could
// have made room is protected. The caller then decides: refuse, cut a
// peer, or store it anyway with Push and make room with Force.
func (s *Set[K, V]) Put(k K, v V) bool {
	added := s.put(k, v)
	if !s.over() {
		return true
	}
	s.makeRoom(s.o.Trim, Room)
	if added && s.over() {
		s.unlink(s.m[k])
		s.st.Refused++
		return false
	}
	return true
}

// Push stores v under k like Put, but keeps it even when the set stays
// above its cap, for a caller whose protected entries are bounded by other
// means (a chunk in progress ends). It returns how many entries the set
// then holds beyond its cap.
func (s *Set[K, V]) Push(k K, v V) (over int) {
	s.put(k, v)
	if !s.over() {
		return 0
	}
	s.makeRoom(s.o.Trim, Room)
	if s.over() {
		s.st.Over++
		return len(s.m) - s.o.Cap
	}
	return 0
}

// Force evicts entries, oldest first, until at most target remain, asking
// the policy with reason Forced: it is how a caller overrides a protection
// the policy grants only under pressure (a tombstone not yet
// acknowledged, say), counted apart. Like making room, it never evicts
// the newest entry, the one room is being made for. It returns how many
// entries it evicted.
func (s *Set[K, V]) Force(target int) int {
	return s.makeRoom(target, Forced)
}

// Trim evicts entries, oldest first, that only (nil: every entry) selects
// and the policy lets go, until at most target remain; it counts them as
// evicted to make room. Unlike Put it may evict the newest entry. It
// returns how many entries it evicted.
func (s *Set[K, V]) Trim(target int, only func(K, V) bool) int {
	n := 0
	now := s.o.Now()
	for e := s.head; e != nil && len(s.m) > target; {
		next := e.next
		if s.o.KeepFresh && !s.aged(e, now) {
			s.st.Spared++
			break // the rest are younger still
		}
		if only == nil || only(e.k, e.v) {
			if s.ask(e, Room) {
				n++
			}
		}
		e = next
	}
	return n
}

// Expire evicts, oldest first, the entries older than the TTL at now that
// the policy lets go; protected ones stay. It returns how many it evicted.
func (s *Set[K, V]) Expire(now time.Time) int {
	if s.o.TTL <= 0 {
		return 0
	}
	n := 0
	for e := s.head; e != nil && s.aged(e, now); {
		next := e.next
		if s.ask(e, Aged) {
			n++
		}
		e = next
	}
	return n
}

// Remove takes k out of the set at its owner's word (not an eviction: the
// policy is not asked and nothing is counted). It returns k's value.
func (s *Set[K, V]) Remove(k K) (V, bool) {
	n := s.m[k]
	if n == nil {
		var zero V
		return zero, false
	}
	s.unlink(n)
	return n.v, true
}

// All yields the entries oldest first. The loop may Remove the entry it is
// at, and no other.
func (s *Set[K, V]) All() iter.Seq2[K, V] {
	return func(yield func(K, V) bool) {
		for e := s.head; e != nil; {
			next := e.next
			if !yield(e.k, e.v) {
				return
			}
			e = next
		}
	}
}

// Stats returns the counters.
func (s *Set[K, V]) Stats() Stats {
	st := s.st
	st.Len = len(s.m)
	return st
}

func (s *Set[K, V]) over() bool { return s.o.Cap > 0 && len(s.m) > s.o.Cap }

// put stores v under k at the young end, stamped now, and reports whether
// k is new.
func (s *Set[K, V]) put(k K, v V) bool {
	now := s.o.Now()
	n := s.m[k]
	added := n == nil
	if added {
		n = &node[K, V]{k: k}
		s.m[k] = n
	} else if s.tail != n {
		s.detach(n)
	} else {
		n.v, n.at = v, now
		return false
	}
	n.v, n.at = v, now
	n.prev, n.next = s.tail, nil
	if s.tail != nil {
		s.tail.next = n
	} else {
		s.head = n
	}
	s.tail = n
	return added
}

// makeRoom evicts entries other than the newest, oldest first, until at
// most target remain, and returns how many it evicted.
func (s *Set[K, V]) makeRoom(target int, why Reason) int {
	n := 0
	var now time.Time
	if s.o.KeepFresh {
		now = s.o.Now()
	}
	for e := s.head; e != nil && e != s.tail && len(s.m) > target; {
		next := e.next
		if s.o.KeepFresh && !s.aged(e, now) {
			s.st.Spared++
			break // the rest are younger still
		}
		if s.ask(e, why) {
			n++
		}
		e = next
	}
	return n
}

// ask puts the policy's question about e for why, acts on the answer and
// reports whether e was evicted.
func (s *Set[K, V]) ask(e *node[K, V], why Reason) bool {
	verdict := Evict
	if s.o.Policy != nil {
		verdict = s.o.Policy(e.k, e.v, why)
	}
	switch verdict {
	case Evict:
		s.unlink(e)
		switch why {
		case Aged:
			s.st.Aged++
		case Room:
			s.st.Evicted++
		case Forced:
			s.st.Forced++
		}
		return true
	case Release:
		s.unlink(e)
		s.st.Released++
	default:
		s.st.Spared++
	}
	return false
}

// detach takes n out of the order, leaving it in the map.
func (s *Set[K, V]) detach(n *node[K, V]) {
	if n.prev != nil {
		n.prev.next = n.next
	} else {
		s.head = n.next
	}
	if n.next != nil {
		n.next.prev = n.prev
	} else {
		s.tail = n.prev
	}
	n.prev, n.next = nil, nil
}

// unlink forgets n.
func (s *Set[K, V]) unlink(n *node[K, V]) {
	s.detach(n)
	delete(s.m, n.k)
}
