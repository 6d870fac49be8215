package engine

import (
	"context"
	"fmt"
	"maps"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvferry/kvferry/engine/control"
	"github.com/kvferry/kvferry/engine/internal/bounded"
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

// awaited returns the peers in wait, those yet to acknowledge an ABORT or
// a FENCE, read under mu.
func awaited(mu *sync.Mutex, wait map[string]bool) []string {
	mu.Lock()
	defer mu.Unlock()
	return slices.Collect(maps.Keys(wait))
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
	start := time.Now()
	res, err := e.abortRequest(ctx, requestID, initiators)
	if err == nil && e.metrics != nil {
		observeSafe(e.metrics.abort, start, res.Safe)
	}
	if e.traceID != 0 && requestID == e.traceID {
		e.log.Debug("kvferry: trace: abort answered", "request", requestID, "initiators", initiators, "safe", res.Safe,
			"acked", res.Acked, "bytes_confirmed", res.BytesConfirmed, "took", time.Since(start), "reason", res.Reason, "err", err)
	}
	return res, err
}

func (e *Engine) abortRequest(ctx context.Context, requestID uint64, initiators []string) (AbortResult, error) {
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
		for _, a := range e.servers() {
			switch {
			case a.ownerCopies:
			case a.tracker != nil && named == 0:
				// No initiator holds access to the request through it.
			case a.fence() != nil && named > 0:
				fences = append(fences, a.fence())
			default:
				needAcks = true
			}
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
				missing := awaited(&pa.mu, pa.wait)
				reason = fmt.Errorf("no drained ABORT_ACK from %v by the deadline: %w", missing, ErrTimeout)
			}
		}
	}
	pa.mu.Lock()
	res.Acked = append([]string(nil), pa.acked...)
	res.BytesConfirmed = pa.landed
	pa.mu.Unlock()
	if reason != nil {
		reason = fmt.Errorf("abort request %d: not safe: %w", requestID, reason)
	}
	res.Reason = e.countSafe(&e.stats.abortsSafe, &e.stats.abortsNotSafe, "abort", reason, "request", requestID)
	res.Safe = res.Reason == nil
	return res, nil
}

// countSafe counts an Abort's or a Fence's outcome, Safe when reason is
// nil, and logs why it is not; it returns reason.
func (e *Engine) countSafe(safe, notSafe *atomic.Uint64, what string, reason error, args ...any) error {
	if reason == nil {
		safe.Add(1)
		return nil
	}
	notSafe.Add(1)
	e.log.Warn("kvferry: "+what+" not safe", append(args, "err", reason)...)
	return reason
}

// maxNoRIDWarned bounds the initiators remembered as warned about; past it
// the set starts afresh (a warning may then repeat, never go missing).
const maxNoRIDWarned = 4096

// newNoRIDWarned returns the empty set of initiators warned about: at its
// cap it keeps only the newest (Trim 1), as nothing safety-relevant rests
// on it.
func newNoRIDWarned() *bounded.Set[string, struct{}] {
	return bounded.New(bounded.Options[string, struct{}]{Cap: maxNoRIDWarned, Trim: 1})
}

// firstNoRIDWarning reports whether Abort has not yet warned that name
// writes without request ids, and remembers that it now has.
func (e *Engine) firstNoRIDWarning(name string) bool {
	e.noRIDMu.Lock()
	defer e.noRIDMu.Unlock()
	if e.noRIDWarned.Has(name) {
		return false
	}
	e.noRIDWarned.Put(name, struct{}{})
	return true
}

// holders lists the initiators that hold access to requestID ahead of its
// bytes on some transport (rdma rkeys).
func (e *Engine) holders(requestID uint64) []string {
	var out []string
	for _, a := range e.servers() {
		if a.tracker != nil {
			out = append(out, a.tracker.Holders(requestID)...)
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
		for _, n := range awaited(&pa.mu, pa.wait) {
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
	if e.traceID != 0 && m.RequestID == e.traceID {
		e.log.Debug("kvferry: trace: ABORT_ACK received", "request", m.RequestID, "initiator", from, "generation", m.Generation,
			"outcome", m.Outcome, "landed", m.Landed)
	}
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
	for _, a := range e.servers() {
		if !a.ownerCopies && a.fence() == nil {
			return true
		}
	}
	return false
}
