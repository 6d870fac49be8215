package rdma

import (
	"context"
	"sync"
)

// Bounds of the holder table. Past the per-initiator bound the initiator is
// fenced, which voids every rkey it holds (its engine asks again after any
// reconnect), so it is forgotten without losing safety; past the total
// bound the initiator holding the most is.
const (
	maxHoldsPerInitiator = 1 << 16
	maxHolds             = 1 << 20
)

// holders records, as owner, which initiators were handed rkeys for which
// request ids. An rkey reaches a whole registration, so once handed out
// the owner's code no longer sees the request's bytes: an abort must cut
// every initiator that could still use rkeys admitted for the request,
// whether the application named it or not. An entry lives until the
// initiator's QPs are all cut (a fence, or its last connection dropped):
// its engine drops the rkeys of every path that broke or reconnected since
// it asked, so rkeys from before a cut never reach a QP connected after it.
type holders struct {
	mu     sync.Mutex
	byInit map[string]map[uint64]struct{}
	byRID  map[uint64]map[string]struct{}
	n      int
}

func newHolders() *holders {
	return &holders{byInit: map[string]map[uint64]struct{}{}, byRID: map[uint64]map[string]struct{}{}}
}

// add records that initiator is about to be handed rkeys for rid and
// reports whether the entry is new (so a refusal can take it back), and
// the initiator to forget by fencing when a bound is passed ("" if none).
// It runs before the owner admits the access, so an abort that bumps the
// request's generation after the admission finds the entry.
func (h *holders) add(initiator string, rid uint64) (added bool, evict string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	rids := h.byInit[initiator]
	if _, ok := rids[rid]; ok {
		return false, ""
	}
	if rids == nil {
		rids = map[uint64]struct{}{}
		h.byInit[initiator] = rids
	}
	rids[rid] = struct{}{}
	inits := h.byRID[rid]
	if inits == nil {
		inits = map[string]struct{}{}
		h.byRID[rid] = inits
	}
	inits[initiator] = struct{}{}
	h.n++
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
	return true, evict
}

// remove takes back an entry add made for an access the owner refused.
func (h *holders) remove(initiator string, rid uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if rids := h.byInit[initiator]; rids != nil {
		if _, ok := rids[rid]; ok {
			delete(rids, rid)
			h.n--
			if len(rids) == 0 {
				delete(h.byInit, initiator)
			}
		}
	}
	if inits := h.byRID[rid]; inits != nil {
		delete(inits, initiator)
		if len(inits) == 0 {
			delete(h.byRID, rid)
		}
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

// count is the number of entries.
func (h *holders) count() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.n
}

// Holders implements transport.AccessTracker: the initiators that were
// handed rkeys for requestID and whose QPs were not all cut since.
func (t *Transport) Holders(requestID uint64) []string { return t.holds.of(requestID) }

// Holds reports whether initiator holds rkeys for requestID.
func (t *Transport) Holds(initiator string, requestID uint64) bool {
	return t.holds.holds(initiator, requestID)
}

// forgetByFence cuts an initiator that holds too many entries: its rkeys
// are void once its QPs are, so its entries can go.
func (t *Transport) forgetByFence(initiator string) {
	t.stats.HolderEvictions.Add(1)
	t.log.Info("kvferry: rdma initiator holds rkeys for too many requests; cutting its QPs so it asks again", "peer", initiator)
	if err := t.cut(context.Background(), initiator); err != nil {
		t.log.Warn("kvferry: rdma cut of an initiator failed", "peer", initiator, "err", err)
	}
}
