// Requests whose work ended without the responder's answer: their bytes
// may still land, so no drain of them is promised.

package rdma

import (
	"time"

	"github.com/kvferry/kvferry/engine/internal/bounded"
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
	t.uncertain.Expire(now)
	if !t.uncertain.Put(uncertainKey{peer, rid}, struct{}{}) {
		t.uncAll = now.Add(uncertainTTL)
	}
}

// Uncertain reports whether a work request of (peer, rid) ended without
// the responder's answer in the last uncertainTTL: the initiator can then
// not promise that the request is drained.
func (t *Transport) Uncertain(peer string, rid uint64) bool {
	now := t.uncertain.Now()
	t.uncMu.Lock()
	defer t.uncMu.Unlock()
	if now.Before(t.uncAll) {
		return true
	}
	return t.uncertain.Fresh(uncertainKey{peer, rid}, now)
}
