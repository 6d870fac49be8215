// The age queue: request ids remembered without a live grant (tombstones,
// and ids whose grants were all revoked), bounded in number and age.

package requests

import (
	"time"

	"github.com/kvferry/kvferry/engine/internal/bounded"
)

// ageQueue is the age queue's type: request ids, oldest first, and their
// states.
type ageQueue = bounded.Set[uint64, *state]

// newAgeQueue returns the table's empty age queue: MaxTombstones entries,
// trimmed to the trim mark, aging out after TombstoneTTL, forget deciding
// what may go.
func (t *Table) newAgeQueue() *ageQueue {
	return bounded.New(bounded.Options[uint64, *state]{
		Cap:    t.opts.MaxTombstones,
		Trim:   t.trimMark(),
		TTL:    t.opts.TombstoneTTL,
		Policy: t.forget,
	})
}

// queueLocked puts st at the young end of the age queue, moving it if it
// is queued already: a request id is queued once, however often it is
// renewed. Past MaxTombstones the queue forgets down to the trim mark:
// acknowledged states first, oldest first, and only then, counted as
// forced, those not acknowledged; never one with a chunk in progress, nor
// st itself (see forget). Called with queueMu held and st.queued set under
// its shard's lock (forget takes that lock).
func (t *Table) queueLocked(st *state) {
	if t.age.Push(st.rid, st) > 0 {
		t.age.Force(t.trimMark())
	}
}

// trimMark is what the age queue forgets down to past MaxTombstones: 7/8
// of it, so that the walk is paid once per many aborts.
func (t *Table) trimMark() int { return t.opts.MaxTombstones * 7 / 8 }

// Sweep forgets the tombstones (and request ids whose grants were all
// revoked) that every initiator acknowledged and that aged out. The engine
// calls it periodically.
func (t *Table) Sweep(now time.Time) {
	t.queueMu.Lock()
	defer t.queueMu.Unlock()
	t.age.Expire(now) // one not acknowledged, or busy, stays
}

// forget is the age queue's policy: it forgets the queued state st if it
// is idle and acknowledged (or the eviction is forced), and reports what
// it did. A state with a chunk in progress is never forgotten: Abort and
// Revoke wait on it. A state with live grants leaves the queue but stays:
// it is bounded by MaxGrants, and the revoke of its last grant (or an
// abort) queues it again. Called with queueMu held.
func (t *Table) forget(rid uint64, st *state, why bounded.Reason) bounded.Verdict {
	sh := t.shard(rid)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	switch {
	case len(st.grants) > 0:
		st.queued = false
		return bounded.Release
	case st.active > 0 || (!st.acked && why != bounded.Forced):
		return bounded.Keep
	}
	st.queued = false
	if sh.m[rid] == st {
		delete(sh.m, rid)
	}
	if st.tomb {
		t.tombs.Add(-1)
	}
	t.evicted.Add(1)
	if !st.acked {
		t.forced.Add(1)
	}
	return bounded.Evict
}

// Stats are the table's counters.
type Stats struct {
	Tombstones      int64 // aborted request ids remembered
	Grants          int   // live grants
	Ranges          int   // ranges of the live grants
	Queued          int   // request ids remembered without a live grant (the age queue), each once
	Evicted         int64 // entries forgotten after aging out or at the cap
	ForcedEvictions int64 // tombstones forgotten at the cap before an acknowledgement
}

// Stats returns a snapshot of the counters.
func (t *Table) Stats() Stats {
	t.queueMu.Lock()
	q := t.age.Len()
	t.queueMu.Unlock()
	t.grantMu.Lock()
	n, nr := len(t.grants), t.ranges
	t.grantMu.Unlock()
	return Stats{Tombstones: t.tombs.Load(), Grants: n, Ranges: nr, Queued: q, Evicted: t.evicted.Load(), ForcedEvictions: t.forced.Load()}
}

// Len returns the number of request ids with state (tombstones, grants,
// copies in progress).
func (t *Table) Len() int {
	n := 0
	for i := range t.shards {
		sh := &t.shards[i]
		sh.mu.Lock()
		n += len(sh.m)
		sh.mu.Unlock()
	}
	return n
}
