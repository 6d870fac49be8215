// Requests whose work ended without the responder's answer: their bytes
// may still land, so no drain of them is promised, until the owner has cut
// the responder QP the work was posted to.

package rdma

import (
	"time"

	"github.com/kvferry/kvferry/engine/internal/bounded"
	"github.com/kvferry/kvferry/verbs"
)

type uncertainKey struct {
	peer string
	rid  uint64
}

// Bounds of the uncertain set: far longer than any packet can stay in a
// network, and as many as the tombstones an engine keeps.
const (
	uncertainTTL = 10 * time.Minute
	maxUncertain = 1 << 16
)

// newUncertainSet returns an empty uncertain set on clock now (nil: the
// wall clock). A mark is protected for as long as it is within its window
// (KeepFresh): the set never forgets a fresh one to make room. The window
// includes its last instant (a mark exactly uncertainTTL old counts), while
// the set ages an entry once it is TTL old: hence one tick more.
func newUncertainSet(now func() time.Time) *bounded.Set[uncertainKey, struct{}] {
	return bounded.New(bounded.Options[uncertainKey, struct{}]{Cap: maxUncertain, TTL: uncertainTTL + time.Nanosecond, KeepFresh: true, Now: now})
}

// markUncertain records that a work request of (peer, rid) ended without
// the responder's answer; a mark again moves its expiry. A fresh mark is
// never forgotten: past the cap, expired marks go first, and when none has
// expired every request of every peer counts as uncertain until the newest
// mark would have expired (a drain then says "cut", never "drained" for a
// request it forgot).
func (t *Transport) markUncertain(peer string, rid uint64) {
	now := t.uncertain.Now()
	t.uncMu.Lock()
	defer t.uncMu.Unlock()
	t.markUncertainLocked(uncertainKey{peer, rid}, now)
}

// markUncertainLocked is markUncertain with uncMu held.
func (t *Transport) markUncertainLocked(k uncertainKey, now time.Time) {
	t.uncertain.Expire(now)
	if !t.uncertain.Put(k, struct{}{}) {
		t.uncAll = now.Add(uncertainTTL)
	}
}

// markUnsettled records that a work request of (peer, rid) posted on qp,
// a QP of a live path now broken, ended without the responder's answer.
// The request is uncertain until settle: the path's reset connects a new
// QP in the broken one's slot, and the owner moves the responder QP of
// that slot to the error state before it answers (serveConnect), so no
// packet of qp is executed after the answer. Whatever landed before it
// landed; nothing more can.
func (t *Transport) markUnsettled(peer string, rid uint64, qp *verbs.QP) {
	t.uncMu.Lock()
	defer t.uncMu.Unlock()
	k := uncertainKey{peer, rid}
	qs := t.unsettled[k]
	if qs == nil {
		qs = map[*verbs.QP]struct{}{}
		t.unsettled[k] = qs
	}
	qs[qp] = struct{}{}
}

// settle ends the waits of marks made on broken QPs of one path: replaced
// says the owner answered a connect in their slot, which cut the
// responder QPs they were connected to. Otherwise (the path died before
// that answer) the marks become uncertain for uncertainTTL, as any other.
func (t *Transport) settle(qps []*verbs.QP, replaced bool) {
	if len(qps) == 0 {
		return
	}
	now := t.uncertain.Now()
	t.uncMu.Lock()
	defer t.uncMu.Unlock()
	for k, qs := range t.unsettled {
		hit := false
		for _, q := range qps {
			if _, ok := qs[q]; ok {
				delete(qs, q)
				hit = true
			}
		}
		if hit && !replaced {
			t.markUncertainLocked(k, now)
		}
		if len(qs) == 0 {
			delete(t.unsettled, k)
		}
	}
}

// Uncertain reports whether a work request of (peer, rid) ended without
// the responder's answer in the last uncertainTTL, or on a broken QP the
// owner has not yet replaced: the initiator can then not promise that the
// request is drained.
func (t *Transport) Uncertain(peer string, rid uint64) bool {
	now := t.uncertain.Now()
	t.uncMu.Lock()
	defer t.uncMu.Unlock()
	if now.Before(t.uncAll) || len(t.unsettled[uncertainKey{peer, rid}]) > 0 {
		return true
	}
	return t.uncertain.Fresh(uncertainKey{peer, rid}, now)
}
