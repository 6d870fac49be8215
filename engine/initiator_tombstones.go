package engine

import (
	"slices"
	"time"

	"github.com/kvferry/kvferry/engine/control"
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
	at      time.Time
	drained bool // the drain for minGen finished; outcome and landed are set
	outcome control.AckOutcome
	landed  uint64
	owed    bool   // an ABORT was heard: the drain's end answers it (and its duplicates)
	ackTo   string // the name the owed ABORT came from, which its ACK goes back to
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
	q, seen := e.tombQueues[k.owner]
	if !seen && len(e.tombQueues) >= e.maxTombOwners {
		e.forgetOwnersLocked()
		if len(e.tombQueues) >= e.maxTombOwners {
			return nil
		}
	}
	limit := e.opts.MaxTombstones
	if !known {
		limit = min(limit, unknownOwnerTombstones)
	}
	for len(q) >= limit {
		i := slices.IndexFunc(q, func(rid uint64) bool {
			return e.tombs[tombKey{k.owner, rid}].settled()
		})
		if i < 0 {
			break
		}
		delete(e.tombs, tombKey{k.owner, q[i]})
		q = slices.Delete(q, i, i+1)
	}
	tb := &tombstone{}
	e.tombs[k] = tb
	e.tombQueues[k.owner] = append(q, k.rid)
	return tb
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
		type cand struct {
			owner string
			last  time.Time
		}
		var cands []cand
		for owner, q := range e.tombQueues {
			if known[owner] != pass {
				continue
			}
			var last time.Time
			ok := true
			for _, rid := range q {
				tb := e.tombs[tombKey{owner, rid}]
				if !tb.settled() {
					ok = false
					break
				}
				if tb != nil && tb.at.After(last) {
					last = tb.at
				}
			}
			if ok {
				cands = append(cands, cand{owner, last})
			}
		}
		slices.SortFunc(cands, func(a, b cand) int { return a.last.Compare(b.last) })
		for _, c := range cands {
			if len(e.tombQueues) <= target {
				return
			}
			for _, rid := range e.tombQueues[c.owner] {
				delete(e.tombs, tombKey{c.owner, rid})
			}
			delete(e.tombQueues, c.owner)
			e.stats.tombOwnersForgotten.Add(1)
		}
	}
}

// sweepTombs forgets initiator tombstones older than TombstoneTTL whose
// drain finished and whose ACK is not owed.
func (e *Engine) sweepTombs(now time.Time) {
	e.abortMu.Lock()
	defer e.abortMu.Unlock()
	for owner, q := range e.tombQueues {
		i := 0
		for ; i < len(q); i++ {
			tb := e.tombs[tombKey{owner, q[i]}]
			if tb == nil {
				continue
			}
			if now.Sub(tb.at) < e.opts.TombstoneTTL || !tb.drained || tb.owed {
				break
			}
			delete(e.tombs, tombKey{owner, q[i]})
		}
		if i == len(q) {
			delete(e.tombQueues, owner)
		} else if i > 0 {
			e.tombQueues[owner] = slices.Clone(q[i:])
		}
	}
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
	tb := e.tombs[tombKey{owner, rid}]
	return tb != nil && gen < tb.minGen
}
