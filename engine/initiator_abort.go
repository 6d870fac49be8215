package engine

import (
	"errors"
	"fmt"
	"slices"

	"github.com/kvferry/kvferry/engine/control"
	"github.com/kvferry/kvferry/engine/transport"
)

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
	if e.traceID != 0 && m.RequestID == e.traceID {
		e.log.Debug("kvferry: trace: ABORT received", "request", m.RequestID, "owner", from, "generation", m.Generation)
	}
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
	tb := e.tombOf(k)
	if tb != nil && tb.minGen >= m.Generation {
		// A duplicate (or an older ABORT): answer it once drained.
		var ack control.AbortAck
		drained := tb.drained
		if drained {
			// The drain at minGen covers every older generation: answer
			// the one asked about, which the owner is waiting for.
			ack = control.AbortAck{RequestID: m.RequestID, Generation: m.Generation, Outcome: tb.outcome, Landed: tb.landed}
			if tb.recheck && !tb.rechecking && e.startBackground() {
				// The owner asks again after a cut ACK: it waits for a
				// drained one, which the paths may confirm by now.
				tb.rechecking = true
				go e.recheckDrain(k, tb, tb.minGen, m.Generation, slices.Clone(tb.names), from)
			}
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
		drainers, uncertain := e.pathsToDrain(k, segs, nil)
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
	tb := e.tombOf(k)
	if tb == nil {
		if tb = e.newTomb(k, len(segs) > 0); tb == nil {
			return nil, false, false
		}
	} else {
		e.renewTomb(k, tb)
	}
	tb.minGen, tb.drained, tb.owed, tb.ackTo = gen, false, ackTo != "", ackTo
	// A recheck of an older generation may still run: it finds minGen
	// moved and changes nothing.
	tb.recheck, tb.rechecking, tb.names = false, false, nil
	if quick {
		tb.drained, tb.outcome, tb.landed, tb.owed = true, control.AckDrained, 0, false
		return nil, true, true
	}
	// Room was checked above, and only holders of abortMu add drains.
	e.queueDrainLocked(drainJob{k: k, gen: gen, tasks: tasks})
	return tasks, false, true
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
	if tb := e.tombOf(k); tb != nil && tb.minGen >= gen {
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

// isAbortRefusal reports whether a slice failed because the owner aborted
// its request.
func isAbortRefusal(err error) bool {
	return errors.Is(err, transport.ErrRefused) && errors.Is(err, transport.ErrAborted)
}
