// Package requests keeps the owner's per-request state that makes aborts
// safe on transports whose owner copies every byte (tcp, local): each request
// id's generation, the grants that restrict who may touch which ranges for
// it, the tombstones of aborted requests, and the count of copies of it in
// progress, so that an abort returns only when none is.
//
// Every access of a request carries the generation it was planned under.
// Aborting a request bumps its generation: from then on accesses below it
// are refused, at admission and again before each chunk (Guard.Enter), and
// Abort waits for the chunks already entered. Enter never blocks and a chunk
// is a non-blocking copy, so that wait is short whatever the initiator does.
package requests

import (
	"errors"
	"fmt"
	"math"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
)

// Errors of the table; match them with errors.Is. Every refusal also
// matches transport.ErrRefused.
var (
	// ErrAborted: the access's request id was aborted at or after its
	// generation.
	ErrAborted = fmt.Errorf("%w: %w", transport.ErrRefused, transport.ErrAborted)
	// ErrNotGranted: the request id has grants and none of them covers the
	// access.
	ErrNotGranted = fmt.Errorf("%w: access outside the request's grants", transport.ErrRefused)
	// ErrGeneration: the access names a generation the owner never issued.
	ErrGeneration = fmt.Errorf("%w: generation not issued by the owner", transport.ErrRefused)
	// ErrFull: too many grants or tombstones; see Options.
	ErrFull = errors.New("request table full")
	// ErrUnknownGrant: Revoke of a grant id that is not live.
	ErrUnknownGrant = errors.New("unknown grant id")
)

// Options bound the table. Zero fields take the defaults.
type Options struct {
	// MaxTombstones caps the aborted request ids remembered (default
	// 1<<16). Past it the oldest are forgotten even if an initiator has
	// not acknowledged them (counted as forced evictions).
	MaxTombstones int
	// TombstoneTTL is how long an aborted request id is remembered after
	// every initiator named acknowledged the abort (default 10 minutes).
	// Tombstones not acknowledged are kept until MaxTombstones forces them
	// out.
	TombstoneTTL time.Duration
	// MaxGrants caps the live grants (default 1<<18).
	MaxGrants int
}

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

// state is one request id's state. A request id without state has
// generation 0, no grants and no copy in progress.
type state struct {
	gen     uint32 // the current generation
	minGen  uint32 // accesses below are refused
	active  int32  // chunks entered and not left
	waiters []chan struct{}
	grants  []*Grant

	restricted bool // it has had grants: every access needs a live one
	tomb       bool // it was aborted
	acked      bool // every initiator named acknowledged the last abort
	since      time.Time
}

// keep reports whether the state holds anything beyond defaults.
func (s *state) keep() bool {
	return s.tomb || s.restricted || s.active > 0 || len(s.waiters) > 0 || len(s.grants) > 0
}

const nshards = 64

type shard struct {
	mu sync.Mutex
	m  map[uint64]*state
}

// stateLocked returns rid's state, creating it; the shard is locked.
func (sh *shard) stateLocked(rid uint64) *state {
	st := sh.m[rid]
	if st == nil {
		st = &state{}
		sh.m[rid] = st
	}
	return st
}

type tombRef struct {
	rid   uint64
	since time.Time
}

// Table is the owner's request state. It is safe for concurrent use.
type Table struct {
	opts   Options
	shards [nshards]shard

	grantMu sync.Mutex
	grants  map[uint64]*Grant
	grantID atomic.Uint64

	queueMu sync.Mutex
	queue   []tombRef // aborted request ids, oldest first

	tombs, evicted, forced atomic.Int64
}

// New returns an empty table.
func New(opts Options) *Table {
	if opts.MaxTombstones <= 0 {
		opts.MaxTombstones = 1 << 16
	}
	if opts.TombstoneTTL <= 0 {
		opts.TombstoneTTL = 10 * time.Minute
	}
	if opts.MaxGrants <= 0 {
		opts.MaxGrants = 1 << 18
	}
	t := &Table{opts: opts, grants: map[uint64]*Grant{}}
	for i := range t.shards {
		t.shards[i].m = map[uint64]*state{}
	}
	return t
}

func (t *Table) shard(rid uint64) *shard {
	return &t.shards[(rid*0x9E3779B97F4A7C15)>>(64-6)]
}

// check decides whether an access of generation gen under grant g may
// proceed; st may be nil. Called with the shard locked.
func check(st *state, gen uint32, g *Grant) error {
	if st == nil {
		if gen != 0 {
			return ErrGeneration
		}
		return nil
	}
	if gen < st.minGen {
		return ErrAborted
	}
	if gen > st.gen {
		return ErrGeneration
	}
	if st.restricted && (g == nil || g.revoked || g.Generation != gen) {
		return ErrNotGranted
	}
	return nil
}

// Admit checks an access against its request's state and returns the guard
// to hold around each chunk: it enters r and checks the request again.
// Accesses of request id 0 are checked against r alone.
func (t *Table) Admit(a *transport.Access, r *memory.Region) (transport.Guard, error) {
	if a.RequestID == 0 {
		return r, nil
	}
	sh := t.shard(a.RequestID)
	sh.mu.Lock()
	st := sh.m[a.RequestID]
	var g *Grant
	if st != nil && st.restricted {
		for _, c := range st.grants {
			if (a.GrantID == 0 || a.GrantID == c.ID) && c.covers(a.Initiator, a.Addr, a.Length) {
				g = c
				break
			}
		}
	}
	err := check(st, a.Generation, g)
	sh.mu.Unlock()
	if err != nil {
		return nil, err
	}
	return &guard{sh: sh, reg: r, rid: a.RequestID, gen: a.Generation, grant: g}, nil
}

// guard pins a region and counts a chunk of one request in progress.
type guard struct {
	sh    *shard
	reg   *memory.Region
	rid   uint64
	gen   uint32
	grant *Grant
}

func (g *guard) Enter() error {
	if err := g.reg.Enter(); err != nil {
		return err
	}
	sh := g.sh
	sh.mu.Lock()
	st := sh.m[g.rid]
	if err := check(st, g.gen, g.grant); err != nil {
		sh.mu.Unlock()
		g.reg.Leave()
		return err
	}
	if st == nil {
		st = sh.stateLocked(g.rid)
	}
	st.active++
	sh.mu.Unlock()
	return nil
}

func (g *guard) Leave() {
	sh := g.sh
	sh.mu.Lock()
	st := sh.m[g.rid]
	st.active--
	woke := false
	if st.active == 0 {
		for _, w := range st.waiters {
			close(w)
			woke = true
		}
		st.waiters = nil
		if !st.keep() {
			delete(sh.m, g.rid)
		}
	}
	sh.mu.Unlock()
	g.reg.Leave()
	if woke {
		// The woken Abort waits in this P's runnext while the copying
		// goroutine streams on, up to a 10 ms preemption when data keeps
		// coming: hand the P over so the abort returns now.
		runtime.Gosched()
	}
}

// waitLocked returns a channel closed once no chunk of st is in progress,
// or nil when none is now.
func (st *state) waitLocked() <-chan struct{} {
	if st.active == 0 {
		return nil
	}
	ch := make(chan struct{})
	st.waiters = append(st.waiters, ch)
	return ch
}

// Abort bumps the request's generation, refuses every access below it from
// now on (its grants are revoked), and returns the new generation and a
// channel closed once no chunk of the request is in progress (nil when none
// is). acked says whether the tombstone may age out without an
// acknowledgement (an abort that names no initiator).
func (t *Table) Abort(rid uint64, acked bool) (uint32, <-chan struct{}, error) {
	if rid == 0 {
		return 0, nil, fmt.Errorf("abort: %w: request id 0", memory.ErrInvalidArg)
	}
	now := time.Now()
	sh := t.shard(rid)
	sh.mu.Lock()
	st := sh.stateLocked(rid)
	if st.gen == math.MaxUint32 {
		sh.mu.Unlock()
		return 0, nil, fmt.Errorf("abort request %d: %w: generations exhausted", rid, ErrFull)
	}
	st.gen++
	st.minGen = st.gen
	revoked := st.grants
	for _, g := range revoked {
		g.revoked = true
	}
	st.grants = nil
	newTomb := !st.tomb
	st.tomb, st.acked, st.since = true, acked, now
	gen, wait := st.gen, st.waitLocked()
	sh.mu.Unlock()

	if len(revoked) > 0 {
		t.grantMu.Lock()
		for _, g := range revoked {
			delete(t.grants, g.ID)
		}
		t.grantMu.Unlock()
	}
	if newTomb {
		t.tombs.Add(1)
	}
	t.queueMu.Lock()
	t.queue = append(t.queue, tombRef{rid: rid, since: now})
	t.queueMu.Unlock()
	if t.tombs.Load() > int64(t.opts.MaxTombstones) {
		t.trim()
	}
	return gen, wait, nil
}

// Acked records that every initiator acknowledged the abort of rid at gen,
// so its tombstone may age out.
func (t *Table) Acked(rid uint64, gen uint32) {
	sh := t.shard(rid)
	sh.mu.Lock()
	if st := sh.m[rid]; st != nil && st.tomb && st.gen == gen {
		st.acked = true
	}
	sh.mu.Unlock()
}

// Generation returns the request's current generation.
func (t *Table) Generation(rid uint64) uint32 {
	sh := t.shard(rid)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if st := sh.m[rid]; st != nil {
		return st.gen
	}
	return 0
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
	t.grantMu.Unlock()
	out.Ranges = append([]Range(nil), g.Ranges...) // the caller's copy: editing it changes nothing enforced
	return out, nil
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
	delete(t.grants, id)
	t.grantMu.Unlock()
	if g == nil {
		return nil, fmt.Errorf("revoke grant %d: %w", id, ErrUnknownGrant)
	}
	now := time.Now()
	sh := t.shard(g.RequestID)
	sh.mu.Lock()
	st := sh.m[g.RequestID]
	if st == nil || g.revoked {
		// Not reachable while grants join their state first; never
		// panic with the shard locked.
		sh.mu.Unlock()
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
		// Remembered like a tombstone, so that it ages out.
		st.since = now
		if !st.tomb {
			st.acked = true
		}
	}
	wait := st.waitLocked()
	sh.mu.Unlock()
	if last {
		t.queueMu.Lock()
		t.queue = append(t.queue, tombRef{rid: g.RequestID, since: now})
		t.queueMu.Unlock()
	}
	return wait, nil
}

// Sweep forgets the tombstones (and request ids whose grants were all
// revoked) that every initiator acknowledged and that aged out. The engine
// calls it periodically.
func (t *Table) Sweep(now time.Time) {
	t.queueMu.Lock()
	defer t.queueMu.Unlock()
	var held []tombRef
	i := 0
	for ; i < len(t.queue); i++ {
		ref := t.queue[i]
		if now.Sub(ref.since) < t.opts.TombstoneTTL {
			break
		}
		switch t.evict(ref, false) {
		case evictHeld:
			held = append(held, ref) // not acknowledged, or busy: kept
		}
	}
	t.queue = append(held, t.queue[i:]...)
}

// trim forgets tombstones past MaxTombstones, down to 7/8 of it so that the
// walk is paid once per many aborts: acknowledged ones first, oldest first,
// and only then, counted as forced, those not acknowledged.
func (t *Table) trim() {
	t.queueMu.Lock()
	defer t.queueMu.Unlock()
	target := int64(t.opts.MaxTombstones) * 7 / 8
	for _, force := range []bool{false, true} {
		kept := t.queue[:0]
		for _, ref := range t.queue {
			if t.tombs.Load() > target && t.evict(ref, force) != evictHeld {
				continue
			}
			kept = append(kept, ref)
		}
		clear(t.queue[len(kept):])
		t.queue = kept
	}
}

type evictResult int

const (
	evictHeld  evictResult = iota // kept
	evictStale                    // the entry no longer names a state
	evictDone                     // forgotten
)

// evict forgets the state ref names if it is idle and acknowledged (or
// force), and reports what it did.
func (t *Table) evict(ref tombRef, force bool) evictResult {
	sh := t.shard(ref.rid)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	st := sh.m[ref.rid]
	switch {
	case st == nil || !st.since.Equal(ref.since):
		return evictStale // renewed (queued again) or gone
	case len(st.grants) > 0:
		return evictStale // live grants: a later revoke queues it again
	case st.active > 0 || (!st.acked && !force):
		return evictHeld
	}
	delete(sh.m, ref.rid)
	if st.tomb {
		t.tombs.Add(-1)
	}
	t.evicted.Add(1)
	if !st.acked {
		t.forced.Add(1)
	}
	return evictDone
}

// Stats are the table's counters.
type Stats struct {
	Tombstones      int64 // aborted request ids remembered
	Grants          int   // live grants
	Evicted         int64 // entries forgotten after aging out or at the cap
	ForcedEvictions int64 // tombstones forgotten at the cap before an acknowledgement
}

// Stats returns a snapshot of the counters.
func (t *Table) Stats() Stats {
	t.grantMu.Lock()
	n := len(t.grants)
	t.grantMu.Unlock()
	return Stats{Tombstones: t.tombs.Load(), Grants: n, Evicted: t.evicted.Load(), ForcedEvictions: t.forced.Load()}
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
