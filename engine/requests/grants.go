// Grants: an owner restricts a request id to named ranges for a named
// initiator; Revoke withdraws one.

package requests

import (
	"fmt"

	"github.com/kvferry/kvferry/engine/memory"
)

// MaxGrantRanges caps the ranges of one grant.
const MaxGrantRanges = 4096

// Range is an owner address range.
type Range struct{ Addr, Len uint64 }

// Grant is a live grant: Initiator may access Ranges for RequestID at
// Generation.
type Grant struct {
	ID         uint64
	Initiator  string
	RequestID  uint64
	Generation uint32
	Ranges     []Range

	revoked bool // under the shard's lock
	aborted bool // revoked by an Abort of its request; under the shard's lock
}

func (g *Grant) covers(initiator string, addr, n uint64) bool {
	if g.Initiator != initiator {
		return false
	}
	for _, r := range g.Ranges {
		if addr >= r.Addr && n <= r.Len && addr-r.Addr <= r.Len-n {
			return true
		}
	}
	return false
}

// Grant lets initiator access ranges for rid at the request's current
// generation; from the first grant on, every access of rid needs one.
func (t *Table) Grant(initiator string, rid uint64, ranges []Range) (Grant, error) {
	switch {
	case rid == 0:
		return Grant{}, fmt.Errorf("grant: %w: request id 0", memory.ErrInvalidArg)
	case initiator == "":
		return Grant{}, fmt.Errorf("grant: %w: no initiator", memory.ErrInvalidArg)
	case len(ranges) == 0 || len(ranges) > MaxGrantRanges:
		return Grant{}, fmt.Errorf("grant: %w: %d ranges (1 to %d)", memory.ErrInvalidArg, len(ranges), MaxGrantRanges)
	}
	for i, r := range ranges {
		if r.Len == 0 || r.Addr+r.Len < r.Addr {
			return Grant{}, fmt.Errorf("grant: %w: range %d [%#x, +%d)", memory.ErrInvalidArg, i, r.Addr, r.Len)
		}
	}
	g := &Grant{ID: t.grantID.Add(1), Initiator: initiator, RequestID: rid, Ranges: append([]Range(nil), ranges...)}
	t.grantMu.Lock()
	if len(t.grants) >= t.opts.MaxGrants {
		t.grantMu.Unlock()
		return Grant{}, fmt.Errorf("grant: %w: %d grants live", ErrFull, t.opts.MaxGrants)
	}
	if t.ranges+len(ranges) > t.opts.MaxRanges {
		n := t.ranges
		t.grantMu.Unlock()
		return Grant{}, fmt.Errorf("grant: %w: %d ranges live, %d more would pass %d", ErrFull, n, len(ranges), t.opts.MaxRanges)
	}
	// The grant joins its request's state before Revoke can find it by id
	// (lock order: grantMu, then the shard's).
	sh := t.shard(rid)
	sh.mu.Lock()
	st := sh.stateLocked(rid)
	st.restricted = true
	g.Generation = st.gen
	st.grants = append(st.grants, g)
	out := *g
	sh.mu.Unlock()
	t.grants[g.ID] = g
	t.ranges += len(g.Ranges)
	t.grantMu.Unlock()
	out.Ranges = append([]Range(nil), g.Ranges...) // the caller's copy: editing it changes nothing enforced
	return out, nil
}

// dropGrantLocked forgets a grant by id, once: Revoke and Abort may both
// reach it. Called with grantMu held.
func (t *Table) dropGrantLocked(g *Grant) {
	if t.grants[g.ID] == g {
		delete(t.grants, g.ID)
		t.ranges -= len(g.Ranges)
	}
}

// Granted reports whether initiator holds a live grant for rid.
func (t *Table) Granted(initiator string, rid uint64) bool {
	sh := t.shard(rid)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if st := sh.m[rid]; st != nil {
		for _, g := range st.grants {
			if g.Initiator == initiator {
				return true
			}
		}
	}
	return false
}

// GrantOf returns the live grant id.
func (t *Table) GrantOf(id uint64) (Grant, bool) {
	t.grantMu.Lock()
	defer t.grantMu.Unlock()
	g := t.grants[id]
	if g == nil {
		return Grant{}, false
	}
	return Grant{ID: g.ID, Initiator: g.Initiator, RequestID: g.RequestID, Generation: g.Generation}, true
}

// Revoke withdraws a grant: accesses under it are refused from now on. It
// returns a channel closed once no chunk of its request is in progress
// (nil when none is).
func (t *Table) Revoke(id uint64) (<-chan struct{}, error) {
	t.grantMu.Lock()
	g := t.grants[id]
	if g != nil {
		t.dropGrantLocked(g)
	}
	t.grantMu.Unlock()
	if g == nil {
		return nil, fmt.Errorf("revoke grant %d: %w", id, ErrUnknownGrant)
	}
	sh := t.shard(g.RequestID)
	t.queueMu.Lock()
	sh.mu.Lock()
	st := sh.m[g.RequestID]
	if st == nil || g.revoked {
		// Not reachable while grants join their state first; never
		// panic with the shard locked.
		sh.mu.Unlock()
		t.queueMu.Unlock()
		return nil, fmt.Errorf("revoke grant %d: %w", id, ErrUnknownGrant)
	}
	g.revoked = true
	for i, c := range st.grants {
		if c == g {
			st.grants = append(st.grants[:i], st.grants[i+1:]...)
			break
		}
	}
	last := len(st.grants) == 0
	if last {
		// The request id stays restricted: remembered like a tombstone,
		// and counted with them, so that it ages out or goes at the cap.
		if !st.tomb {
			st.acked = true
		}
		st.queued = true
	}
	wait := st.waitLocked()
	sh.mu.Unlock()
	if last {
		t.queueLocked(st)
	}
	t.queueMu.Unlock()
	return wait, nil
}
