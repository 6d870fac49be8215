// The sender: slices planned into work requests (pieces, rkeys, the NIC
// pair preferred for both ends' memory) and posted within each pair's room.

package rdma

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/verbs"
	"github.com/kvferry/kvferry/verbs/topo"
)

// sender turns queued slices into work requests and posts them, a batch
// per pair with one cgo call.
func (e *Endpoint) sender() {
	defer close(e.done)
	for {
		e.mu.Lock()
		for {
			if now := time.Now(); now.Sub(e.swept) >= keyIdle && !e.dead {
				e.sweepKeysLocked(now)
			}
			if len(e.queue) > 0 || e.dead {
				break
			}
			if len(e.keys) > 0 || len(e.dropped) > 0 {
				e.waitCond(keyIdle) // a sweep is due
			} else {
				e.cond.Wait() // idle: no CPU
			}
		}
		if e.dead {
			e.mu.Unlock()
			return
		}
		if !e.awaitPathLocked() {
			e.mu.Unlock()
			continue
		}
		batch := e.queue
		if len(batch) > 256 {
			batch = batch[:256]
		}
		e.queue = e.queue[len(batch):]
		e.mu.Unlock()
		e.postBatch(batch)
	}
}

// awaitPathLocked waits, with no slice taken from the queue, until a pair
// is healthy; it reports false when the endpoint died meanwhile. With none
// reconnected within noPathTimeout the endpoint is aborted: its slices
// fail with a retryable error and the engine dials a fresh path. Called
// and returns with mu held.
func (e *Endpoint) awaitPathLocked() bool {
	var since time.Time
	for !e.dead {
		for _, p := range e.pairs {
			if p.healthy {
				return true
			}
		}
		if since.IsZero() {
			since = time.Now()
		}
		if time.Since(since) > noPathTimeout {
			go e.Abort(errors.New("no NIC path reconnected in time"))
			e.waitCond(10 * time.Millisecond)
			continue
		}
		e.waitCond(50 * time.Millisecond)
	}
	return false
}

// plan is one work request to post.
type plan struct {
	ws    *wslice
	wr    verbs.WR
	bytes uint64
}

func (e *Endpoint) postBatch(batch []*wslice) {
	byPair := map[*pair][]plan{}
	var order []*pair
	for _, w := range batch {
		if w.s.State() != transport.StateQueued && w.s.State() != transport.StateActive {
			continue // canceled meanwhile
		}
		// Queued slices (new or waiting to be posted again) only: the
		// engine may cancel a queued one (its task aborted), and then
		// it is not ours to touch.
		if !w.s.Advance(transport.StateQueued, transport.StateActive) {
			continue
		}
		p, plans, err := e.planSlice(w)
		if err == nil && p == nil {
			if e.Dead() {
				err = e.deathErr()
			} else {
				// Every pair broke meanwhile: wait in the queue, where
				// an abort of its task can still cancel it.
				e.requeueOne(w)
				continue
			}
		}
		if err != nil {
			e.finish(w, err)
			continue
		}
		if _, ok := byPair[p]; !ok {
			order = append(order, p)
		}
		byPair[p] = append(byPair[p], plans...)
	}
	for _, p := range order {
		e.postOn(p, byPair[p])
	}
}

// planSlice resolves the owner's key, picks a pair and builds the work
// requests of one slice. A nil pair with a nil error means the slice was
// queued again or ended.
func (e *Endpoint) planSlice(w *wslice) (*pair, []plan, error) {
	s := w.s
	kr, epoch, err := e.resolve(s)
	if errors.Is(err, errNewEpoch) {
		return nil, nil, nil // queued again, to ask under the new epoch
	}
	if err != nil {
		return nil, nil, err
	}
	w.epoch = epoch
	n := uint64(len(s.Local))
	if n == 0 || s.Remote < kr.Addr || s.Remote-kr.Addr > kr.Len || n > kr.Len-(s.Remote-kr.Addr) {
		return nil, nil, fmt.Errorf("%w: [%#x, +%d) is outside the owner's registration [%#x, +%d)", transport.ErrRefused, s.Remote, n, kr.Addr, kr.Len)
	}
	if s.LocalReg == nil {
		return nil, nil, fmt.Errorf("%w: slice without local registration", transport.ErrRefused)
	}
	p := e.pick(s, kr)
	if p == nil {
		return nil, nil, nil
	}
	local, err := e.t.localSpans(s.LocalReg.Key, memory.AddrOf(s.Local), n, p.nic.Index)
	if err != nil {
		return nil, nil, err
	}
	op := uint8(verbs.OpWrite)
	if s.Op == transport.Read {
		op = verbs.OpRead
	}
	// Cut at local pieces, remote pieces and the message limit.
	var plans []plan
	roff := s.Remote - kr.Addr
	for _, l := range local {
		laddr, left := l.addr, l.len
		for left > 0 {
			pi := findPiece(kr.Pieces, roff)
			pc := kr.Pieces[pi]
			k := min(left, pc.Off+pc.Len-roff, maxMessage)
			plans = append(plans, plan{ws: w, bytes: k, wr: verbs.WR{
				LocalAddr: laddr, Length: uint32(k), LKey: l.key,
				RemoteAddr: kr.Addr + roff, RKey: pc.RKeys[p.remote], Opcode: op, Flags: verbs.FlagSignaled,
			}})
			laddr += k
			roff += k
			left -= k
		}
	}
	return p, plans, nil
}

func findPiece(ps []piece, off uint64) int {
	lo, hi := 0, len(ps)-1
	for lo < hi {
		mid := (lo + hi + 1) / 2
		if ps[mid].Off <= off {
			lo = mid
		} else {
			hi = mid - 1
		}
	}
	return lo
}

// ranks returns, per local NIC and per owner NIC, its tier for memory at
// localLoc and at remoteLoc (equally good NICs share a tier); computed
// once per pair of locations, not per slice.
func (e *Endpoint) ranks(localLoc, remoteLoc string) (local, remote []int) {
	k := [2]string{localLoc, remoteLoc}
	e.rankMu.Lock()
	defer e.rankMu.Unlock()
	if r, ok := e.rankCache.Get(k); ok {
		return r[0], r[1]
	}
	local = topo.Tiers(localLoc, -1, e.t.topoNICs())
	remote = make([]int, len(e.info.NICs))
	m, ok := e.info.Matrix[remoteLoc]
	if !ok {
		remoteLoc = "cpu"
		m = e.info.Matrix[remoteLoc]
	}
	tiers := e.info.Tiers[remoteLoc]
	for r, i := range m {
		remote[i] = r
		if r < len(tiers) {
			remote[i] = int(tiers[r])
		}
	}
	e.rankCache.Put(k, [2][]int{local, remote})
	return local, remote
}

// pick chooses a healthy pair by the NIC preference of both ends' memory,
// rotating among the equally good ones so that work stripes across every
// NIC pair of the best tier; nil when none is healthy.
func (e *Endpoint) pick(s *transport.Slice, kr *keysReply) *pair {
	localLoc := "cpu"
	if s.LocalReg != nil && s.LocalReg.Location != "" {
		localLoc = s.LocalReg.Location
	}
	lrank, rrank := e.ranks(localLoc, kr.Location)
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.dead {
		return nil
	}
	var best [maxPairsPerEndpoint]int
	n, bestScore := 0, 1<<30
	for i, p := range e.pairs {
		if !p.healthy {
			continue
		}
		sc := lrank[p.nic.Index] + rrank[p.remote]
		if sc < bestScore {
			n, bestScore = 0, sc
		}
		if sc == bestScore {
			best[n] = i
			n++
		}
	}
	if n == 0 {
		return nil
	}
	e.rr++
	return e.pairs[best[e.rr%n]]
}

// postOn posts plans on p, waiting for room in its send queue and its
// NIC's completion queue. Every plan is counted in its slice (and request)
// before the first is posted, so a slice cut into several work requests
// cannot end while some are still unposted.
func (e *Endpoint) postOn(p *pair, plans []plan) {
	e.mu.Lock()
	for _, pl := range plans {
		pl.ws.remaining++
		e.req(pl.ws.s.RequestID).inflight++
	}
	e.mu.Unlock()
	for len(plans) > 0 {
		e.mu.Lock()
		for !e.dead && p.healthy && e.room(p) <= 0 {
			e.waitCond(10 * time.Millisecond)
		}
		if len(e.canceled) > 0 {
			plans = e.dropCanceledLocked(plans)
			if len(plans) == 0 {
				e.mu.Unlock()
				return
			}
		}
		if e.dead || !p.healthy || stalePlans(plans, e.keyEpoch) {
			e.unpostLocked(plans)
			e.mu.Unlock()
			e.requeue(plans)
			return
		}
		room := min(e.room(p), len(plans))
		chunk := plans[:room]
		wrs := make([]verbs.WR, room)
		ids := make([]uint64, room)
		if p.inflight == 0 {
			p.progress = time.Now()
		}
		for i := range chunk {
			c := &wrCtx{ep: e, pair: p, ws: chunk[i].ws, bytes: chunk[i].bytes}
			ids[i] = e.t.track(c)
			wrs[i] = chunk[i].wr
			wrs[i].ID = ids[i]
			p.inflight++
		}
		p.nic.inflight.Add(int64(room))
		// The lock is held across the post so Abort cannot destroy the
		// QP under it; a post is a few hundred nanoseconds per request.
		posted, err := p.qp.PostSend(wrs)
		e.t.stats.Posted.Add(uint64(posted))
		p.nic.posted.Add(uint64(posted))
		var unposted []plan
		if err != nil {
			for i := posted; i < room; i++ {
				e.t.untrack(ids[i])
				p.inflight--
				p.nic.inflight.Add(-1)
			}
			unposted = append(append(unposted, chunk[posted:]...), plans[room:]...)
			e.unpostLocked(unposted)
			e.breakPair(p, err)
		}
		e.mu.Unlock()
		p.nic.kick()
		plans = plans[room:]
		if len(unposted) > 0 {
			e.requeue(unposted)
			return
		}
	}
}

// dropCanceledLocked ends the slices of plans that a Cancel is stopping
// and returns the other plans; none of the dropped ones was posted. Called
// with mu held; it lets go of mu while ending them.
func (e *Endpoint) dropCanceledLocked(plans []plan) []plan {
	keep := plans[:0:0]
	var drop []plan
	for _, pl := range plans {
		if e.canceled[pl.ws.s] > 0 {
			drop = append(drop, pl)
		} else {
			keep = append(keep, pl)
		}
	}
	if len(drop) == 0 {
		return plans
	}
	e.unpostLocked(drop)
	var ended []*wslice
	for _, pl := range drop {
		if w := pl.ws; w.remaining == 0 && !slices.Contains(ended, w) {
			ended = append(ended, w)
		}
	}
	e.mu.Unlock()
	for _, w := range ended {
		e.finish(w, fmt.Errorf("rdma: %w", transport.ErrCanceled))
	}
	e.mu.Lock()
	return keep
}

// stalePlans reports whether any plan was made under another key epoch:
// its rkeys may predate an owner's cut of our QPs.
func stalePlans(plans []plan, epoch uint64) bool {
	for _, pl := range plans {
		if pl.ws.epoch != epoch {
			return true
		}
	}
	return false
}

// room is how many more work requests p may post: its send queue's room,
// bounded by its NIC's completion queue, which every QP on the NIC shares
// (an overflowing CQ loses completions).
func (e *Endpoint) room(p *pair) int {
	nicRoom := int64(p.nic.cq.Size) - p.nic.inflight.Load() - p.nic.recvs.Load() - 64
	return min(p.nic.maxWR-p.inflight, int(max(nicRoom, 0)))
}

// unpostLocked uncounts plans that were never posted; their slices are
// posted again whole (a WRITE or READ may run twice, never partly).
func (e *Endpoint) unpostLocked(plans []plan) {
	for _, pl := range plans {
		pl.ws.remaining--
		pl.ws.repost = true
		if pl.ws.firstFail.IsZero() {
			pl.ws.firstFail = time.Now()
		}
		if r := e.reqs[pl.ws.s.RequestID]; r != nil {
			r.inflight--
		}
		e.doneReq(pl.ws.s.RequestID)
	}
	e.cond.Broadcast()
}

// requeue puts the slices of unposted plans back in the queue (once each),
// after rechecking their requests. Those with work requests still out are
// posted again when the last completes.
func (e *Endpoint) requeue(plans []plan) {
	seen := map[*wslice]bool{}
	var again []*wslice
	e.mu.Lock()
	for _, pl := range plans {
		w := pl.ws
		if seen[w] || w.remaining > 0 {
			continue
		}
		seen[w] = true
		w.repost = false
		again = append(again, w)
	}
	e.mu.Unlock()
	for _, w := range again {
		if w.s.Recheck != nil {
			if err := w.s.Recheck(w.s); err != nil {
				w.s.Finish(err)
				continue
			}
		}
		e.requeueOne(w)
	}
}
