// The initiator's rkeys: asked of the owner per request id, generation,
// grant, key and fence stamp, cached for one key epoch, and released to
// the owner once unused.

package rdma

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
)

// keyUse is what the owner admits an rkey request for: one request's
// access (id, generation, grant) to one registration.
type keyUse struct {
	key   memory.Key
	rid   uint64
	gen   uint32
	grant uint64
	fence uint64 // the owner's fence epoch the access was planned under
}

// maxKeyUses bounds the rkeys cached per endpoint.
const maxKeyUses = 1 << 14

// newKeyEpochLocked forgets every rkey: a pair broke or connected, and
// rkeys the owner admitted before it cut our QPs (an abort, a fence) must
// never reach a QP connected after the cut. Work planned under the old
// epoch is planned again (see postOn). Called with mu held.
func (e *Endpoint) newKeyEpochLocked() {
	e.keyEpoch++
	for u := range e.keys {
		e.dropKeysLocked(u)
	}
}

// heldKeys is a cached answer to a keys request, and the sweep it was last
// used in.
type heldKeys struct {
	*keysReply
	used uint64
}

// Bounds of rkey release: a request id's rkeys unused for between keyIdle
// and twice that (and with no work out) are dropped, and the owner told,
// in messages of up to maxRelease request ids; at most maxDropped wait to
// be told (past it the owner keeps holding them until it cuts us).
const (
	keyIdle    = time.Second
	maxDropped = 1 << 16
)

// dropKeysLocked forgets one cached answer and notes its request id for
// release. Called with mu held.
func (e *Endpoint) dropKeysLocked(u keyUse) {
	delete(e.keys, u)
	e.noteDroppedLocked(u.rid)
}

// noteDroppedLocked notes a request id whose rkeys this path no longer
// holds, for release. Called with mu held.
func (e *Endpoint) noteDroppedLocked(rid uint64) {
	if rid != 0 && len(e.dropped) < maxDropped {
		e.dropped[rid] = struct{}{}
	}
}

// sweepKeysLocked drops the rkeys of request ids unused since the last
// sweep and with no work out, and tells the owner of every request id
// whose rkeys this path no longer holds, so that it need not cut us when
// one of them is aborted. It runs on the sender between batches: no slice
// is being planned or posted with those rkeys then, and a later slice of
// such a request id asks the owner again (with a higher sequence number,
// which a late release does not undo). Called with mu held.
func (e *Endpoint) sweepKeysLocked(now time.Time) {
	e.swept = now
	e.keyTick++
	busy := func(rid uint64) bool { r := e.reqs[rid]; return r != nil && r.inflight > 0 }
	for u, h := range e.keys {
		if u.rid != 0 && h.used+1 < e.keyTick && !busy(u.rid) {
			e.dropKeysLocked(u)
		}
	}
	if len(e.dropped) == 0 {
		return
	}
	held := make(map[uint64]bool, len(e.keys))
	for u := range e.keys {
		held[u.rid] = true
	}
	var rids []uint64
	for rid := range e.dropped {
		if held[rid] || busy(rid) || e.t.Uncertain(e.peer, rid) {
			// Asked again since, work of it out, or work of it that
			// may still land: a later sweep (uncertain ones stay held
			// for as long as they are uncertain).
			continue
		}
		delete(e.dropped, rid)
		rids = append(rids, rid)
	}
	if len(rids) == 0 || !e.t.enter() {
		return
	}
	seq := e.keySeq
	go func() {
		defer e.t.leave()
		// Best effort: a release lost leaves the owner holding us, which
		// costs a fence on an abort, never safety.
		for len(rids) > 0 {
			k := min(len(rids), maxRelease)
			m := &releaseReq{Conn: e.conn, Seq: seq, RequestIDs: rids[:k]}
			if _, err := e.t.exchange(e.ctx, e.peer, m.encode()); err != nil {
				return
			}
			rids = rids[k:]
		}
	}()
}

// errNewEpoch: a pair broke or connected while the owner was asked.
var errNewEpoch = errors.New("rdma: key epoch changed while asking the owner")

// resolve returns the owner's registration for the slice's access, asking
// the owner once per request id, generation, grant and key in each key
// epoch (it admits the access as it would on tcp, for the whole transfer's
// range), and the epoch the answer holds for.
func (e *Endpoint) resolve(s *transport.Slice) (*keysReply, uint64, error) {
	u := keyUse{key: s.Key, rid: s.RequestID, gen: s.Generation, grant: s.GrantID, fence: s.Epoch}
	n := uint64(len(s.Local))
	e.mu.Lock()
	h, epoch := e.keys[u], e.keyEpoch
	if h != nil && h.admits(s.Remote, n) {
		h.used = e.keyTick
		e.mu.Unlock()
		return h.keysReply, epoch, nil
	}
	e.mu.Unlock()
	ext := s.Extent
	if !ext.Contains(s.Remote, n) {
		ext = transport.Span{Addr: s.Remote, Len: n}
	}
	req := &keysReq{Conn: e.conn, Key: uint64(s.Key), Op: uint8(s.Op), RequestID: s.RequestID, Generation: s.Generation, GrantID: s.GrantID, Addr: ext.Addr, Len: ext.Len, FenceEpoch: s.Epoch}
	// A Cancel of the slice ends the request (the owner may not answer).
	ctx, stop := context.WithCancel(e.ctx)
	defer stop()
	e.mu.Lock()
	if e.canceled[s] > 0 {
		e.mu.Unlock()
		return nil, 0, fmt.Errorf("rdma: %w", transport.ErrCanceled)
	}
	e.asking, e.stopAsk = s, stop
	e.keySeq++
	req.Seq = e.keySeq
	e.mu.Unlock()
	// The owner may have recorded us as a holder whatever becomes of the
	// answer: one not cached is released like a dropped one (we never
	// used its rkeys).
	cached := false
	defer func() {
		if !cached && u.rid != 0 {
			e.mu.Lock()
			e.noteDroppedLocked(u.rid)
			e.mu.Unlock()
		}
	}()
	rep, err := e.t.exchange(ctx, e.peer, req.encode())
	e.mu.Lock()
	e.asking, e.stopAsk = nil, nil
	canceled := e.canceled[s] > 0
	e.mu.Unlock()
	if e.ctx.Err() != nil {
		// Aborted while asking: the slice ends with the abort's error.
		return nil, 0, e.deathErr()
	}
	if canceled {
		return nil, 0, fmt.Errorf("rdma: %w while asking for its rkeys", transport.ErrCanceled)
	}
	if err != nil {
		return nil, 0, fmt.Errorf("rdma: keys of %#x at %s: %w", s.Key, e.peer, err)
	}
	kr, err := decodeKeysReply(rep, len(e.info.NICs))
	if err != nil {
		if errors.Is(err, transport.ErrRefused) {
			return nil, 0, fmt.Errorf("rdma: key %#x at %s: %w", s.Key, e.peer, err)
		}
		return nil, 0, fmt.Errorf("rdma: keys of %#x at %s: %w: %w", s.Key, e.peer, transport.ErrProtocol, err)
	}
	if !kr.admits(s.Remote, n) {
		return nil, 0, fmt.Errorf("rdma: keys of %#x at %s: %w: admitted [%#x, +%d), not the slice's [%#x, +%d)", s.Key, e.peer, transport.ErrProtocol, kr.Admitted.Addr, kr.Admitted.Len, s.Remote, n)
	}
	e.mu.Lock()
	defer e.mu.Unlock() // runs before the deferred note above, which locks mu
	if e.keyEpoch != epoch {
		return nil, 0, errNewEpoch
	}
	if len(e.keys) >= maxKeyUses {
		for v := range e.keys { // keys are cheap to ask again; memory is not
			e.dropKeysLocked(v)
		}
	}
	e.keys[u] = &heldKeys{keysReply: kr, used: e.keyTick}
	cached = true
	return kr, epoch, nil
}

// admits reports whether the owner admitted [addr, addr+n).
func (kr *keysReply) admits(addr, n uint64) bool { return kr.Admitted.Contains(addr, n) }
