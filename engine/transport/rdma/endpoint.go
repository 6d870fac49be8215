package rdma

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/kvferry/kvferry/engine/internal/bounded"
	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/verbs"
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

// newRankCache returns an empty cache of NIC ranks. Its entries are cheap
// to compute again and nothing rests on them, so past its cap it starts
// afresh (keeping only the entry just put) rather than pay a walk per
// location pair: locations are few (cpu and the GPUs), so it fills only
// when an owner names many.
func newRankCache() *bounded.Set[[2]string, [2][]int] {
	return bounded.New(bounded.Options[[2]string, [2][]int]{Cap: 257, Trim: 1})
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
