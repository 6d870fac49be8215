package rdma

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/kvferry/kvferry/engine/internal/bounded"
	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/verbs"
	"github.com/kvferry/kvferry/verbs/topo"
)

// Limits of an endpoint.
const (
	maxPairsPerEndpoint = 16
	maxMessage          = 1 << 30 // bytes per work request
	// A slice is posted again on another pair for as long as repostWindow
	// after its first failure: every owner fence fails the initiator's
	// work on the fenced QPs, so under frequent aborts a healthy slice may
	// need many tries; a dead peer ends it by noPathTimeout anyway.
	repostWindow      = 30 * time.Second
	maxReposts        = 10000
	noPathTimeout     = 5 * time.Second
	abortFlushTimeout = 5 * time.Second
)

// pair is one RC connection from a local NIC to an owner NIC.
type pair struct {
	slot      uint8
	nic       *NIC
	remote    int
	qp        *verbs.QP
	psn       uint32
	healthy   bool
	resetting bool
	inflight  int       // work requests posted and not yet completed
	progress  time.Time // the last completion, or the post that found none in flight
}

// wslice is a slice as the endpoint moves it: the work requests it became
// and what they ended with.
type wslice struct {
	s         *transport.Slice
	remaining int
	final     error  // a final error: refusal or local failure
	repost    bool   // a path failed under it: post it again elsewhere
	epoch     uint64 // the key epoch its work requests were planned under
	reposts   int
	firstFail time.Time // when a path first failed under it
}

// reqTrack counts, per request id, the work requests on the wire, for
// Drain and Notify. An entry lives while any is.
type reqTrack struct {
	inflight int
}

// Endpoint is one RDMA path to an owner: a QP per NIC pair, a sender that
// turns slices into work requests, and failover between the pairs.
type Endpoint struct {
	t    *Transport
	peer string
	conn uint64
	info *infoReply

	mu       sync.Mutex
	cond     *sync.Cond
	pairs    []*pair
	queue    []*wslice
	keys     map[keyUse]*heldKeys // rkeys the owner admitted, per access; valid for keyEpoch only
	keyEpoch uint64               // bumped, and keys cleared, whenever a pair breaks or connects
	keySeq   uint64               // keys requests sent
	keyTick  uint64               // sweeps of keys done (see sweepKeysLocked)
	swept    time.Time            // the last sweep
	dropped  map[uint64]struct{}  // request ids whose rkeys were dropped, to release
	reqs     map[uint64]*reqTrack
	canceled map[*transport.Slice]int // slices a Cancel is stopping (count of Cancels)
	asking   *transport.Slice         // the slice whose rkeys the sender is asking for
	stopAsk  context.CancelFunc       // ends that request
	dead     bool
	deadErr  error
	finished chan struct{} // closed when the first Abort returns

	rankMu    sync.Mutex
	rankCache *bounded.Set[[2]string, [2][]int] // NIC ranks per (local, remote) location
	rr        int
	noPath    time.Time // since when no pair was healthy
	done      chan struct{}
	resets    sync.WaitGroup
	ctx       context.Context
	cancel    context.CancelFunc
}

// Dial connects to the owner whose segment name is addr's peer: it asks
// for its NICs, creates one QP per NIC pair and connects them.
func (t *Transport) Dial(ctx context.Context, peer, self string) (transport.Endpoint, error) {
	if !t.enter() {
		return nil, transport.ErrClosed
	}
	defer t.leave()
	rep, err := t.exchange(ctx, peer, []byte{kindInfo, wireVersion})
	if err != nil {
		return nil, fmt.Errorf("rdma: info from %s: %w", peer, err)
	}
	info, err := decodeInfo(rep)
	if err != nil {
		return nil, fmt.Errorf("rdma: info from %s: %w: %w", peer, transport.ErrProtocol, err)
	}
	e := &Endpoint{
		t: t, peer: peer, conn: rand.Uint64(), info: info, keys: map[keyUse]*heldKeys{}, dropped: map[uint64]struct{}{},
		reqs: map[uint64]*reqTrack{}, done: make(chan struct{}), finished: make(chan struct{}),
		canceled: map[*transport.Slice]int{}, rankCache: newRankCache(),
	}
	e.cond = sync.NewCond(&e.mu)
	e.ctx, e.cancel = context.WithCancel(context.Background())
	for li, n := range t.nics {
		for ri := range info.NICs {
			if len(e.pairs) == maxPairsPerEndpoint {
				break
			}
			if len(t.nics)*len(info.NICs) > maxPairsPerEndpoint && ri != li%len(info.NICs) && ri != (li+1)%len(info.NICs) {
				// Many NICs: each local NIC gets its rail and the next.
				continue
			}
			e.pairs = append(e.pairs, &pair{slot: uint8(len(e.pairs)), nic: n, remote: ri})
		}
	}
	if err := e.connect(ctx, e.pairs); err != nil {
		e.destroyQPs()
		return nil, err
	}
	t.opMu.Lock()
	if t.closing.Load() {
		t.opMu.Unlock()
		e.destroyQPs()
		return nil, transport.ErrClosed
	}
	t.eps[e] = struct{}{}
	t.opMu.Unlock()
	go e.sender()
	return e, nil
}

func (t *Transport) exchange(ctx context.Context, peer string, body []byte) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, t.opts.RequestTimeout)
	defer cancel()
	rep, err := t.opts.Exchange(ctx, peer, body)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", transport.ErrConnection, err)
	}
	return rep, nil
}

// connect creates fresh QPs for ps and connects them through one CONNECT
// exchange.
func (e *Endpoint) connect(ctx context.Context, ps []*pair) error {
	req := &connectReq{Conn: e.conn}
	for _, p := range ps {
		qp, err := p.nic.pd.CreateQP(p.nic.cq, p.nic.cq, p.nic.maxWR, 16, verbs.MaxInline)
		if err != nil {
			return fmt.Errorf("rdma: %w: %w", transport.ErrConnection, err)
		}
		e.mu.Lock()
		if e.dead {
			e.mu.Unlock()
			_ = qp.Destroy()
			return fmt.Errorf("rdma: %w: path aborted", transport.ErrConnection)
		}
		p.qp, p.psn = qp, rand.Uint32()&0xffffff
		e.mu.Unlock()
		if err := qp.ToInit(p.nic.Port.Num, verbs.AccessLocalWrite|verbs.AccessRemoteWrite|verbs.AccessRemoteRead); err != nil {
			return fmt.Errorf("rdma: %w: %w", transport.ErrConnection, err)
		}
		req.Pairs = append(req.Pairs, pairReq{
			Slot: p.slot, Local: uint8(p.nic.Index), Remote: uint8(p.remote), QP: qpInfo{QPN: qp.Num, PSN: p.psn},
			LID: p.nic.Port.LID, GID: p.nic.Port.GID, Ethernet: p.nic.Port.Ethernet(), MTU: uint8(p.nic.Port.ActiveMTU),
		})
	}
	rep, err := e.t.exchange(ctx, e.peer, req.encode())
	if err != nil {
		return fmt.Errorf("rdma: connect to %s: %w", e.peer, err)
	}
	cr, err := decodeConnectReply(rep, len(ps))
	if err != nil {
		return fmt.Errorf("rdma: connect to %s: %w: %w", e.peer, transport.ErrProtocol, err)
	}
	for i, p := range ps {
		ri := e.info.NICs[p.remote]
		r := verbs.Remote{QPN: cr.QPs[i].QPN, PSN: cr.QPs[i].PSN, LID: ri.LID, GID: ri.GID, Global: ri.Ethernet || p.nic.Port.Ethernet(), MTU: verbs.MTU(ri.MTU)}
		if err := e.t.toRTR(p.qp, p.nic, r); err != nil {
			return fmt.Errorf("rdma: %w: %w", transport.ErrConnection, err)
		}
		if err := p.qp.ToRTS(p.psn, e.t.opts.Timeout, e.t.opts.RetryCount); err != nil {
			return fmt.Errorf("rdma: %w: %w", transport.ErrConnection, err)
		}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.dead {
		return fmt.Errorf("rdma: %w: path aborted", transport.ErrConnection)
	}
	for _, p := range ps {
		p.healthy = true
	}
	e.newKeyEpochLocked()
	e.cond.Broadcast()
	return nil
}

func (e *Endpoint) destroyQPs() {
	for _, p := range e.pairs {
		if p.qp != nil {
			_ = p.qp.ToError()
			_ = p.qp.Destroy()
			p.qp = nil
		}
	}
}

// Post implements transport.Endpoint.
func (e *Endpoint) Post(slices []*transport.Slice) {
	e.mu.Lock()
	if e.dead {
		err := e.deadErr
		e.mu.Unlock()
		for _, s := range slices {
			s.Finish(err)
		}
		return
	}
	for _, s := range slices {
		e.queue = append(e.queue, &wslice{s: s})
	}
	e.cond.Broadcast()
	e.mu.Unlock()
}

// DirectGPU implements transport.DirectGPU: GPU memory is registered with
// the NICs (dma-buf or nvidia-peermem) and moved without host staging.
func (e *Endpoint) DirectGPU() bool { return true }

// Dead implements transport.Endpoint.
func (e *Endpoint) Dead() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.dead
}

// Close implements transport.Endpoint.
func (e *Endpoint) Close() error {
	e.Abort(transport.ErrClosed)
	return nil
}

// Abort implements transport.Endpoint: the QPs go to the error state, which
// flushes what was posted; Abort returns once every work request completed
// (so the NICs no longer touch the slices' memory) or the flush timed out.
func (e *Endpoint) Abort(reason error) {
	err := fmt.Errorf("rdma path to %s: %w: %w", e.peer, transport.ErrConnection, reason)
	if errors.Is(reason, transport.ErrClosed) {
		err = fmt.Errorf("rdma path to %s: %w", e.peer, reason)
	}
	e.mu.Lock()
	if e.dead {
		e.mu.Unlock()
		<-e.finished // the first Abort's whole work, flush included
		return
	}
	defer close(e.finished)
	e.dead, e.deadErr = true, err
	queue := e.queue
	e.queue = nil
	for _, p := range e.pairs {
		p.healthy = false
		if p.qp != nil {
			_ = p.qp.ToError()
		}
	}
	e.cond.Broadcast()
	e.mu.Unlock()
	e.cancel()
	for _, w := range queue {
		w.s.Finish(err)
	}
	<-e.done
	e.resets.Wait()
	// Wait for the flush: a work request still counted may still move
	// bytes of its slice.
	deadline := time.Now().Add(abortFlushTimeout)
	e.mu.Lock()
	for e.inflight() > 0 && time.Now().Before(deadline) {
		e.mu.Unlock()
		time.Sleep(100 * time.Microsecond)
		e.mu.Lock()
	}
	left := e.inflight()
	e.mu.Unlock()
	e.t.opMu.Lock()
	delete(e.t.eps, e)
	e.t.opMu.Unlock()
	if left > 0 {
		// Work requests the NIC never flushed may still move bytes: no
		// drain of their requests can be promised, on any later path.
		e.mu.Lock()
		for rid, r := range e.reqs {
			if r.inflight > 0 {
				e.t.markUncertain(e.peer, rid)
			}
		}
		e.mu.Unlock()
		e.t.log.Error("kvferry: rdma work requests not flushed after abort; their QPs are kept (never reused) so the NIC cannot touch freed state", "peer", e.peer, "left", left)
		return
	}
	e.destroyQPs()
	if e.t.enter() {
		go func() {
			defer e.t.leave()
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			defer cancel()
			b := []byte{kindDisconnect, wireVersion, 0, 0, 0, 0, 0, 0, 0, 0}
			for i := range 8 {
				b[2+i] = byte(e.conn >> (8 * i))
			}
			_, _ = e.t.opts.Exchange(ctx, e.peer, b)
		}()
	}
}

func (e *Endpoint) inflight() int {
	n := 0
	for _, p := range e.pairs {
		n += p.inflight
	}
	return n
}

// Drain implements transport.Drainer: it returns once no work request of
// requestID is on the wire, and forgets the rkeys admitted for it. It fails when one ended without the responder's
// answer (a flushed or timed-out request may still have landed, or land
// later), so the ACK then says "cut", not "drained".
func (e *Endpoint) Drain(ctx context.Context, requestID uint64) error {
	if err := e.waitIdle(ctx, requestID, false); err != nil {
		return fmt.Errorf("rdma: drain: %w", err)
	}
	// The drained ACK lets the owner skip its fence, so the rkeys it
	// admitted for the request must not outlive the drain here: a later
	// slice of the request (its tombstone forgotten) asks the owner again,
	// which refuses it.
	e.mu.Lock()
	for u := range e.keys {
		if u.rid == requestID {
			e.dropKeysLocked(u)
		}
	}
	e.mu.Unlock()
	if e.t.Uncertain(e.peer, requestID) {
		return fmt.Errorf("rdma: request %d: a work request of it ended without the responder's answer", requestID)
	}
	return nil
}

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

// newRankCache returns an empty cache of NIC ranks. Its entries are cheap
// to compute again and nothing rests on them, so past its cap it starts
// afresh (keeping only the entry just put) rather than pay a walk per
// location pair: locations are few (cpu and the GPUs), so it fills only
// when an owner names many.
func newRankCache() *bounded.Set[[2]string, [2][]int] {
	return bounded.New(bounded.Options[[2]string, [2][]int]{Cap: 257, Trim: 1})
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

// cancelGrace is how long Cancel waits for a canceled slice's work
// requests to complete before it flushes the NIC paths holding them.
const cancelGrace = 50 * time.Millisecond

// Cancel implements transport.SliceCanceler: slices not yet posted are
// dropped, posted ones are waited for, and after cancelGrace the pairs
// still holding their work requests are broken (their QPs go to the error
// state, which flushes them; the other work on those pairs moves to other
// pairs, as after any failure). It returns once every slice ended, or
// with ErrInUse at ctx's deadline.
func (e *Endpoint) Cancel(ctx context.Context, ss []*transport.Slice) error {
	e.mu.Lock()
	for _, s := range ss {
		e.canceled[s]++
		if e.asking == s {
			e.stopAsk()
		}
	}
	e.mu.Unlock()
	defer func() {
		e.mu.Lock()
		for _, s := range ss {
			if e.canceled[s]--; e.canceled[s] <= 0 {
				delete(e.canceled, s)
			}
		}
		e.mu.Unlock()
	}()
	defer e.wakeOn(ctx)()
	grace := time.Now().Add(cancelGrace)
	flushed := false
	for {
		var left []*transport.Slice
		for _, s := range ss {
			if st := s.State(); st != transport.StateDone && st != transport.StateCanceled {
				left = append(left, s)
			}
		}
		if len(left) == 0 {
			return nil
		}
		for _, s := range left {
			// Back in the queue (its pair broke, or a new key epoch):
			// no work request of it is out, so it ends here, unless the
			// sender takes it first (then postOn drops it).
			s.FinishFrom(transport.StateQueued, fmt.Errorf("rdma: %w", transport.ErrCanceled))
		}
		dead := e.Dead()
		if dead {
			// Abort returns once the flush is seen or timed out.
			select {
			case <-e.finished:
			case <-ctx.Done():
			}
		} else if !flushed && !time.Now().Before(grace) {
			e.breakPairsOf(left)
			flushed = true
		}
		if ctx.Err() != nil || dead {
			if n := countLive(left); n > 0 {
				return fmt.Errorf("rdma path to %s: %w: %d canceled slices' work requests neither completed nor flushed", e.peer, transport.ErrInUse, n)
			}
			return nil
		}
		wait := 10 * time.Millisecond // completions wake us; this bounds a missed one
		if d := time.Until(grace); d > 0 {
			wait = min(wait, d+time.Millisecond)
		}
		e.mu.Lock()
		e.waitCond(wait)
		e.mu.Unlock()
	}
}

func countLive(ss []*transport.Slice) int {
	n := 0
	for _, s := range ss {
		if st := s.State(); st != transport.StateDone && st != transport.StateCanceled {
			n++
		}
	}
	return n
}

// breakPairsOf breaks the pairs holding work requests of slices.
func (e *Endpoint) breakPairsOf(ss []*transport.Slice) {
	want := make(map[*transport.Slice]bool, len(ss))
	for _, s := range ss {
		want[s] = true
	}
	pairs := map[*pair]bool{}
	e.t.wrMu.Lock()
	for _, c := range e.t.wrs {
		if c.ep == e && c.ws != nil && want[c.ws.s] {
			pairs[c.pair] = true
		}
	}
	e.t.wrMu.Unlock()
	e.mu.Lock()
	for p := range pairs {
		e.breakPair(p, fmt.Errorf("%w: canceled work requests did not complete within %v", transport.ErrCanceled, cancelGrace))
	}
	e.mu.Unlock()
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

// wakeOn wakes the endpoint's waiters when ctx ends; call the result to
// stop watching.
func (e *Endpoint) wakeOn(ctx context.Context) (stop func() bool) {
	return context.AfterFunc(ctx, func() {
		e.mu.Lock()
		e.cond.Broadcast()
		e.mu.Unlock()
	})
}

// busyLocked reports whether work of requestID is queued or on the wire
// on this path. Called with mu held.
func (e *Endpoint) busyLocked(requestID uint64) bool {
	if r := e.reqs[requestID]; r != nil && r.inflight > 0 {
		return true
	}
	for _, w := range e.queue {
		if st := w.s.State(); w.s.RequestID == requestID && (st == transport.StateQueued || st == transport.StateActive) {
			return true
		}
	}
	return false
}

// waitCond waits on the endpoint's condition for at most d (a NIC's room
// frees on other endpoints' completions, which do not signal this one).
func (e *Endpoint) waitCond(d time.Duration) {
	t := time.AfterFunc(d, func() {
		e.mu.Lock()
		e.cond.Broadcast()
		e.mu.Unlock()
	})
	e.cond.Wait()
	t.Stop()
}

// req returns the tracking of a request id. Called with mu held.
func (e *Endpoint) req(rid uint64) *reqTrack {
	r := e.reqs[rid]
	if r == nil {
		r = &reqTrack{}
		e.reqs[rid] = r
	}
	return r
}

// doneReq drops a request's tracking once nothing of it is out. Called with
// mu held.
func (e *Endpoint) doneReq(rid uint64) {
	if r := e.reqs[rid]; r != nil && r.inflight <= 0 {
		delete(e.reqs, rid)
	}
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

// breakStalled breaks every healthy pair that has work requests out of
// which none completed for longer than limit (see Transport.watchdog).
func (e *Endpoint) breakStalled(now time.Time, limit time.Duration) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, p := range e.pairs {
		if p.healthy && p.inflight > 0 && now.Sub(p.progress) > limit {
			e.t.stats.Stalls.Add(1)
			e.breakPair(p, fmt.Errorf("%w: %d work requests out and none completed in %v", transport.ErrConnection, p.inflight, limit))
		}
	}
}

// breakPair marks p failed and starts its reconnection. Called with mu held.
func (e *Endpoint) breakPair(p *pair, cause error) {
	if !p.healthy && p.resetting {
		return
	}
	if p.healthy {
		e.newKeyEpochLocked()
	}
	p.healthy = false
	if e.dead || p.resetting {
		return
	}
	p.resetting = true
	e.t.stats.Failovers.Add(1)
	e.t.log.Warn("kvferry: rdma path failed; moving its work to other NIC paths", "peer", e.peer,
		"nic", p.nic.Name, "remote_nic", e.info.NICs[p.remote].Name, "err", cause)
	e.resets.Add(1)
	go e.reset(p)
}

// reset reconnects a failed pair: its QP goes to error, every request on it
// completes (flushed), and a new QP is connected in its slot.
func (e *Endpoint) reset(p *pair) {
	defer e.resets.Done()
	e.mu.Lock()
	qp := p.qp
	e.mu.Unlock()
	if qp != nil {
		_ = qp.ToError()
	}
	backoff := 20 * time.Millisecond
	for {
		e.mu.Lock()
		flushBy := time.Now().Add(abortFlushTimeout)
		for p.inflight > 0 && !e.dead {
			if time.Now().After(flushBy) {
				// The provider does not flush the broken QP: nothing of
				// this path can be trusted any more. Aborting it fails
				// its queued slices, lets the engine dial a fresh path
				// and marks what is still out uncertain. Slices with a
				// work request the NIC never completes stay unfinished
				// (their memory may still be touched), so a wait on
				// them outlives its deadline.
				e.mu.Unlock()
				go e.Abort(fmt.Errorf("%w: a broken NIC path's work was not flushed in %v", transport.ErrConnection, abortFlushTimeout))
				e.mu.Lock()
				break
			}
			e.mu.Unlock()
			select {
			case <-e.ctx.Done():
			case <-time.After(200 * time.Microsecond):
			}
			e.mu.Lock()
		}
		for p.inflight > 0 && !e.dead {
			e.cond.Wait() // the abort started above makes the endpoint dead
		}
		if e.dead {
			p.resetting = false
			e.mu.Unlock()
			return
		}
		old := p.qp
		p.qp = nil
		e.mu.Unlock()
		if old != nil {
			_ = old.Destroy()
		}
		ctx, cancel := context.WithTimeout(e.ctx, e.t.opts.RequestTimeout)
		err := e.connect(ctx, []*pair{p})
		cancel()
		if err == nil {
			e.t.stats.Reconnects.Add(1)
			e.mu.Lock()
			if !p.healthy && !e.dead {
				// Broken again between connect and here: breakPair saw
				// the reset still running and left the reconnect to it.
				// What was posted on the new QP meanwhile is flushed.
				qp := p.qp
				e.mu.Unlock()
				if qp != nil {
					_ = qp.ToError()
				}
				continue
			}
			p.resetting = false
			e.cond.Broadcast()
			e.mu.Unlock()
			return
		}
		e.t.log.Debug("kvferry: rdma reconnect failed; retrying", "peer", e.peer, "nic", p.nic.Name, "err", err)
		select {
		case <-e.ctx.Done():
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, time.Second)
	}
}

// completed takes one completion (on the NIC's poller).
func (e *Endpoint) completed(c *wrCtx, status uint32, text string) {
	e.mu.Lock()
	p, w := c.pair, c.ws
	p.inflight--
	p.progress = time.Now()
	r := e.reqs[w.s.RequestID]
	if r != nil {
		r.inflight--
	}
	w.remaining--
	if status != verbs.WCSuccess {
		err := fmt.Errorf("rdma %v on %s to %s: %s (status %d)", w.s.Op, p.nic.Name, e.peer, text, status)
		switch status {
		case verbs.WCRemAccessErr, verbs.WCRemInvReqErr, verbs.WCRemOpErr:
			// The owner's NIC refused: the key is gone or the range
			// wrong. Final; the cached keys are dropped (breakPair
			// below) so the next slice asks the owner again.
			if w.final == nil {
				w.final = fmt.Errorf("%w: %w", transport.ErrRefused, err)
			}
		case verbs.WCLocProtErr, verbs.WCLocLenErr:
			if w.final == nil {
				w.final = fmt.Errorf("%w: local memory: %w", transport.ErrRefused, err)
			}
		default:
			// Flushed or timed out: the path is broken, and the bytes
			// of this request may or may not have landed (or land
			// later): no drain of it can be promised from now on.
			e.t.markUncertain(e.peer, w.s.RequestID)
			if e.dead {
				if w.final == nil {
					w.final = fmt.Errorf("%w: %w", e.deadErr, err)
				}
			} else {
				w.repost = true
				if w.firstFail.IsZero() {
					w.firstFail = time.Now()
				}
			}
		}
		e.breakPair(p, err)
	}
	var end bool
	var ferr error
	if w.remaining == 0 {
		switch {
		case w.final != nil:
			end, ferr = true, w.final
		case w.repost && e.canceled[w.s] > 0:
			end, ferr = true, fmt.Errorf("rdma: %w", transport.ErrCanceled)
		case w.repost && (e.dead || w.reposts >= maxReposts || time.Since(w.firstFail) > repostWindow):
			end, ferr = true, fmt.Errorf("rdma path to %s: %w: failed on %d NIC paths", e.peer, transport.ErrConnection, w.reposts+1)
		case w.repost:
			w.repost = false
		default:
			end = true
		}
	}
	e.doneReq(w.s.RequestID)
	e.cond.Broadcast()
	e.mu.Unlock()
	if !end && w.remaining == 0 {
		// Post it again on another path, unless its request changed.
		if w.s.Recheck != nil {
			if err := w.s.Recheck(w.s); err != nil {
				e.finish(w, err)
				return
			}
		}
		e.requeueOne(w)
		return
	}
	if end {
		e.finish(w, ferr)
	}
}

func (e *Endpoint) requeueOne(w *wslice) {
	e.mu.Lock()
	if e.dead {
		err := e.deadErr
		e.mu.Unlock()
		w.s.Finish(err)
		return
	}
	w.reposts++
	if w.firstFail.IsZero() {
		w.firstFail = time.Now()
	}
	// Back to Queued: while it waits for a path, an abort of its task
	// cancels it (Slice.TryCancel) instead of waiting for it.
	w.s.Advance(transport.StateActive, transport.StateQueued)
	e.queue = append(e.queue, w)
	e.cond.Broadcast()
	e.mu.Unlock()
}

// deathErr is the error slices of a dead endpoint end with.
func (e *Endpoint) deathErr() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.deadErr != nil {
		return e.deadErr
	}
	return fmt.Errorf("rdma path to %s: %w", e.peer, transport.ErrConnection)
}

func (e *Endpoint) finish(w *wslice, err error) {
	w.s.Finish(err)
}
