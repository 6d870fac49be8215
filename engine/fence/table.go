// Package fence keeps an owner's fences by memory range: which ranges of its
// memory were fenced, at which epoch, and which copies into or out of them
// are in progress.
//
// An epoch is a number the owner issues: each fence takes the next one, and
// every transfer carries the epoch its initiator knew when the transfer was
// planned (its stamp). A transfer stamped s is void for a byte that a fence
// of epoch > s covers: it was planned before that fence. Transfers planned
// after the fence carry its epoch (the initiator learned it from the fence
// notice, a refusal or a descriptor), so they pass. "Planned before" is thus
// decided by what the owner issued, never by timing.
//
// The log is bounded: past MaxEntries fences the oldest is folded into a
// floor, below which every stamp is void for every range. Folding only
// refuses more (transfers planned that many fences ago), never less. A stamp
// past the last epoch issued is refused too: no initiator can know it.
package fence

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"
	"sync/atomic"

	"github.com/kvferry/kvferry/engine/transport"
)

// ErrFenced is the refusal of an access planned before a fence of a range
// it touches; it is always wrapped together with transport.ErrRefused by the
// transports, and is final for the transfer.
var ErrFenced = transport.ErrFenced

// MaxEntries bounds the fences remembered one by one (see the package doc).
const MaxEntries = 4096

// MaxRanges bounds the ranges of one fence (a FENCE notice carries them
// all: 8 MiB).
const MaxRanges = 1 << 19

// MaxTotalRanges bounds the ranges remembered over all fences (32 MiB):
// past it the oldest fences fold into the floor, as past MaxEntries.
const MaxTotalRanges = 1 << 21

// Range is a range of owner memory.
type Range struct{ Addr, Len uint64 }

func (r Range) overlaps(addr, n uint64) bool {
	return n > 0 && r.Len > 0 && addr < r.Addr+r.Len && r.Addr < addr+n
}

type entry struct {
	epoch  uint64
	ranges []Range // sorted, merged (see Normalize)
}

// overlaps reports whether [addr, addr+n) meets one of the ranges, by
// binary search.
func (e *entry) overlaps(addr, n uint64) bool {
	i := sort.Search(len(e.ranges), func(i int) bool { r := e.ranges[i]; return r.Addr+r.Len > addr })
	return i < len(e.ranges) && e.ranges[i].overlaps(addr, n)
}

// Overlaps reports whether [addr, addr+n) meets one of ranges, which must
// be normalized (see Normalize).
func Overlaps(ranges []Range, addr, n uint64) bool {
	e := entry{ranges: ranges}
	return e.overlaps(addr, n)
}

// Normalize sorts ranges by address and merges those that overlap or
// touch, in place; it returns the merged prefix.
func Normalize(ranges []Range) []Range {
	slices.SortFunc(ranges, func(a, b Range) int { return cmp.Compare(a.Addr, b.Addr) })
	out := ranges[:0]
	for _, r := range ranges {
		if k := len(out) - 1; k >= 0 && r.Addr <= out[k].Addr+out[k].Len {
			out[k].Len = max(out[k].Addr+out[k].Len, r.Addr+r.Len) - out[k].Addr
			continue
		}
		out = append(out, r)
	}
	return out
}

// Table is one owner's fences. The zero value is not usable; use New.
type Table struct {
	epoch atomic.Uint64 // last fence's epoch; read without mu on the fast path

	mu     sync.Mutex
	floor  uint64         // stamps below it are void everywhere
	log    []entry        // ascending epochs, all above floor-1
	ranges int            // ranges in log
	active map[*guard]int // chunks in progress per access

	folded atomic.Uint64
}

// New returns an empty table at epoch base (an engine starts at 0). A
// restarted owner counts from its base again: an initiator that still holds
// a higher epoch of the earlier incarnation has its stamps refused as never
// issued, and starts afresh when it sees the owner's descriptor epoch below
// its own; transfers planned against the earlier incarnation carry its
// buffer keys, which the new one refuses anyway.
func New(base uint64) *Table {
	t := &Table{active: map[*guard]int{}, floor: base}
	t.epoch.Store(base)
	return t
}

// Epoch returns the epoch of the last fence (the table's base before any):
// the stamp of a transfer planned now.
func (t *Table) Epoch() uint64 { return t.epoch.Load() }

// Floor returns the stamp below which every access is void.
func (t *Table) Floor() uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.floor
}

// Folded counts fences folded into the floor at the bound.
func (t *Table) Folded() uint64 { return t.folded.Load() }

// Len returns the fences remembered one by one.
func (t *Table) Len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.log)
}

// voidLocked reports the epoch of a fence that voids an access stamped
// stamp to [addr, addr+n), or 0.
func (t *Table) voidLocked(stamp, addr, n uint64) uint64 {
	if stamp < t.floor {
		return t.floor
	}
	for i := len(t.log) - 1; i >= 0 && t.log[i].epoch > stamp; i-- {
		if t.log[i].overlaps(addr, n) {
			return t.log[i].epoch
		}
	}
	return 0
}

// Check refuses an access stamped stamp to [addr, addr+n) that a fence
// voids. It never blocks for long (a short lock, only when a fence is newer
// than the stamp).
func (t *Table) Check(stamp, addr, n uint64) error {
	switch ep := t.epoch.Load(); {
	case stamp == ep:
		return nil
	case stamp > ep:
		// No initiator can know an epoch not issued yet: a bug, or a
		// peer trying to pass every fence.
		return fmt.Errorf("%w: stamped with fence epoch %d, past the last one issued (%d)", ErrFenced, stamp, ep)
	}
	t.mu.Lock()
	ep := t.voidLocked(stamp, addr, n)
	t.mu.Unlock()
	if ep != 0 {
		return refusal(stamp, ep)
	}
	return nil
}

func refusal(stamp, epoch uint64) error {
	return fmt.Errorf("%w: planned at fence epoch %d, before the fence of epoch %d", ErrFenced, stamp, epoch)
}

// Guard returns a guard for an access stamped stamp to [addr, addr+n): it
// enters inner and refuses once a fence voids the access; a fence waits for
// a chunk inside it. Check the access first; Guard does not.
func (t *Table) Guard(inner transport.Guard, stamp, addr, n uint64) transport.Guard {
	return &guard{t: t, inner: inner, stamp: stamp, addr: addr, n: n}
}

// guard is one access's: its chunks are listed in active while they run.
type guard struct {
	t              *Table
	inner          transport.Guard
	stamp, addr, n uint64
	waiters        []*waiter // fences waiting for the chunk in progress
}

type waiter struct {
	left int
	done chan struct{}
}

func (g *guard) Enter() error {
	t := g.t
	t.mu.Lock()
	if g.stamp > t.epoch.Load() {
		t.mu.Unlock()
		return t.Check(g.stamp, g.addr, g.n)
	}
	if ep := t.voidLocked(g.stamp, g.addr, g.n); ep != 0 {
		t.mu.Unlock()
		return refusal(g.stamp, ep)
	}
	t.active[g]++
	t.mu.Unlock()
	if err := g.inner.Enter(); err != nil {
		g.leave()
		return err
	}
	return nil
}

func (g *guard) Leave() {
	g.inner.Leave()
	g.leave()
}

func (g *guard) leave() {
	t := g.t
	t.mu.Lock()
	if t.active[g]--; t.active[g] > 0 {
		t.mu.Unlock()
		return
	}
	delete(t.active, g)
	for _, w := range g.waiters {
		if w.left--; w.left == 0 {
			close(w.done)
		}
	}
	g.waiters = g.waiters[:0]
	t.mu.Unlock()
}

// ErrInvalid is returned for a fence without ranges, with an empty range or
// one that wraps, or with more than MaxRanges ranges.
var ErrInvalid = errors.New("invalid fence")

// Fence voids every access stamped below the new epoch for the ranges from
// now on, and returns the epoch and a channel closed once no chunk of such
// an access is in progress (nil when none is). ranges is kept: the caller
// must not change it afterwards.
func (t *Table) Fence(ranges []Range) (uint64, <-chan struct{}, error) {
	if len(ranges) == 0 || len(ranges) > MaxRanges {
		return 0, nil, fmt.Errorf("%w: %d ranges (1 to %d)", ErrInvalid, len(ranges), MaxRanges)
	}
	for _, r := range ranges {
		if r.Len == 0 || r.Addr+r.Len < r.Addr {
			return 0, nil, fmt.Errorf("%w: range [%#x, +%d)", ErrInvalid, r.Addr, r.Len)
		}
	}
	ranges = Normalize(ranges)
	t.mu.Lock()
	defer t.mu.Unlock()
	ep := t.epoch.Load() + 1
	for len(t.log) > 0 && (len(t.log) >= MaxEntries || t.ranges+len(ranges) > MaxTotalRanges) {
		// Fold the oldest: every stamp below its epoch becomes void
		// everywhere, which refuses a superset of what it refused.
		t.floor = t.log[0].epoch
		t.ranges -= len(t.log[0].ranges)
		t.log[0] = entry{}
		t.log = t.log[1:]
		t.folded.Add(1)
	}
	t.log = append(t.log, entry{epoch: ep, ranges: ranges})
	t.ranges += len(ranges)
	fenced := &t.log[len(t.log)-1]
	// Published under mu: a guard entering after this sees the entry; one
	// already in is listed in active and waited for below.
	t.epoch.Store(ep)
	var w *waiter
	for g := range t.active {
		if g.stamp >= ep {
			continue
		}
		if !fenced.overlaps(g.addr, g.n) {
			continue
		}
		if w == nil {
			w = &waiter{done: make(chan struct{})}
		}
		w.left++
		g.waiters = append(g.waiters, w)
	}
	if w == nil {
		return ep, nil, nil
	}
	return ep, w.done, nil
}

// Fenced is one fence: its epoch and ranges.
type Fenced struct {
	Epoch  uint64
	Ranges []Range
}

// Known is what an initiator knows of one owner's fences, from its notices:
// the epoch to stamp transfers with, and which stamps are void where, so
// that it never posts a transfer the owner fenced (on rdma the owner's code
// does not see the bytes). It is bounded like the owner's Table.
type Known struct {
	epoch  atomic.Uint64
	mu     sync.Mutex
	floor  uint64
	log    []entry
	ranges int // ranges in log
}

// Epoch returns the newest epoch learned: the stamp of a transfer planned
// now.
func (k *Known) Epoch() uint64 { return k.epoch.Load() }

// Learn records an owner's epoch (a descriptor says it) without ranges: a
// stamp below it is not void by itself.
func (k *Known) Learn(epoch uint64) {
	for {
		cur := k.epoch.Load()
		if epoch <= cur || k.epoch.CompareAndSwap(cur, epoch) {
			return
		}
	}
}

// Reset forgets everything: the owner restarted and counts from 0 again.
func (k *Known) Reset() {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.epoch.Store(0)
	k.floor = 0
	clear(k.log)
	k.log, k.ranges = nil, 0
}

// Apply records fences and a floor from a notice; it reports whether any
// of it was new. It sorts the ranges: use ApplyNormalized for ranges that
// are already (see Normalize), to keep the work out of a caller's lock.
func (k *Known) Apply(floor uint64, fences []Fenced) bool { return k.apply(floor, fences, false) }

// ApplyNormalized is Apply for fences whose ranges Normalize returned.
func (k *Known) ApplyNormalized(floor uint64, fences []Fenced) bool {
	return k.apply(floor, fences, true)
}

func (k *Known) apply(floor uint64, fences []Fenced, normalized bool) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	news := false
	if floor > k.floor {
		k.floor, news = floor, true
	}
	for _, f := range fences {
		i := len(k.log)
		for i > 0 && k.log[i-1].epoch >= f.Epoch {
			i--
		}
		if i < len(k.log) && k.log[i].epoch == f.Epoch {
			continue
		}
		if f.Epoch < k.floor {
			continue
		}
		rs := f.Ranges
		if !normalized {
			rs = Normalize(rs)
		}
		if len(rs) > MaxRanges {
			// More than an owner sends: taken as a fence of everything
			// below its epoch.
			k.floor = max(k.floor, f.Epoch)
			rs = nil
		}
		k.log = append(k.log, entry{})
		copy(k.log[i+1:], k.log[i:])
		k.log[i] = entry{epoch: f.Epoch, ranges: rs}
		k.ranges += len(rs)
		news = true
		for len(k.log) > 1 && (len(k.log) > MaxEntries || k.ranges > MaxTotalRanges) {
			k.floor = max(k.floor, k.log[0].epoch)
			k.ranges -= len(k.log[0].ranges)
			k.log[0] = entry{}
			k.log = k.log[1:]
		}
		k.Learn(f.Epoch)
	}
	k.Learn(floor)
	return news
}

// Void reports whether a transfer stamped stamp to [addr, addr+n) was
// fenced, as far as this initiator knows.
func (k *Known) Void(stamp, addr, n uint64) bool {
	if stamp >= k.epoch.Load() {
		return false
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if stamp < k.floor {
		return true
	}
	for i := len(k.log) - 1; i >= 0 && k.log[i].epoch > stamp; i-- {
		if k.log[i].overlaps(addr, n) {
			return true
		}
	}
	return false
}
