// Package metrics holds what the engine's Prometheus metrics need beyond
// client_golang itself: a bounded table of per-peer counters (so that a
// cluster of thousands of peers cannot make thousands of label values), the
// size classes transfer latencies are kept by, and the optional HTTP
// listener that serves every engine of the process.
package metrics

import (
	"sort"
	"sync"
	"sync/atomic"
)

// OtherPeer is the peer label of everything counted for peers that have no
// label of their own.
const OtherPeer = "other"

// Ops, transports and statuses a peer's counters are kept by. Their order
// is the index into Peer's arrays.
var (
	Ops        = [...]string{"read", "write"}
	Transports = [...]string{"tcp", "rdma", "shm", "local"}
	Statuses   = [...]string{"completed", "failed", "canceled", "aborted"}
)

// Shards is how many ways the data path's counters are split: concurrent
// transfers count into different cache lines, so that counting does not make
// the cores take turns at one line. A caller picks a shard by anything that
// differs between concurrent transfers (a record's address).
const Shards = 8

// peerCell is one shard's counters of one op and transport: all a counted
// transfer touches is this one cache line.
type peerCell struct {
	// refs counts callers between Acquire and Release in this cell.
	refs  atomic.Int64
	bytes atomic.Uint64                // bytes of completed transfers
	tasks [len(Statuses)]atomic.Uint64 // transfers that ended, by status
	_     [64 - 16 - 8*len(Statuses)]byte
}

// Peer holds one peer's counters (or those of every peer under OtherPeer).
// All are updated with atomics: the data path never takes a lock to count.
type Peer struct {
	name  string
	cells [Shards][len(Ops)][len(Transports)]peerCell

	// retired is set when the peer gave its label up. A retired peer's
	// counts are folded into OtherPeer only once no caller holds it, so
	// none is lost: Acquire raises a cell's refs before it reads retired,
	// retire sets retired before it reads every cell's refs, and Go's
	// atomics are sequentially consistent, so one of the two sees the
	// other.
	retired atomic.Bool
	// last is the activity count at the last rebalance; only Rebalance
	// reads and writes it, under the table's lock.
	last uint64
}

// Slot names the cell a transfer is counted in: its shard (taken modulo
// Shards), its op and its transport (indexes into Ops and Transports).
type Slot struct{ Shard, Op, Transport int }

func (p *Peer) cell(s Slot) *peerCell { return &p.cells[s.Shard%Shards][s.Op][s.Transport] }

// Name is the peer's label value.
func (p *Peer) Name() string { return p.name }

// Count records one transfer that ended with status (an index into
// Statuses) in slot; bytes counts only when it completed.
func (p *Peer) Count(s Slot, status int, bytes uint64) {
	c := p.cell(s)
	c.tasks[status].Add(1)
	if status == 0 && bytes > 0 {
		c.bytes.Add(bytes)
	}
}

// Release ends what Acquire began, with the same slot.
func (p *Peer) Release(s Slot) { p.cell(s).refs.Add(-1) }

func (p *Peer) held() bool {
	for sh := range p.cells {
		for o := range p.cells[sh] {
			for t := range p.cells[sh][o] {
				if p.cells[sh][o][t].refs.Load() != 0 {
					return true
				}
			}
		}
	}
	return false
}

func (p *Peer) bytesOf(o, t int) uint64 {
	var n uint64
	for sh := range p.cells {
		n += p.cells[sh][o][t].bytes.Load()
	}
	return n
}

func (p *Peer) tasksOf(o, t, st int) uint64 {
	var n uint64
	for sh := range p.cells {
		n += p.cells[sh][o][t].tasks[st].Load()
	}
	return n
}

// activity is the number of transfers counted so far: a peer whose
// activity did not move over an interval was idle.
func (p *Peer) activity() uint64 {
	var n uint64
	for o := range Ops {
		for t := range Transports {
			for s := range Statuses {
				n += p.tasksOf(o, t, s)
			}
		}
	}
	return n
}

// Sample is one series of a peer's counters, as Snapshot reports it.
type Sample struct {
	Peer, Op, Transport, Status string // Status is "" for bytes
	Value                       uint64
}

// PeerTable gives at most Max peers a label of their own; the others count
// under OtherPeer. A peer keeps its label while it moves data; one that
// moved nothing over a whole rebalance interval gives it up, and the
// busiest peers counted under OtherPeer since the last rebalance take the
// free labels. A peer that gives its label up has its series end, as a
// series of a peer that left does: its counts are not added to OtherPeer's,
// which would make OtherPeer's rate show a burst of bytes that moved long
// before (and were counted once already). A label given anew starts from 0,
// which Prometheus reads as a counter reset. Memory is bounded too: at most
// Max labeled peers, the ones giving their label up while a count is under
// way, and 4*Max candidates.
type PeerTable struct {
	max int

	mu       sync.RWMutex
	byName   map[string]*Peer
	retiring map[string]*Peer // gave their label up while a count was under way: still shown, until unheld
	other    Peer

	// candidates counts, since the last rebalance, the transfers of peers
	// counted under OtherPeer (at most candidateFactor*max names: past it
	// the least active half is dropped, as a space-saving sketch would).
	candMu     sync.Mutex
	candidates map[string]uint64

	// gen changes whenever a rebalance moves a label, so that a Cached
	// lookup made before it is made again.
	gen atomic.Uint64
}

// Cached is one caller's memo of a peer's counters (a segment keeps one):
// AcquireCached skips the table's lock while the memo holds.
type Cached struct {
	p   *Peer
	gen uint64
}

// AcquireCached is Acquire through memo: while no rebalance moved a label
// since memo was made, it takes no lock.
func (t *PeerTable) AcquireCached(name string, slot Slot, memo *atomic.Pointer[Cached]) *Peer {
	gen := t.gen.Load()
	if c := memo.Load(); c != nil && c.gen == gen {
		p := c.p
		p.cell(slot).refs.Add(1)
		if !p.retired.Load() {
			if p == &t.other {
				t.noteCandidate(name)
			}
			return p
		}
		p.cell(slot).refs.Add(-1)
	}
	p := t.Acquire(name, slot)
	memo.Store(&Cached{p: p, gen: gen})
	return p
}

const candidateFactor = 4

// NewPeerTable returns a table giving at most max peers (at least 1) their
// own label.
func NewPeerTable(max int) *PeerTable {
	if max < 1 {
		max = 1
	}
	return &PeerTable{max: max, byName: map[string]*Peer{}, retiring: map[string]*Peer{}, other: Peer{name: OtherPeer}, candidates: map[string]uint64{}}
}

// Max is the number of peers that may have a label of their own.
func (t *PeerTable) Max() int { return t.max }

// Acquire returns the counters to count a transfer with peer name in, in
// slot: its own while it has a label (one is given when one is free),
// OtherPeer's otherwise. The caller calls Release(slot) once it counted.
func (t *PeerTable) Acquire(name string, slot Slot) *Peer {
	t.mu.RLock()
	p := t.byName[name]
	full := len(t.byName) >= t.max
	t.mu.RUnlock()
	if p == nil && !full {
		t.mu.Lock()
		if p = t.byName[name]; p == nil && len(t.byName) < t.max && t.retiring[name] == nil {
			p = &Peer{name: name}
			t.byName[name] = p
		}
		t.mu.Unlock()
	}
	if p != nil {
		p.cell(slot).refs.Add(1)
		if !p.retired.Load() {
			return p
		}
		p.cell(slot).refs.Add(-1)
	}
	t.noteCandidate(name)
	t.other.cell(slot).refs.Add(1)
	return &t.other
}

func (t *PeerTable) noteCandidate(name string) {
	t.candMu.Lock()
	defer t.candMu.Unlock()
	if _, ok := t.candidates[name]; !ok && len(t.candidates) >= candidateFactor*t.max {
		t.dropQuietCandidatesLocked()
	}
	t.candidates[name]++
}

// dropQuietCandidatesLocked forgets the less active half of the candidates.
func (t *PeerTable) dropQuietCandidatesLocked() {
	counts := make([]uint64, 0, len(t.candidates))
	for _, n := range t.candidates {
		counts = append(counts, n)
	}
	sort.Slice(counts, func(i, j int) bool { return counts[i] < counts[j] })
	median := counts[len(counts)/2]
	for name, n := range t.candidates {
		if n <= median {
			delete(t.candidates, name)
		}
	}
}

// Rebalance takes labels from peers idle since the last call and gives free
// labels to the busiest candidates. A peer that gave its label up is shown
// until no caller holds it (a count that raced its retirement is not hidden),
// then dropped. The engine calls it at most once per interval, from a
// scrape.
func (t *PeerTable) Rebalance() {
	t.mu.Lock()
	defer t.mu.Unlock()
	// Bumped before labels move: a memo made from here on is made again
	// at the next rebalance at the latest.
	t.gen.Add(1)
	for name, p := range t.byName {
		a := p.activity()
		if a == p.last {
			p.retired.Store(true)
			delete(t.byName, name)
			t.retiring[name] = p
			continue
		}
		p.last = a
	}
	for name, p := range t.retiring {
		if !p.held() {
			delete(t.retiring, name)
		}
	}

	t.candMu.Lock()
	type cand struct {
		name string
		n    uint64
	}
	cs := make([]cand, 0, len(t.candidates))
	for name, n := range t.candidates {
		cs = append(cs, cand{name, n})
	}
	clear(t.candidates)
	t.candMu.Unlock()
	sort.Slice(cs, func(i, j int) bool { return cs[i].n > cs[j].n || cs[i].n == cs[j].n && cs[i].name < cs[j].name })
	for _, c := range cs {
		if len(t.byName) >= t.max {
			break
		}
		// A peer still shown under its old label waits: two series with
		// one label set would make the scrape fail.
		if _, ok := t.byName[c.name]; !ok && t.retiring[c.name] == nil {
			// Its activity starts at zero: a label given now counts
			// from now; what came before stays in OtherPeer.
			t.byName[c.name] = &Peer{name: c.name, last: 0}
		}
	}
}

// Labeled returns the number of peers with a label of their own.
func (t *PeerTable) Labeled() int {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return len(t.byName)
}

// Snapshot returns every nonzero series: one per labeled peer (and peer
// still giving its label up), op, transport (and status, for transfer
// counts), and OtherPeer's.
func (t *PeerTable) Snapshot() (bytes, tasks []Sample) {
	t.mu.RLock()
	peers := make([]*Peer, 0, len(t.byName)+len(t.retiring))
	for _, p := range t.byName {
		peers = append(peers, p)
	}
	for _, p := range t.retiring {
		peers = append(peers, p)
	}
	t.mu.RUnlock()
	sort.Slice(peers, func(i, j int) bool { return peers[i].name < peers[j].name })
	peers = append(peers, &t.other)
	for _, p := range peers {
		for o := range Ops {
			for tr := range Transports {
				if v := p.bytesOf(o, tr); v > 0 {
					bytes = append(bytes, Sample{p.name, Ops[o], Transports[tr], "", v})
				}
				for s := range Statuses {
					if v := p.tasksOf(o, tr, s); v > 0 {
						tasks = append(tasks, Sample{p.name, Ops[o], Transports[tr], Statuses[s], v})
					}
				}
			}
		}
	}
	return bytes, tasks
}
