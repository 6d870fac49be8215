package engine

import (
	"time"

	"github.com/kvferry/kvferry/engine/control"
	"github.com/kvferry/kvferry/engine/internal/bounded"
)

// tombKey names a request id aborted by one owner.
type tombKey struct {
	owner string
	rid   uint64
}

// tombstone remembers, as initiator, that an owner aborted a request: a
// transfer of it to that owner below minGen ends ABORTED.
type tombstone struct {
	minGen  uint32
	drained bool // the drain for minGen finished; outcome and landed are set
	outcome control.AckOutcome
	landed  uint64
	owed    bool   // an ABORT was heard: the drain's end answers it (and its duplicates)
	ackTo   string // the name the owed ABORT came from, which its ACK goes back to
	// recheck: the outcome is cut only because a path could not yet
	// confirm the request's work (a broken NIC path whose QP the owner
	// had not replaced yet), every task having ended: a duplicate ABORT
	// asks the paths again, and a drained ACK follows once they confirm.
	recheck    bool
	rechecking bool     // a recheck runs (one at a time)
	names      []string // the names the owner's paths were found under, asked again by a recheck
}

// MaxTombstoneOwners caps the owners an initiator remembers tombstones
// of. Owners are named by the peers themselves (a control message's
// sender), so without a cap ABORTs from made-up names would each leave a
// tombstone queue for ever. Past the cap the owners whose every tombstone
// is settled (drained and answered) are forgotten, down to 7/8 of it:
// first those no open segment is known as, then the others, least recently
// aborting first. An ABORT from a new owner when none can go is dropped
// unanswered (the owner resends it).
const MaxTombstoneOwners = 1024

// unknownOwnerTombstones caps the tombstones kept per owner that no open
// segment is known as (MaxTombstones caps them too): nothing of ours can be
// in flight to such an owner, so its tombstones only matter to a segment
// opened later, and made-up owners must not each hold MaxTombstones.
const unknownOwnerTombstones = 64

// ownerTombs is one owner's tombstones by request id, oldest abort first.
type ownerTombs = bounded.Set[uint64, *tombstone]

// newOwnerTombs returns an empty tombstone set for one owner: at most
// MaxTombstones (newTomb lowers that for an owner no open segment is known
// as), each forgotten past TombstoneTTL, and never one that is not settled
// (see tombstone.settled).
func (e *Engine) newOwnerTombs() *ownerTombs {
	return bounded.New(bounded.Options[uint64, *tombstone]{
		Cap: e.opts.MaxTombstones, TTL: e.opts.TombstoneTTL,
		Policy: func(_ uint64, tb *tombstone, _ bounded.Reason) bounded.Verdict {
			if tb.settled() {
				return bounded.Evict
			}
			return bounded.Keep
		},
	})
}

// setMaxTombOwners makes the set of owners holding tombstones, capped at n
// owners (MaxTombstoneOwners; tests lower it), keeping those it holds.
// Past the cap, making room forgets owners whose every tombstone is
// settled, down to 7/8 of n (see forgetOwnersLocked). Called with abortMu
// held, or before the engine runs.
func (e *Engine) setMaxTombOwners(n int) {
	old := e.tombOwners
	e.maxTombOwners = n
	e.tombOwners = bounded.New(bounded.Options[string, *ownerTombs]{
		Cap: n, Trim: n * 7 / 8,
		Policy: func(_ string, q *ownerTombs, _ bounded.Reason) bounded.Verdict {
			for _, tb := range q.All() {
				if !tb.settled() {
					return bounded.Keep
				}
			}
			e.stats.tombOwnersForgotten.Add(1)
			return bounded.Evict
		},
	})
	if old != nil {
		for owner, q := range old.All() {
			e.tombOwners.Push(owner, q)
		}
	}
}

// tombOf returns k's tombstone, nil when there is none. Called with
// abortMu held (shared will do).
func (e *Engine) tombOf(k tombKey) *tombstone {
	q, ok := e.tombOwners.Get(k.owner)
	if !ok {
		return nil
	}
	tb, _ := q.Get(k.rid)
	return tb
}

// newTomb adds an initiator tombstone, first forgetting the oldest of the
// same owner past its cap (MaxTombstones, unknownOwnerTombstones for an
// owner that no open segment is known as: a cap per owner, so that one
// peer's ABORTs never push out another owner's tombstones). A tombstone
// whose drain has not finished, or whose ACK is still owed, is never
// forgotten: the owner may be waiting on it, and a submit would otherwise
// slip past an abort in progress. Those end within AbortDrainTimeout twice
// and are at most as many as the drain pool holds, so an owner is over its
// cap only briefly. It returns nil when the owner is new and no other may
// go to make room for it (MaxTombstoneOwners). Called with abortMu held.
func (e *Engine) newTomb(k tombKey, known bool) *tombstone {
	q, seen := e.tombOwners.Get(k.owner)
	if !seen {
		if e.tombOwners.Len() >= e.maxTombOwners {
			e.forgetOwnersLocked()
		}
		q = e.newOwnerTombs()
		if !e.tombOwners.Put(k.owner, q) {
			return nil
		}
	} else {
		e.tombOwners.Put(k.owner, q) // the owner aborted last: forgotten last
	}
	limit := e.opts.MaxTombstones
	if !known {
		limit = min(limit, unknownOwnerTombstones)
	}
	q.Trim(limit-1, nil)
	tb := &tombstone{}
	q.Push(k.rid, tb) // over its cap only while the older ones are unsettled
	return tb
}

// renewTomb records that k's owner aborted its request again, at a higher
// generation: its tombstone, and the owner, are the youngest again.
// Called with abortMu held.
func (e *Engine) renewTomb(k tombKey, tb *tombstone) {
	if q, ok := e.tombOwners.Get(k.owner); ok {
		q.Put(k.rid, tb)
		e.tombOwners.Put(k.owner, q)
	}
}

// newTombLocked adds an initiator tombstone (see newTomb), k's owner known
// as an open segment or not. Called with abortMu held.
func (e *Engine) newTombLocked(k tombKey) *tombstone {
	return e.newTomb(k, len(e.segmentsKnownAs(k.owner)) > 0)
}

// settled reports whether the tombstone may be forgotten: its drain
// finished and its ACK is not owed (a nil one is gone already).
func (tb *tombstone) settled() bool { return tb == nil || (tb.drained && !tb.owed) }

// forgetOwnersLocked forgets every tombstone of owners whose tombstones are
// all settled, down to 7/8 of MaxTombstoneOwners, so that the walk is paid
// once per many new owners: first owners no open segment is known as (at
// most unknownOwnerTombstones each, so a flood of made-up names costs
// little), and only when that is not enough the others; least recently
// aborting first. Called with abortMu held.
func (e *Engine) forgetOwnersLocked() {
	known := map[string]bool{}
	e.segMu.Lock()
	for _, seg := range e.segments {
		known[seg.name] = true
		known[seg.id()] = true
	}
	e.segMu.Unlock()
	target := e.maxTombOwners * 7 / 8
	for _, pass := range []bool{false, true} {
		e.tombOwners.Trim(target, func(owner string, _ *ownerTombs) bool { return known[owner] == pass })
	}
}

// sweepTombs forgets initiator tombstones older than TombstoneTTL whose
// drain finished and whose ACK is not owed, and the owners left with none.
func (e *Engine) sweepTombs(now time.Time) {
	e.abortMu.Lock()
	defer e.abortMu.Unlock()
	for owner, q := range e.tombOwners.All() {
		q.Expire(now)
		if q.Len() == 0 {
			e.tombOwners.Remove(owner)
		}
	}
}

// tombCounts returns the initiator tombstones held and the owners they
// are of. Called with abortMu held (shared will do).
func (e *Engine) tombCounts() (tombs, owners int) {
	for _, q := range e.tombOwners.All() {
		tombs += q.Len()
	}
	return tombs, e.tombOwners.Len()
}

// segAbortedLocked reports whether a transfer of rid at gen to seg was
// aborted, under either name of its engine (see Segment.knownAs). Called
// with abortMu held (shared).
func (e *Engine) segAbortedLocked(seg *Segment, rid uint64, gen uint32) bool {
	if e.abortedLocked(seg.name, rid, gen) {
		return true
	}
	id := seg.id()
	return id != seg.name && e.abortedLocked(id, rid, gen)
}

// abortedLocked reports whether a transfer of rid at gen to owner was aborted.
// Called with abortMu held (shared).
func (e *Engine) abortedLocked(owner string, rid uint64, gen uint32) bool {
	tb := e.tombOf(tombKey{owner, rid})
	return tb != nil && gen < tb.minGen
}
