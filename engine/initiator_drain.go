package engine

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/kvferry/kvferry/engine/control"
	"github.com/kvferry/kvferry/engine/transport"
)

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
	recheck := false
	var names []string
	if outcome == control.AckDrained {
		var ok bool
		if ok, names = e.drainPaths(k, nil); !ok {
			outcome, recheck = control.AckCut, true
		}
	}
	var landed uint64
	for _, t := range tasks {
		landed += t.transferred.Load()
	}
	e.abortMu.Lock()
	tb := e.tombOf(k)
	owed, to := false, k.owner
	if tb != nil && tb.minGen == gen {
		tb.drained, tb.outcome, tb.landed, tb.recheck = true, outcome, landed, recheck
		if recheck {
			tb.names = names
		}
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

// recheckDrain asks the paths again whether the work of an aborted
// request, whose drain ended cut only because a path could not confirm it
// yet, is drained now (a broken rdma path's reconnect settles its flushed
// work: the owner cut the responder QP it was posted to). If so the
// tombstone says drained from now on and the owner, which resent its ABORT
// because it waits for a drained ACK, gets one for the generation it asked
// about (ackGen). The cut ACK went out at once all the same: an owner that
// fences by itself needs no more, and must not wait for this. tb is the
// tombstone it was started for, at minGen gen; names are the names the
// drain found the owner's paths under, asked again even if their segments
// closed since (a path's marks outlive it).
func (e *Engine) recheckDrain(k tombKey, tb *tombstone, gen, ackGen uint32, names []string, to string) {
	defer e.bg.Done()
	ok, _ := e.drainPaths(k, names)
	e.abortMu.Lock()
	cur := e.tombOf(k) == tb && tb.minGen == gen
	if cur {
		tb.rechecking = false
	}
	if !cur || !ok || !tb.drained || !tb.recheck {
		e.abortMu.Unlock()
		return
	}
	tb.outcome, tb.recheck, tb.names = control.AckDrained, false, nil
	ack := control.AbortAck{RequestID: k.rid, Generation: ackGen, Outcome: control.AckDrained, Landed: tb.landed}
	e.abortMu.Unlock()
	e.stats.drainRechecked.Add(1)
	e.sendAck(to, ack)
}

// pathsToDrain returns the paths to the owner, among segs, that may still
// move bytes of ended slices (a transport.Drainer: rdma), and reports
// whether some path, perhaps one replaced or closed since, lost work of the
// request without the owner's answer: it may still land. Paths of tcp and
// local have nothing to drain once their slices ended. It never blocks.
func (e *Engine) pathsToDrain(k tombKey, segs []*Segment, also []string) (drainers []transport.Drainer, uncertain bool) {
	for _, a := range e.servers() {
		if a.uncertain == nil {
			continue
		}
		if a.uncertain.Uncertain(k.owner, k.rid) {
			return nil, true
		}
		for _, name := range also {
			if a.uncertain.Uncertain(name, k.rid) {
				return nil, true
			}
		}
		for _, seg := range segs {
			if a.uncertain.Uncertain(seg.name, k.rid) {
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
// all did, and the names it found the owner's segments under (also: names
// to ask about besides, those of segments that may have closed since).
func (e *Engine) drainPaths(k tombKey, also []string) (ok bool, names []string) {
	segs := e.segmentsKnownAs(k.owner)
	names = append(names, also...)
	for _, seg := range segs {
		if !slices.Contains(names, seg.name) {
			names = append(names, seg.name)
		}
	}
	drainers, uncertain := e.pathsToDrain(k, segs, also)
	if uncertain {
		return false, names
	}
	if len(drainers) == 0 {
		return true, names
	}
	ctx, cancel := context.WithTimeout(context.Background(), e.opts.AbortDrainTimeout)
	defer cancel()
	ok = true
	for _, d := range drainers {
		if err := d.Drain(ctx, k.rid); err != nil {
			e.peerWarn("drain", k.owner, "kvferry: drain failed; the ACK says cut", "owner", k.owner, "request", k.rid, "err", err)
			ok = false
		}
	}
	return ok, names
}

// sendAck answers an ABORT over a connection that exists (the one it came
// on, mostly) and never opens one: the sender's name is whatever it claimed,
// so a made-up one must cost no socket, and a real owner resends its ABORT
// until it hears back.
func (e *Engine) sendAck(owner string, ack control.AbortAck) {
	err := e.plane.SendIfConnected(owner, control.MsgAbortAck, ack.Encode())
	if e.traceID != 0 && ack.RequestID == e.traceID {
		e.log.Debug("kvferry: trace: ABORT_ACK sent", "request", ack.RequestID, "owner", owner, "generation", ack.Generation,
			"outcome", ack.Outcome, "landed", ack.Landed, "err", err)
	}
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
