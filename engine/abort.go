package engine

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"time"

	"github.com/kvferry/kvferry/engine/control"
	"github.com/kvferry/kvferry/engine/requests"
	"github.com/kvferry/kvferry/engine/transport"
)

// MaxAbortInitiators caps the initiators one Abort names.
const MaxAbortInitiators = 1024

// Resending ABORT: the first resend after abortResendFirst, then at twice the
// interval each time, up to abortResendMax. ZMQ drops messages only when a
// peer's connection breaks, so resends are rare; the backoff keeps a dead
// initiator from costing more than a message every abortResendMax.
const (
	abortResendFirst = 10 * time.Millisecond
	abortResendMax   = 200 * time.Millisecond
)

// AbortResult is the outcome of Engine.Abort.
type AbortResult struct {
	// Safe: no further byte of the request can be written into or read
	// from this engine's memory, whatever the initiators do next. The
	// memory may be reused at once.
	Safe bool
	// Reason says why the abort is not Safe; nil when it is.
	Reason error
	// Generation is the request id's generation after the abort: a later
	// grant or transfer of the same request id must carry it.
	Generation uint32
	// Acked lists the initiators whose ABORT_ACK arrived before Abort
	// returned. On tcp and local Safe does not wait for them: the ABORT is
	// resent in the background until every initiator acknowledged or the
	// deadline passed.
	Acked []string
	// BytesConfirmed is the sum of the bytes the acknowledging initiators
	// confirmed landed: a lower bound.
	BytesConfirmed uint64
}

// pendingAbort is an owner's abort waiting for ABORT_ACKs.
type pendingAbort struct {
	rid  uint64
	gen  uint32
	mu   sync.Mutex
	wait map[string]bool // initiators yet to acknowledge
	// drainedOnly: count only ACKs that promise a drain (the fence rests
	// on them); otherwise any ACK ends the wait.
	drainedOnly bool
	acked       []string
	landed      uint64
	done        chan struct{}   // closed when wait is empty
	drained     map[string]bool // initiators whose ACK promised a drain
	kick        chan struct{}   // signaled on each drained ACK
}

type abortKey struct {
	rid uint64
	gen uint32
}

// Abort aborts requestID, as the owner of the memory its transfers touch:
// from now on every access of it (at its current generation or below) is
// refused, chunk by chunk, and Abort returns once no copy of it is in
// progress. It tells each initiator named (segment names) with ABORT,
// resent until acknowledged or ctx's deadline (DefaultTimeout when ctx has
// none); they stop the request's transfers, which end ABORTED, and get an
// EventAborted. With no initiator named, refusal alone stops them.
//
// The result is Safe only when no further byte of the request can touch
// this engine's memory; otherwise it says why not, by the deadline. The
// error is non-nil only for invalid arguments or a closed engine.
func (e *Engine) Abort(ctx context.Context, requestID uint64, initiators []string) (AbortResult, error) {
	if err := e.checkOpen(); err != nil {
		return AbortResult{}, err
	}
	if requestID == 0 {
		return AbortResult{}, fmt.Errorf("abort: %w: request id 0 names no request", ErrInvalidArg)
	}
	if len(initiators) > MaxAbortInitiators {
		return AbortResult{}, fmt.Errorf("abort: %w: %d initiators (at most %d)", ErrInvalidArg, len(initiators), MaxAbortInitiators)
	}
	wait := make(map[string]bool, len(initiators))
	names := make([]string, 0, len(initiators)) // wait, deduplicated; wait itself is the ACK handler's once published
	for _, name := range initiators {
		if _, _, err := net.SplitHostPort(name); err != nil || len(name) > maxSegmentName {
			return AbortResult{}, fmt.Errorf("abort: %w: initiator %q is not a segment name (host:port)", ErrInvalidArg, name)
		}
		if !wait[name] {
			wait[name] = true
			names = append(names, name)
		}
	}
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(e.opts.DefaultTimeout)
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, deadline)
		defer cancel()
	}
	for _, name := range names {
		if e.admitted.seen(name, 0) && e.firstNoRIDWarning(name) {
			// An abort stops only what carries its request id: this
			// initiator's transfers without one go on landing.
			e.log.Warn("kvferry: abort names an initiator that writes into this engine's memory without request ids; "+
				"abort does not stop those transfers: fence their pages (Fence, kvf_fence_memory, fence_memory) before reusing them",
				"initiator", name, "request", requestID)
		}
	}
	unsafe := e.opts.Testing.UnsafeAbort

	var gen uint32
	var inProgress <-chan struct{}
	if unsafe {
		gen = e.reqs.Generation(requestID) + 1
	} else {
		var err error
		// An abort that names no initiator can never be acknowledged:
		// its tombstone stays until the cap forces it out.
		gen, inProgress, err = e.reqs.Abort(requestID, false)
		if err != nil {
			return AbortResult{}, fmt.Errorf("abort: %w", err)
		}
		// After the generation bump: an initiator admitted before it
		// is listed here (see rdma's holders), whether the application
		// named it or not; one asking after it is refused.
		for _, name := range e.holders(requestID) {
			if !wait[name] {
				wait[name] = true
				names = append(names, name)
			}
		}
	}
	named := len(names)
	// Every transport serving peers needs a fence: refusal where the
	// owner's code copies the bytes, else the transport's own (Fencer),
	// else the initiators' drained ACKs. The unsafe test mode trusts ACKs.
	needAcks := unsafe
	var fences []transport.Fencer
	if !unsafe {
		for _, t := range e.servers() {
			if c, ok := t.(transport.OwnerCopier); ok && c.OwnerCopies() {
				continue
			}
			if _, ok := t.(transport.AccessTracker); ok && named == 0 {
				continue // no initiator holds access to the request through it
			}
			if fe, ok := t.(interface{ FenceEnabled() bool }); ok && !fe.FenceEnabled() {
				needAcks = true
				continue
			}
			if f, ok := t.(transport.Fencer); ok && named > 0 {
				fences = append(fences, f)
				continue
			}
			needAcks = true
		}
	}
	pa := &pendingAbort{rid: requestID, gen: gen, wait: wait, drainedOnly: !unsafe, done: make(chan struct{}),
		drained: map[string]bool{}, kick: make(chan struct{}, 1)}
	if named == 0 {
		close(pa.done)
	} else {
		k := abortKey{requestID, gen}
		e.pendMu.Lock()
		e.pending[k] = pa
		e.pendMu.Unlock()
		msg := control.AbortMsg{RequestID: requestID, Generation: gen}.Encode()
		for _, name := range names {
			_ = e.plane.Send(name, control.MsgAbort, msg)
		}
		if e.startBackground() {
			go e.resendAbort(pa, msg, deadline)
		} else {
			e.forgetPending(pa)
		}
	}

	res := AbortResult{Generation: gen}
	var reason error
	if inProgress != nil {
		select {
		case <-inProgress:
		case <-ctx.Done():
			reason = fmt.Errorf("copies of request %d still in progress at the deadline: %w", requestID, ErrTimeout)
		}
	}
	if len(fences) > 0 && reason == nil {
		// An initiator that promptly promises the drain needs no fence,
		// and its other requests go on undisturbed; the others are
		// fenced.
		cut := pa.undrained(ctx, names, e.opts.RDMAFenceGrace)
		// Before the fence: from now on those initiators may not connect
		// new QPs until they acknowledged this abort.
		for _, name := range cut {
			if err := e.noteFence(name, abortKey{requestID, gen}); err != nil && reason == nil {
				reason = err
			}
		}
		for _, f := range fences {
			for _, name := range cut {
				if reason != nil {
					break
				}
				if err := f.Fence(ctx, name); err != nil {
					reason = fmt.Errorf("fence %s: %w", name, err)
				}
			}
		}
	}
	if reason == nil && needAcks {
		if named == 0 {
			reason = fmt.Errorf("the fence rests on the initiators' ACKs and none is named: %w", ErrUnsupported)
		} else {
			select {
			case <-pa.done:
			case <-ctx.Done():
				pa.mu.Lock()
				missing := make([]string, 0, len(pa.wait))
				for n := range pa.wait {
					missing = append(missing, n)
				}
				pa.mu.Unlock()
				reason = fmt.Errorf("no drained ABORT_ACK from %v by the deadline: %w", missing, ErrTimeout)
			}
		}
	}
	pa.mu.Lock()
	res.Acked = append([]string(nil), pa.acked...)
	res.BytesConfirmed = pa.landed
	pa.mu.Unlock()
	if reason != nil {
		res.Reason = fmt.Errorf("abort request %d: not safe: %w", requestID, reason)
		e.stats.abortsNotSafe.Add(1)
		e.log.Warn("kvferry: abort not safe", "request", requestID, "err", res.Reason)
		return res, nil
	}
	res.Safe = true
	e.stats.abortsSafe.Add(1)
	return res, nil
}

// maxNoRIDWarned bounds the initiators remembered as warned about; past it
// the set starts afresh (a warning may then repeat, never go missing).
const maxNoRIDWarned = 4096

// firstNoRIDWarning reports whether Abort has not yet warned that name
// writes without request ids, and remembers that it now has.
func (e *Engine) firstNoRIDWarning(name string) bool {
	e.noRIDMu.Lock()
	defer e.noRIDMu.Unlock()
	if e.noRIDWarned[name] {
		return false
	}
	if len(e.noRIDWarned) >= maxNoRIDWarned || e.noRIDWarned == nil {
		e.noRIDWarned = map[string]bool{}
	}
	e.noRIDWarned[name] = true
	return true
}

// holders lists the initiators that hold access to requestID ahead of its
// bytes on some transport (rdma rkeys).
func (e *Engine) holders(requestID uint64) []string {
	var out []string
	for _, t := range e.servers() {
		if h, ok := t.(transport.AccessTracker); ok {
			out = append(out, h.Holders(requestID)...)
		}
	}
	return out
}

// undrained waits up to grace (and ctx) for a drained ACK from each of
// names, and returns those without one; a negative grace fences them all
// (the owner-side fence alone, ACKs or not).
func (pa *pendingAbort) undrained(ctx context.Context, names []string, grace time.Duration) []string {
	if grace < 0 {
		return names
	}
	var timeout <-chan time.Time
	if grace > 0 {
		t := time.NewTimer(grace)
		defer t.Stop()
		timeout = t.C
	}
	for {
		pa.mu.Lock()
		var left []string
		for _, n := range names {
			if !pa.drained[n] {
				left = append(left, n)
			}
		}
		pa.mu.Unlock()
		if len(left) == 0 || timeout == nil {
			return left
		}
		select {
		case <-pa.kick:
		case <-timeout:
			timeout = nil
		case <-ctx.Done():
			timeout = nil
		}
	}
}

// maxSegmentName bounds a segment name (a ZMQ routing id holds 255 bytes).
const maxSegmentName = 255

// servers returns the transports that serve accesses to our memory.
func (e *Engine) servers() []transport.Transport {
	if e.rdma != nil {
		return []transport.Transport{e.tcp, e.local, e.rdma}
	}
	return []transport.Transport{e.tcp, e.local}
}

// ownerCopiesAll reports whether every transport serving peers copies bytes
// in the owner's own code, so that refusal fences them.
func (e *Engine) ownerCopiesAll() bool {
	for _, t := range e.servers() {
		if c, ok := t.(transport.OwnerCopier); !ok || !c.OwnerCopies() {
			return false
		}
	}
	return true
}

// resendAbort resends ABORT to the initiators that have not acknowledged,
// with backoff, until all have, the deadline passes or the engine closes.
// Then the abort stops waiting: a later ACK is unmatched.
func (e *Engine) resendAbort(pa *pendingAbort, msg []byte, deadline time.Time) {
	defer e.bg.Done()
	defer e.forgetPending(pa)
	interval := abortResendFirst
	timer := time.NewTimer(interval)
	defer timer.Stop()
	for {
		select {
		case <-pa.done:
			return
		case <-e.closed:
			return
		case <-timer.C:
		}
		if !time.Now().Before(deadline) {
			return
		}
		pa.mu.Lock()
		names := make([]string, 0, len(pa.wait))
		for n := range pa.wait {
			names = append(names, n)
		}
		pa.mu.Unlock()
		for _, n := range names {
			_ = e.plane.Send(n, control.MsgAbort, msg)
			e.stats.abortResends.Add(1)
		}
		interval = min(2*interval, abortResendMax)
		timer.Reset(min(interval, time.Until(deadline)+time.Millisecond))
	}
}

func (e *Engine) forgetPending(pa *pendingAbort) {
	e.pendMu.Lock()
	delete(e.pending, abortKey{pa.rid, pa.gen})
	e.pendMu.Unlock()
}

// startBackground counts a background goroutine in, unless the engine is
// closing; Close waits for those counted.
func (e *Engine) startBackground() bool { return e.startIn(&e.bg) }

// handleAbortAck takes an initiator's ABORT_ACK (on the plane's loop).
func (e *Engine) handleAbortAck(from string, body []byte) (control.MsgType, []byte) {
	m, err := control.DecodeAbortAck(body)
	if err != nil {
		e.controlMalformed("ABORT_ACK", from, err)
		return 0, nil
	}
	// Any ACK, late or not, settles the initiator's debt to the rdma
	// fence: it holds the tombstone now, so its new QPs carry nothing of
	// the request.
	e.ackedFence(from, abortKey{m.RequestID, m.Generation})
	e.pendMu.Lock()
	pa := e.pending[abortKey{m.RequestID, m.Generation}]
	e.pendMu.Unlock()
	if pa == nil {
		e.stats.acksUnmatched.Add(1)
		return 0, nil
	}
	pa.mu.Lock()
	if m.Outcome == control.AckDrained && !pa.drained[from] {
		if _, named := pa.wait[from]; named || slices.Contains(pa.acked, from) {
			if pa.drained == nil {
				pa.drained = map[string]bool{}
			}
			pa.drained[from] = true
			select {
			case pa.kick <- struct{}{}:
			default:
			}
		}
	}
	if !pa.wait[from] || (pa.drainedOnly && m.Outcome != control.AckDrained && e.needDrainedAcks()) {
		// A duplicate, an initiator not named, or an ACK that promises
		// less than the fence needs: the ABORT is resent.
		pa.mu.Unlock()
		e.stats.acksUnmatched.Add(1)
		return 0, nil
	}
	delete(pa.wait, from)
	pa.acked = append(pa.acked, from)
	pa.landed += m.Landed
	all := len(pa.wait) == 0
	if all {
		close(pa.done)
	}
	pa.mu.Unlock()
	e.stats.abortAcks.Add(1)
	if all && !e.opts.Testing.UnsafeAbort {
		e.reqs.Acked(pa.rid, pa.gen)
	}
	return 0, nil
}

// needDrainedAcks reports whether ACKs must promise a drain: only where the
// fence rests on them, that is where a transport serving peers neither
// copies bytes in the owner's code nor fences by itself. Where refusal or
// the owner's QP fence fences, an ACK after a cut path is as good as any
// for learning that the initiator stopped.
func (e *Engine) needDrainedAcks() bool {
	for _, t := range e.servers() {
		if c, ok := t.(transport.OwnerCopier); ok && c.OwnerCopies() {
			continue
		}
		if _, ok := t.(transport.Fencer); ok {
			if fe, ok := t.(interface{ FenceEnabled() bool }); !ok || fe.FenceEnabled() {
				continue
			}
		}
		return true
	}
	return false
}

// controlMalformed counts a malformed control message from a peer and logs
// it, rate-limited per kind and peer.
func (e *Engine) controlMalformed(what, from string, err error) {
	e.stats.controlDropped.Add(1)
	e.peerWarn("malformed "+what, from, "kvferry: dropped malformed "+what, "peer", from, "err", err)
}

// peerWarn logs a warning a peer can cause, rate-limited per kind and peer
// (see ratelog): a peer sending garbage must not fill the host's logs.
func (e *Engine) peerWarn(kind, peer, msg string, args ...any) {
	e.peerLog.Warn(kind+"\x00"+peer, msg, args...)
}

// ---- initiator side --------------------------------------------------------

// tombKey names a request id aborted by one owner.
type tombKey struct {
	owner string
	rid   uint64
}

// tombstone remembers, as initiator, that an owner aborted a request: a
// transfer of it to that owner below minGen ends ABORTED.
type tombstone struct {
	minGen  uint32
	at      time.Time
	drained bool // the drain for minGen finished; outcome and landed are set
	outcome control.AckOutcome
	landed  uint64
	owed    bool   // an ABORT was heard: the drain's end answers it (and its duplicates)
	ackTo   string // the name the owed ABORT came from, which its ACK goes back to
}

// handleAbort takes an owner's ABORT (on the plane's loop, so it must not
// block): it records the tombstone, so a submit from now on ends ABORTED,
// finds the request's tasks to that owner in the task index, and hands
// their drain to the drain pool, which answers with ABORT_ACK. An ABORT
// with nothing to drain (no task of the request, no path to the owner that
// may hold its work: one from an owner we never opened, say) is answered
// here at once. An ABORT for which there is no room (the drain backlog, or
// every owner slot busy draining) is dropped unanswered and counted: the
// owner resends it, and its safety never rests on our answer alone.
func (e *Engine) handleAbort(from string, body []byte) (control.MsgType, []byte) {
	m, err := control.DecodeAbortMsg(body)
	if err == nil && m.Generation == 0 {
		err = fmt.Errorf("%w: ABORT below generation 0 aborts nothing", control.ErrMalformed)
	}
	if err != nil {
		e.controlMalformed("ABORT", from, err)
		return 0, nil
	}
	e.stats.abortsReceived.Add(1)
	// Recorded and matched under the owner's own name: an ABORT arrives on
	// whichever control connection the owner routes to us, the one we
	// opened by an alias of it or by its own name, while its request's
	// tasks may go through a segment opened by either (see abortOwner).
	owner := e.abortOwner(from)
	if e.opts.Testing.UnsafeAbort {
		// "Heard" is all this ACK means: SGLang's ABORT_ACK.
		e.sendAck(from, control.AbortAck{RequestID: m.RequestID, Generation: m.Generation, Outcome: control.AckHeard})
	}
	k := tombKey{owner, m.RequestID}
	e.abortMu.Lock()
	tb := e.tombs[k]
	if tb != nil && tb.minGen >= m.Generation {
		// A duplicate (or an older ABORT): answer it once drained.
		var ack control.AbortAck
		drained := tb.drained
		if drained {
			// The drain at minGen covers every older generation: answer
			// the one asked about, which the owner is waiting for.
			ack = control.AbortAck{RequestID: m.RequestID, Generation: m.Generation, Outcome: tb.outcome, Landed: tb.landed}
		} else {
			tb.owed, tb.ackTo = true, from
		}
		e.abortMu.Unlock()
		if drained && !e.opts.Testing.UnsafeAbort {
			e.sendAck(from, ack)
		}
		return 0, nil
	}
	tasks, settled, ok := e.beginAbortLocked(k, m.Generation, from)
	e.abortMu.Unlock()
	if !ok {
		e.stats.abortsDropped.Add(1)
		e.peerWarn("abort-dropped", from, "kvferry: ABORT dropped unanswered for want of room; the owner resends it",
			"peer", from, "request", m.RequestID, "generation", m.Generation)
		return 0, nil
	}
	// The tasks stop now, whenever a drainer gets to wait for them: this
	// marks them and drops their queued slices, without waiting.
	for _, t := range tasks {
		t.abort()
	}
	e.emit(Event{Kind: EventAborted, Peer: owner, RequestID: m.RequestID, Generation: m.Generation})
	if settled && !e.opts.Testing.UnsafeAbort {
		e.sendAck(from, control.AbortAck{RequestID: m.RequestID, Generation: m.Generation, Outcome: control.AckDrained})
	}
	return 0, nil
}

// Bounds of the drain pool: at most maxDrainers goroutines drain aborted
// requests, and at most maxDrainBacklog drains wait for one. A drain is
// short unless a slice of the request hangs (AbortDrainTimeout, twice at
// most); an ABORT with nothing to drain never reaches the pool.
const (
	maxDrainers     = 64
	maxDrainBacklog = 1 << 14
)

// drainJob is one aborted request's drain, waiting for the pool.
type drainJob struct {
	k     tombKey
	gen   uint32
	tasks []*task
}

// beginAbortLocked records that k's owner aborted its request below gen and
// returns the request's tasks in flight to that owner; their drain goes to
// the pool, or, when there is nothing to drain, the tombstone is settled at
// once (settled: the caller answers an owed ABORT itself). ackTo is the
// name the ABORT came from, which the drain's ACK goes to ("" when the
// abort was learned from a refusal: no ACK is owed). ok is false
// when there is no room: nothing was recorded. Called with abortMu held,
// which Submit holds (shared) from its tombstone check until its tasks are
// in the task index: a task is either found here or sees the tombstone.
func (e *Engine) beginAbortLocked(k tombKey, gen uint32, ackTo string) (tasks []*task, settled, ok bool) {
	tasks = e.tasks.lookup(k.owner, k.rid, gen)
	segs := e.segmentsKnownAs(k.owner)
	quick := false
	if len(tasks) == 0 {
		drainers, uncertain := e.pathsToDrain(k, segs)
		quick = len(drainers) == 0 && !uncertain
	}
	if !quick {
		e.drainMu.Lock()
		full := len(e.drainQ) >= maxDrainBacklog
		e.drainMu.Unlock()
		if full {
			return nil, false, false
		}
	}
	tb := e.tombs[k]
	if tb == nil {
		if tb = e.newTomb(k, len(segs) > 0); tb == nil {
			return nil, false, false
		}
	}
	tb.minGen, tb.at, tb.drained, tb.owed, tb.ackTo = gen, time.Now(), false, ackTo != "", ackTo
	if quick {
		tb.drained, tb.outcome, tb.landed, tb.owed = true, control.AckDrained, 0, false
		return nil, true, true
	}
	// Room was checked above, and only holders of abortMu add drains.
	e.queueDrainLocked(drainJob{k: k, gen: gen, tasks: tasks})
	return tasks, false, true
}

// queueDrainLocked hands a drain to the pool, starting a drainer when fewer
// than maxDrainers run. Called with abortMu held.
func (e *Engine) queueDrainLocked(j drainJob) {
	e.drainMu.Lock()
	defer e.drainMu.Unlock()
	e.drainQ = append(e.drainQ, j)
	if e.drainers < maxDrainers && e.startBackground() {
		e.drainers++
		go e.drainer()
	}
}

// drainer runs drains from the pool's queue until it is empty, or until
// the engine closes (Close ended every task; no ACK is owed any more).
func (e *Engine) drainer() {
	defer e.bg.Done()
	for {
		e.drainMu.Lock()
		select {
		case <-e.closed:
			clear(e.drainQ)
			e.drainQ = e.drainQ[:0]
		default:
		}
		if len(e.drainQ) == 0 {
			e.drainQ = nil // let a long backlog's array go
			e.drainers--
			e.drainMu.Unlock()
			return
		}
		j := e.drainQ[0]
		e.drainQ[0] = drainJob{}
		e.drainQ = e.drainQ[1:]
		e.drainMu.Unlock()
		e.drain(j.k, j.gen, j.tasks)
	}
}

// drain stops the tasks of an aborted request: queued slices are dropped,
// slices on the wire or being copied are waited for (their owner answers or
// refuses them), up to AbortDrainTimeout, after which their paths are cut.
// Then it sends the ABORT_ACK: one answers the ABORT and every duplicate
// heard while draining (the owner needs one; each extra would only be
// counted unmatched there). Duplicates heard later get one each.
func (e *Engine) drain(k tombKey, gen uint32, tasks []*task) {
	for _, t := range tasks {
		t.abort()
	}
	outcome := control.AckDrained
	if !e.waitFinal(tasks, time.Now().Add(e.opts.AbortDrainTimeout)) {
		outcome = control.AckCut
		cut := map[*pathRef]struct{}{}
		for _, t := range tasks {
			t.collectPaths(cut)
		}
		// Not ErrAborted: other requests' slices on these paths fail too,
		// and must not be taken for aborted.
		for ref := range cut {
			ref.ep.Abort(fmt.Errorf("%w: an aborted request's slices did not end within AbortDrainTimeout", transport.ErrCanceled))
		}
		e.waitFinal(tasks, time.Now().Add(e.opts.AbortDrainTimeout))
	}
	if outcome == control.AckDrained && !e.drainPaths(k) {
		outcome = control.AckCut
	}
	var landed uint64
	for _, t := range tasks {
		landed += t.transferred.Load()
	}
	e.abortMu.Lock()
	tb := e.tombs[k]
	owed, to := false, k.owner
	if tb != nil && tb.minGen == gen {
		tb.drained, tb.outcome, tb.landed = true, outcome, landed
		owed, tb.owed = tb.owed, false
		if tb.ackTo != "" {
			to = tb.ackTo
		}
	}
	e.abortMu.Unlock()
	if !e.opts.Testing.UnsafeAbort && owed {
		e.sendAck(to, control.AbortAck{RequestID: k.rid, Generation: gen, Outcome: outcome, Landed: landed})
	}
}

// abortOwner is the name an ABORT from peer is recorded and matched under:
// the owner engine's own name (its descriptor's) when a segment is open by
// the name peer. The owner's control socket routes its ABORT on whichever
// of our connections to it is newest: the one opened by an alias, or by its
// own name. A segment opened by the alias knows both names (knownAs), but
// one opened by the own name knows only that one, so keyed by the alias the
// task index would miss the request's tasks through it, its paths would
// not be drained (their rkeys kept) and its submits would not see the
// tombstone: the ACK would say drained while its work goes on.
func (e *Engine) abortOwner(peer string) string {
	e.segMu.Lock()
	defer e.segMu.Unlock()
	if seg := e.segments[peer]; seg != nil {
		return seg.id()
	}
	return peer
}

// segmentsKnownAs returns the open segments a message from peer may come
// from (see Segment.knownAs): one opened under an alias (a custom
// Resolver) is found too.
func (e *Engine) segmentsKnownAs(peer string) []*Segment {
	e.segMu.Lock()
	defer e.segMu.Unlock()
	var segs []*Segment
	for _, seg := range e.segments {
		if seg.knownAs(peer) {
			segs = append(segs, seg)
		}
	}
	return segs
}

// pathsToDrain returns the paths to the owner, among segs, that may still
// move bytes of ended slices (a transport.Drainer: rdma), and reports
// whether some path, perhaps one replaced or closed since, lost work of the
// request without the owner's answer: it may still land. Paths of tcp and
// local have nothing to drain once their slices ended. It never blocks.
func (e *Engine) pathsToDrain(k tombKey, segs []*Segment) (drainers []transport.Drainer, uncertain bool) {
	if e.rdma != nil {
		if e.rdma.Uncertain(k.owner, k.rid) {
			return nil, true
		}
		for _, seg := range segs {
			if e.rdma.Uncertain(seg.name, k.rid) {
				return nil, true
			}
		}
	}
	for _, seg := range segs {
		seg.mu.Lock()
		for _, ref := range seg.paths {
			if ref == nil {
				continue
			}
			if d, ok := ref.ep.(transport.Drainer); ok {
				drainers = append(drainers, d)
			}
		}
		seg.mu.Unlock()
	}
	return drainers, false
}

// drainPaths asks every path to the owner that may still move bytes of
// ended slices to finish or flush the request's work; it reports whether
// all did.
func (e *Engine) drainPaths(k tombKey) bool {
	drainers, uncertain := e.pathsToDrain(k, e.segmentsKnownAs(k.owner))
	if uncertain {
		return false
	}
	if len(drainers) == 0 {
		return true
	}
	ctx, cancel := context.WithTimeout(context.Background(), e.opts.AbortDrainTimeout)
	defer cancel()
	ok := true
	for _, d := range drainers {
		if err := d.Drain(ctx, k.rid); err != nil {
			e.peerWarn("drain", k.owner, "kvferry: drain failed; the ACK says cut", "owner", k.owner, "request", k.rid, "err", err)
			ok = false
		}
	}
	return ok
}

// sendAck answers an ABORT over a connection that exists (the one it came
// on, mostly) and never opens one: the sender's name is whatever it claimed,
// so a made-up one must cost no socket, and a real owner resends its ABORT
// until it hears back.
func (e *Engine) sendAck(owner string, ack control.AbortAck) {
	_ = e.plane.SendIfConnected(owner, control.MsgAbortAck, ack.Encode())
	e.stats.acksSent.Add(1)
}

// waitFinal waits until every task is final, the deadline passes or the
// engine closes; it reports whether all are final. Aborts are rare, so it
// polls rather than giving every task a channel.
func (e *Engine) waitFinal(tasks []*task, deadline time.Time) bool {
	sleep := 20 * time.Microsecond
	for {
		all := true
		for _, t := range tasks {
			if !TaskStatus(t.status.Load()).Final() {
				all = false
				break
			}
		}
		if all {
			return true
		}
		if !time.Now().Before(deadline) {
			return false
		}
		select {
		case <-e.closed:
			return false
		case <-time.After(sleep):
		}
		sleep = min(2*sleep, 2*time.Millisecond)
	}
}

// abort marks the task ABORTED and drops its queued slices; slices on the
// wire or being copied end on their own (the owner answers or refuses
// them).
func (t *task) abort() {
	if TaskStatus(t.status.Load()).Final() {
		return
	}
	t.final.CompareAndSwap(0, int32(Aborted))
	for i := range t.slices {
		s := &t.slices[i]
		if s.Advance(transport.StateQueued, transport.StateCanceled) {
			t.sliceEnded(s, transport.ErrCanceled)
		}
	}
}

// collectPaths adds the paths of the task's slices not yet ended.
func (t *task) collectPaths(cut map[*pathRef]struct{}) {
	for i := range t.slices {
		s := &t.slices[i]
		if st := s.State(); st != transport.StateDone && st != transport.StateCanceled {
			if ref := s.path.Load(); ref != nil {
				cut[ref] = struct{}{}
			}
		}
	}
}

// learnAbort records an abort learned from an owner's refusal (its ABORT
// may have been lost, or sent while we were paused) and tells the
// application, once per request and generation. The request's other
// transfers stop as on an ABORT, so that an ABORT arriving now is answered
// only once they ended; nothing is owed yet: the owner did not ask. Without
// room it records nothing: the owner refuses the request's transfers all
// the same.
func (e *Engine) learnAbort(owner string, rid uint64, refusedGen uint32) {
	if rid == 0 {
		return
	}
	k := tombKey{owner, rid}
	gen := refusedGen + 1
	e.abortMu.Lock()
	if tb := e.tombs[k]; tb != nil && tb.minGen >= gen {
		e.abortMu.Unlock()
		return
	}
	// The drainer stops the other tasks: this runs inside a slice's
	// completion, which must not stop others itself.
	_, _, ok := e.beginAbortLocked(k, gen, "")
	e.abortMu.Unlock()
	if ok {
		e.emit(Event{Kind: EventAborted, Peer: owner, RequestID: rid, Generation: gen})
	}
}

// MaxTombstoneOwners caps the owners an initiator remembers tombstones
// of. Owners are named by the peers themselves (a control message's
// sender), so without a cap ABORTs from made-up names would each leave a
// tombstone queue for ever. Past the cap the owners whose every tombstone
// is settled (drained and answered) are forgotten, down to 7/8 of it:
// first those no open segment is known as, then the others, least recently
// aborting first. An ABORT from a new owner when none can go is dropped
// unanswered (the owner resends it).
const MaxTombstoneOwners = 1024

// unknownOwnerTombstones caps the tombstones kept per owner that no open
// segment is known as (MaxTombstones caps them too): nothing of ours can be
// in flight to such an owner, so its tombstones only matter to a segment
// opened later, and made-up owners must not each hold MaxTombstones.
const unknownOwnerTombstones = 64

// newTomb adds an initiator tombstone, first forgetting the oldest of the
// same owner past its cap (MaxTombstones, unknownOwnerTombstones for an
// owner that no open segment is known as: a cap per owner, so that one
// peer's ABORTs never push out another owner's tombstones). A tombstone
// whose drain has not finished, or whose ACK is still owed, is never
// forgotten: the owner may be waiting on it, and a submit would otherwise
// slip past an abort in progress. Those end within AbortDrainTimeout twice
// and are at most as many as the drain pool holds, so an owner is over its
// cap only briefly. It returns nil when the owner is new and no other may
// go to make room for it (MaxTombstoneOwners). Called with abortMu held.
func (e *Engine) newTomb(k tombKey, known bool) *tombstone {
	q, seen := e.tombQueues[k.owner]
	if !seen && len(e.tombQueues) >= e.maxTombOwners {
		e.forgetOwnersLocked()
		if len(e.tombQueues) >= e.maxTombOwners {
			return nil
		}
	}
	limit := e.opts.MaxTombstones
	if !known {
		limit = min(limit, unknownOwnerTombstones)
	}
	for len(q) >= limit {
		i := slices.IndexFunc(q, func(rid uint64) bool {
			return e.tombs[tombKey{k.owner, rid}].settled()
		})
		if i < 0 {
			break
		}
		delete(e.tombs, tombKey{k.owner, q[i]})
		q = slices.Delete(q, i, i+1)
	}
	tb := &tombstone{}
	e.tombs[k] = tb
	e.tombQueues[k.owner] = append(q, k.rid)
	return tb
}

// newTombLocked adds an initiator tombstone (see newTomb), k's owner known
// as an open segment or not. Called with abortMu held.
func (e *Engine) newTombLocked(k tombKey) *tombstone {
	return e.newTomb(k, len(e.segmentsKnownAs(k.owner)) > 0)
}

// settled reports whether the tombstone may be forgotten: its drain
// finished and its ACK is not owed (a nil one is gone already).
func (tb *tombstone) settled() bool { return tb == nil || (tb.drained && !tb.owed) }

// forgetOwnersLocked forgets every tombstone of owners whose tombstones are
// all settled, down to 7/8 of MaxTombstoneOwners, so that the walk is paid
// once per many new owners: first owners no open segment is known as (at
// most unknownOwnerTombstones each, so a flood of made-up names costs
// little), and only when that is not enough the others; least recently
// aborting first. Called with abortMu held.
func (e *Engine) forgetOwnersLocked() {
	known := map[string]bool{}
	e.segMu.Lock()
	for _, seg := range e.segments {
		known[seg.name] = true
		known[seg.id()] = true
	}
	e.segMu.Unlock()
	target := e.maxTombOwners * 7 / 8
	for _, pass := range []bool{false, true} {
		type cand struct {
			owner string
			last  time.Time
		}
		var cands []cand
		for owner, q := range e.tombQueues {
			if known[owner] != pass {
				continue
			}
			var last time.Time
			ok := true
			for _, rid := range q {
				tb := e.tombs[tombKey{owner, rid}]
				if !tb.settled() {
					ok = false
					break
				}
				if tb != nil && tb.at.After(last) {
					last = tb.at
				}
			}
			if ok {
				cands = append(cands, cand{owner, last})
			}
		}
		slices.SortFunc(cands, func(a, b cand) int { return a.last.Compare(b.last) })
		for _, c := range cands {
			if len(e.tombQueues) <= target {
				return
			}
			for _, rid := range e.tombQueues[c.owner] {
				delete(e.tombs, tombKey{c.owner, rid})
			}
			delete(e.tombQueues, c.owner)
			e.stats.tombOwnersForgotten.Add(1)
		}
	}
}

// sweepTombs forgets initiator tombstones older than TombstoneTTL whose
// drain finished and whose ACK is not owed.
func (e *Engine) sweepTombs(now time.Time) {
	e.abortMu.Lock()
	defer e.abortMu.Unlock()
	for owner, q := range e.tombQueues {
		i := 0
		for ; i < len(q); i++ {
			tb := e.tombs[tombKey{owner, q[i]}]
			if tb == nil {
				continue
			}
			if now.Sub(tb.at) < e.opts.TombstoneTTL || !tb.drained || tb.owed {
				break
			}
			delete(e.tombs, tombKey{owner, q[i]})
		}
		if i == len(q) {
			delete(e.tombQueues, owner)
		} else if i > 0 {
			e.tombQueues[owner] = slices.Clone(q[i:])
		}
	}
}

// segAbortedLocked reports whether a transfer of rid at gen to seg was
// aborted, under either name of its engine (see Segment.knownAs). Called
// with abortMu held (shared).
func (e *Engine) segAbortedLocked(seg *Segment, rid uint64, gen uint32) bool {
	if e.abortedLocked(seg.name, rid, gen) {
		return true
	}
	id := seg.id()
	return id != seg.name && e.abortedLocked(id, rid, gen)
}

// abortedLocked reports whether a transfer of rid at gen to owner was aborted.
// Called with abortMu held (shared).
func (e *Engine) abortedLocked(owner string, rid uint64, gen uint32) bool {
	tb := e.tombs[tombKey{owner, rid}]
	return tb != nil && gen < tb.minGen
}

// ---- grants -----------------------------------------------------------------

// GrantRange is an owner address range of a grant.
type GrantRange = requests.Range

// Grant is a live grant, from Engine.Grant.
type Grant = requests.Grant

// Grant lets initiator (a segment name) access ranges of this engine's
// memory for requestID. From a request id's first grant on, every access of
// it must fall inside a live grant of its initiator and carry the grant's
// generation; without grants a registered range is open to every peer.
func (e *Engine) Grant(initiator string, requestID uint64, ranges []GrantRange) (Grant, error) {
	if err := e.checkOpen(); err != nil {
		return Grant{}, err
	}
	if _, _, err := net.SplitHostPort(initiator); err != nil || len(initiator) > maxSegmentName {
		return Grant{}, fmt.Errorf("grant: %w: initiator %q is not a segment name (host:port)", ErrInvalidArg, initiator)
	}
	g, err := e.reqs.Grant(initiator, requestID, ranges)
	if err != nil {
		return Grant{}, fmt.Errorf("%w", err)
	}
	return g, nil
}

// Revoke withdraws a grant: accesses under it are refused from now on, and
// Revoke returns once none is in progress, or with ErrTimeout at ctx's
// deadline (the grant stays withdrawn).
func (e *Engine) Revoke(ctx context.Context, grantID uint64) error {
	if err := e.checkOpen(); err != nil {
		return err
	}
	g, _ := e.reqs.GrantOf(grantID)
	wait, err := e.reqs.Revoke(grantID)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidArg, err)
	}
	// An initiator holding rkeys admitted under the grant (rdma) is cut:
	// it asks again after reconnecting, and is refused.
	for _, t := range e.servers() {
		h, okh := t.(transport.AccessTracker)
		f, okf := t.(transport.Fencer)
		if !okh || !okf || !slices.Contains(h.Holders(g.RequestID), g.Initiator) {
			continue
		}
		if fe, ok := t.(interface{ FenceEnabled() bool }); ok && !fe.FenceEnabled() {
			return fmt.Errorf("revoke grant %d: %s holds rkeys and the rdma fence is off: %w", grantID, g.Initiator, ErrUnsupported)
		}
		if err := f.Fence(ctx, g.Initiator); err != nil {
			return fmt.Errorf("revoke grant %d: fence %s: %w", grantID, g.Initiator, err)
		}
	}
	if wait == nil {
		return nil
	}
	select {
	case <-wait:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("revoke grant %d: copies still in progress: %w: %w", grantID, ErrTimeout, ctx.Err())
	}
}

// isAbortRefusal reports whether a slice failed because the owner aborted
// its request.
func isAbortRefusal(err error) bool {
	return errors.Is(err, transport.ErrRefused) && errors.Is(err, transport.ErrAborted)
}
