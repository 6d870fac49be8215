// Failover: broken pairs, their reset, and completions, which post the
// failed slices again on a healthy pair or finish them.

package rdma

import (
	"context"
	"fmt"
	"time"

	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/verbs"
)

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
// completes (flushed), and a new QP is connected in its slot. The owner's
// answer to that connect says the responder QPs of the slot are cut, which
// settles the work flushed on the QPs replaced (markUnsettled); a path
// that dies first leaves that work uncertain.
func (e *Endpoint) reset(p *pair) {
	defer e.resets.Done()
	var replaced []*verbs.QP
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
			if p.qp != nil {
				replaced = append(replaced, p.qp)
			}
			e.mu.Unlock()
			e.t.settle(replaced, false)
			return
		}
		old := p.qp
		p.qp = nil
		e.mu.Unlock()
		if old != nil {
			replaced = append(replaced, old)
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
			e.t.settle(replaced, true)
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
			// later): no drain of it can be promised until the owner
			// has cut the responder QP this was posted to (the reset's
			// reconnect of the slot does that), or at all if the path
			// dies first. p.qp is still the QP it was posted on: a
			// reset replaces it only once all its work completed.
			if e.dead || p.qp == nil {
				e.t.markUncertain(e.peer, w.s.RequestID)
			} else {
				e.t.markUnsettled(e.peer, w.s.RequestID, p.qp)
			}
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
