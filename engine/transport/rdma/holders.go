package rdma

import (
	"context"
	"sync"
)

// Bounds of the holder table. Paths release the rkeys they stopped using
// (see Endpoint.sweepKeys), so the table holds about what initiators use
// now; past the per-initiator bound the initiator is cut, which voids
// every rkey it holds (its engine asks again after any reconnect), so it
// is forgotten without losing safety; past the total bound the initiator
// holding the most is.
const (
	maxHoldsPerInitiator = 1 << 16
	maxHolds             = 1 << 20
)

// holders records, as owner, which initiators were handed rkeys for which
// request ids, per connection (path) with the sequence number of the
// path's last keys request for it. An rkey reaches a whole registration,
// so once handed out the owner's code no longer sees the request's bytes:
// an abort must cover every initiator that could still use rkeys admitted
// for the request, whether the application named it or not. An entry
// lives until the path releases it (it dropped those rkeys and has no work
// of the request out), the path's connection is dropped, or the
// initiator's QPs are all cut (a fence): its engine drops the rkeys of
// every path that broke or reconnected since it asked, so rkeys from
// before a cut never reach a QP connected after it.
type holders struct {
	mu     sync.Mutex
	byInit map[string]map[uint64]map[uint64]uint64 // initiator -> request id -> conn -> seq
	byRID  map[uint64]map[string]struct{}
	n      int // (initiator, request id) entries
}

func newHolders() *holders {
	return &holders{byInit: map[string]map[uint64]map[uint64]uint64{}, byRID: map[uint64]map[string]struct{}{}}
}

// add records that initiator's path conn is about to be handed rkeys for
// rid by its keys request seq, and reports whether that path held none for
// rid before (so a refusal can take the entry back), and the initiator to
// forget by cutting it when a bound is passed ("" if none). It runs before
// the owner admits the access, so an abort that bumps the request's
// generation after the admission finds the entry.
func (h *holders) add(initiator string, conn, seq, rid uint64) (added bool, evict string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	rids := h.byInit[initiator]
	if rids == nil {
		rids = map[uint64]map[uint64]uint64{}
		h.byInit[initiator] = rids
	}
	conns := rids[rid]
	if conns == nil {
		conns = map[uint64]uint64{}
		rids[rid] = conns
		inits := h.byRID[rid]
		if inits == nil {
			inits = map[string]struct{}{}
			h.byRID[rid] = inits
		}
		inits[initiator] = struct{}{}
		h.n++
	}
	old, had := conns[conn]
	conns[conn] = max(old, seq)
	switch {
	case len(rids) > maxHoldsPerInitiator:
		evict = initiator
	case h.n > maxHolds:
		most := 0
		for name, m := range h.byInit {
			if len(m) > most {
				most, evict = len(m), name
			}
		}
	}
	return !had, evict
}

// dropLocked removes conn's hold of rid for initiator, when its sequence
// number is at most upTo. Called with mu held.
func (h *holders) dropLocked(initiator string, rid, conn, upTo uint64) {
	rids := h.byInit[initiator]
	conns := rids[rid]
	if seq, ok := conns[conn]; !ok || seq > upTo {
		return
	}
	delete(conns, conn)
	if len(conns) > 0 {
		return
	}
	delete(rids, rid)
	h.n--
	if len(rids) == 0 {
		delete(h.byInit, initiator)
	}
	if inits := h.byRID[rid]; inits != nil {
		delete(inits, initiator)
		if len(inits) == 0 {
			delete(h.byRID, rid)
		}
	}
}

// remove takes back an entry add made for an access the owner refused.
func (h *holders) remove(initiator string, conn, rid uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.dropLocked(initiator, rid, conn, ^uint64(0))
}

// release drops conn's holds of rids made by keys requests up to seq: the
// path dropped those rkeys and has no work of them out. A later request of
// the same id (a higher seq) keeps its hold.
func (h *holders) release(initiator string, conn, seq uint64, rids []uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, rid := range rids {
		h.dropLocked(initiator, rid, conn, seq)
	}
}

// dropConn drops every hold of a connection that is gone.
func (h *holders) dropConn(initiator string, conn uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for rid := range h.byInit[initiator] {
		h.dropLocked(initiator, rid, conn, ^uint64(0))
	}
}

// of lists the initiators holding rkeys for rid.
func (h *holders) of(rid uint64) []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]string, 0, len(h.byRID[rid]))
	for name := range h.byRID[rid] {
		out = append(out, name)
	}
	return out
}

// holds reports whether initiator holds rkeys for rid.
func (h *holders) holds(initiator string, rid uint64) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	_, ok := h.byInit[initiator][rid]
	return ok
}

// forget drops every entry of an initiator whose QPs were all cut.
func (h *holders) forget(initiator string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for rid := range h.byInit[initiator] {
		if inits := h.byRID[rid]; inits != nil {
			delete(inits, initiator)
			if len(inits) == 0 {
				delete(h.byRID, rid)
			}
		}
		h.n--
	}
	delete(h.byInit, initiator)
}

// count is the number of (initiator, request id) entries.
func (h *holders) count() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.n
}

// Holders implements transport.AccessTracker: the initiators that were
// handed rkeys for requestID and have not released them since, and whose
// QPs were not all cut since.
func (t *Transport) Holders(requestID uint64) []string { return t.holds.of(requestID) }

// forgetByFence cuts an initiator that holds too many entries: its rkeys
// are void once its QPs are, so its entries can go.
func (t *Transport) forgetByFence(initiator string) {
	t.stats.HolderEvictions.Add(1)
	t.log.Info("kvferry: rdma initiator holds rkeys for too many requests; cutting its QPs so it asks again", "peer", initiator)
	if err := t.cut(context.Background(), initiator); err != nil {
		t.log.Warn("kvferry: rdma cut of an initiator failed", "peer", initiator, "err", err)
	}
}
