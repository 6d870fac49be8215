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
//
// Every state the table keeps is bounded:
//   - request ids remembered without a live grant (aborted ones, and ones
//     whose grants were all revoked): MaxTombstones, plus those with a
//     chunk in progress, which are never forgotten;
//   - request ids with live grants: at most one per grant, MaxGrants;
//   - request ids with chunks in progress and nothing else: one per chunk
//     at most, forgotten when the last chunk leaves;
//   - the age queue: one entry per remembered request id, however often
//     it is aborted or revoked again;
//   - channels Abort and Revoke wait on: one per request id, shared;
//   - grant ranges: MaxGrantRanges per grant and MaxRanges in all.
type Options struct {
	// MaxTombstones caps the request ids remembered without a live grant
	// (default 1<<16): aborted ones (tombstones) and ones whose grants were
	// all revoked. Past it the table forgets down to 7/8 of it, those
	// acknowledged first (revoked ones count as acknowledged), oldest
	// first, then the oldest not acknowledged (counted as forced
	// evictions); never one with a chunk in progress, nor the one just
	// aborted or revoked.
	MaxTombstones int
	// TombstoneTTL is how long an aborted request id is remembered after
	// every initiator named acknowledged the abort (default 10 minutes);
	// likewise a request id whose grants were all revoked, from the last
	// revoke. Tombstones not acknowledged are kept until MaxTombstones
	// forces them out.
	TombstoneTTL time.Duration
	// MaxGrants caps the live grants (default 1<<18).
	MaxGrants int
	// MaxRanges caps the ranges of all live grants together (default
	// 1<<20, 16 MiB of ranges).
	MaxRanges int
}

// state is one request id's state. A request id without state has
// generation 0, no grants and no copy in progress.
type state struct {
	rid    uint64
	gen    uint32 // the current generation
	minGen uint32 // accesses below are refused
	active int32  // chunks entered and not left
	// idle is closed once no chunk is in progress; nil while nobody
	// waits. Every Abort and Revoke waiting at once shares it.
	idle   chan struct{}
	grants []*Grant

	restricted bool // it has had grants: every access needs a live one
	tomb       bool // it was aborted
	acked      bool // every initiator named acknowledged the last abort

	// queued: the state is in the age queue. Written under both
	// Table.queueMu and the shard's lock, so either lock reads it.
	queued bool
}

// keep reports whether the state holds anything beyond defaults.
func (s *state) keep() bool {
	return s.tomb || s.restricted || s.queued || s.active > 0 || s.idle != nil || len(s.grants) > 0
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
		st = &state{rid: rid}
		sh.m[rid] = st
	}
	return st
}

// Table is the owner's request state. It is safe for concurrent use.
type Table struct {
	opts   Options
	shards [nshards]shard

	// Lock order: queueMu, then grantMu, then a shard's lock.
	grantMu sync.Mutex
	grants  map[uint64]*Grant
	ranges  int // ranges of the live grants
	grantID atomic.Uint64

	// queueMu guards the age queue: the request ids remembered without a
	// live grant, each once, oldest first by the time they were last
	// aborted or revoked. Its policy (forget) takes a shard's lock.
	queueMu sync.Mutex
	age     *ageQueue

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
	if opts.MaxRanges <= 0 {
		opts.MaxRanges = 1 << 20
	}
	t := &Table{opts: opts, grants: map[uint64]*Grant{}}
	t.age = t.newAgeQueue()
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
	err := check(st, g.gen, g.grant)
	if err == nil && g.grant != nil && g.grant.revoked {
		// The grant this access was admitted under was withdrawn
		// (Revoke, or an Abort of its request): refused even when the
		// request's state is gone since (forgotten at the cap), where
		// check alone would take the access for one of generation 0
		// of a request never granted.
		err = ErrNotGranted
		if g.grant.aborted {
			err = ErrAborted // the initiator learns the abort from it
		}
	}
	if err != nil {
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
		if st.idle != nil {
			close(st.idle)
			st.idle = nil
			woke = true
		}
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
// or nil when none is now. Callers waiting at once share the channel, so
// repeated aborts of a request stuck mid-chunk add nothing.
func (st *state) waitLocked() <-chan struct{} {
	if st.active == 0 {
		return nil
	}
	if st.idle == nil {
		st.idle = make(chan struct{})
	}
	return st.idle
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
	sh := t.shard(rid)
	t.queueMu.Lock() // held until queued: the queue stays in the order of aborts
	sh.mu.Lock()
	st := sh.stateLocked(rid)
	if st.gen == math.MaxUint32 {
		sh.mu.Unlock()
		t.queueMu.Unlock()
		return 0, nil, fmt.Errorf("abort request %d: %w: generations exhausted", rid, ErrFull)
	}
	st.gen++
	st.minGen = st.gen
	revoked := st.grants
	for _, g := range revoked {
		g.revoked, g.aborted = true, true
	}
	st.grants = nil
	if !st.tomb {
		t.tombs.Add(1)
	}
	st.tomb, st.acked, st.queued = true, acked, true
	gen, wait := st.gen, st.waitLocked()
	sh.mu.Unlock()
	t.queueLocked(st)
	t.queueMu.Unlock()

	if len(revoked) > 0 {
		t.grantMu.Lock()
		for _, g := range revoked {
			t.dropGrantLocked(g)
		}
		t.grantMu.Unlock()
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
