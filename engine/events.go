package engine

import (
	"context"
	"encoding/binary"
	"fmt"
	"slices"

	"github.com/kvferry/kvferry/engine/control"
	"golang.org/x/sys/unix"
)

// EventKind says what an Event reports.
type EventKind int

// The event kinds.
const (
	// EventAborted: an owner aborted RequestID (below Generation); our
	// transfers of it to Peer end ABORTED, and new ones do at once.
	EventAborted EventKind = 1
	// EventNotify: Peer sent Data about RequestID with Notify.
	EventNotify EventKind = 2
	// EventCanceled: Peer, an initiator, gave up on RequestID (a deadline
	// passed or its caller canceled) and moves no more bytes of it. Told
	// best effort: safety never depends on it.
	EventCanceled EventKind = 3
)

var eventKindNames = [...]string{EventAborted: "ABORTED", EventNotify: "NOTIFY", EventCanceled: "CANCELED"}

// String returns the kind's name in capitals (ABORTED, NOTIFY, CANCELED).
func (k EventKind) String() string {
	if k > 0 && int(k) < len(eventKindNames) {
		return eventKindNames[k]
	}
	return fmt.Sprintf("EventKind(%d)", int(k))
}

// Event is something the application should learn of.
type Event struct {
	Kind       EventKind
	Peer       string // the peer's segment name
	RequestID  uint64
	Generation uint32 // EventAborted: the request's generation after the abort
	Data       []byte // EventNotify: the payload, at most MaxNotifyData bytes
}

// MaxNotifyData caps a notification's payload (the C API's
// KVF_EVENT_DATA_MAX).
const MaxNotifyData = control.MaxNotifyData

// Events returns the channel events arrive on, in order, at most
// Options.EventQueue waiting. It is closed by Close.
func (e *Engine) Events() <-chan Event { return e.events }

// EventFD returns a file descriptor (an eventfd) that is readable while
// events may be waiting, for event loops (epoll, asyncio) that cannot wait
// on a channel. Reading it is the caller's business only through
// TakeEvents, which resets it; do not close it: Close does.
func (e *Engine) EventFD() (int, error) {
	if err := e.checkOpen(); err != nil {
		return -1, err
	}
	e.evMu.Lock()
	defer e.evMu.Unlock()
	if e.efd < 0 {
		fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
		if err != nil {
			return -1, fmt.Errorf("event fd: %w", err)
		}
		e.efd = fd
		if len(e.events) > 0 {
			e.signalLocked()
		}
	}
	return e.efd, nil
}

// TakeEvents moves up to len(out) waiting events into out without blocking,
// or, when none waits, waits for the first until ctx ends, and returns how
// many it took. It resets the EventFD when it leaves none waiting.
func (e *Engine) TakeEvents(ctx context.Context, out []Event) (int, error) {
	if len(out) == 0 {
		return 0, nil
	}
	n := 0
	e.evMu.Lock()
	e.clearLocked()
	e.evMu.Unlock()
	if len(e.events) == 0 {
		select {
		case ev, ok := <-e.events:
			if !ok {
				return 0, ErrClosed
			}
			out[0] = ev
			n = 1
		case <-ctx.Done():
			return 0, nil
		}
	}
more:
	for n < len(out) {
		select {
		case ev, ok := <-e.events:
			if !ok {
				return n, nil
			}
			out[n] = ev
			n++
		default:
			break more
		}
	}
	e.evMu.Lock()
	if len(e.events) > 0 {
		e.signalLocked() // left some: stay readable
	}
	e.evMu.Unlock()
	return n, nil
}

// emit queues an event without blocking; it reports false when the queue
// is full (the event is dropped and counted) or closed.
func (e *Engine) emit(ev Event) bool {
	e.evMu.Lock()
	defer e.evMu.Unlock()
	if e.evClosed {
		return false
	}
	select {
	case e.events <- ev:
		e.signalLocked()
		return true
	default:
		e.stats.eventsDropped.Add(1)
		return false
	}
}

func (e *Engine) signalLocked() {
	if e.efd >= 0 {
		var one [8]byte
		binary.NativeEndian.PutUint64(one[:], 1)
		_, _ = unix.Write(e.efd, one[:])
	}
}

func (e *Engine) clearLocked() {
	if e.efd >= 0 {
		var b [8]byte
		_, _ = unix.Read(e.efd, b[:])
	}
}

// closeEvents closes the channel and the event fd; emit is a no-op after.
func (e *Engine) closeEvents() {
	e.evMu.Lock()
	defer e.evMu.Unlock()
	if e.evClosed {
		return
	}
	e.evClosed = true
	close(e.events)
	if e.efd >= 0 {
		_ = unix.Close(e.efd)
		e.efd = -1
	}
}

// Notify sends a small message (at most MaxNotifyData bytes) about
// requestID to the segment's engine, which gets it as an EventNotify. It
// returns once the peer queued it, or ErrBusy when the peer's event queue is
// full (backpressure: try again later), or at ctx's deadline (DefaultTimeout
// when ctx has none). A notification sent after a WRITE completed arrives
// after that WRITE's bytes are visible at the peer: a WRITE completes only
// once the owner applied it.
//
// Over rdma the notification goes in-band, a SEND on the path's queue
// pairs posted once every work request of requestID on the segment's
// paths completed, so it arrives after the request's data even when the
// WRITEs are still in flight at the call. It returns once the peer's NIC
// took it; a peer whose event queue is full then drops it and counts it
// (it cannot answer ErrBusy in-band).
func (e *Engine) Notify(ctx context.Context, seg *Segment, requestID uint64, data []byte) error {
	if err := e.checkOpen(); err != nil {
		return err
	}
	if seg == nil || seg.e != e {
		return fmt.Errorf("notify: %w: segment is not open on this engine", ErrInvalidArg)
	}
	if len(data) > MaxNotifyData {
		return fmt.Errorf("notify: %w: %d bytes of data (at most %d)", ErrInvalidArg, len(data), MaxNotifyData)
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, e.opts.DefaultTimeout)
		defer cancel()
	}
	if ok, err := e.notifyInband(ctx, seg, requestID, data); ok {
		return err
	}
	body := control.Notification{RequestID: requestID, Data: data}.Encode()
	t, reply, err := e.plane.Request(ctx, seg.name, control.MsgNotify, body)
	if err != nil {
		return fmt.Errorf("notify %s: %w", seg.name, err)
	}
	if t != control.MsgNotifyAck || len(reply) != 1 {
		return fmt.Errorf("notify %s: %w: answered %s with %d bytes", seg.name, control.ErrMalformed, t, len(reply))
	}
	if reply[0] != notifyQueued {
		return fmt.Errorf("notify %s: %w", seg.name, ErrBusy)
	}
	return nil
}

// NOTIFY_ACK bodies: one byte.
const (
	notifyQueued = 0
	notifyBusy   = 1
)

// handleNotify queues a peer's notification as an event (on the plane's
// loop).
func (e *Engine) handleNotify(from string, body []byte) (control.MsgType, []byte) {
	n, err := control.DecodeNotification(body)
	if err != nil {
		e.controlMalformed("NOTIFY", from, err)
		return control.MsgError, []byte(err.Error())
	}
	if !e.emit(Event{Kind: EventNotify, Peer: from, RequestID: n.RequestID, Data: n.Data}) {
		return control.MsgNotifyAck, []byte{notifyBusy}
	}
	e.stats.notifications.Add(1)
	return control.MsgNotifyAck, []byte{notifyQueued}
}

// handleCanceled tells the application that an initiator gave up on a
// request (on the plane's loop).
//
// Only a CANCELED the sender could mean becomes an event: for a generation
// this engine issued for the request, from a peer that could have been
// touching it here, that is one this engine admitted for the request lately
// (accessCache), one holding a live grant of it, or one holding rkeys for it
// (rdma). Any other is dropped and counted (Stats.CanceledDropped): the
// sender never touched the request here, so there is nothing for the
// application to learn, and any peer may send CANCELED, which would
// otherwise fill the event queue and crowd out the events that matter.
// Dropping one costs nothing in safety: CANCELED is best effort (SAFETY.md
// promise 3), and the application reuses memory only after Abort or Fence.
// An initiator that gave up before its first slice was admitted, without a
// grant, is not heard: nothing of it reached this engine.
func (e *Engine) handleCanceled(from string, body []byte) (control.MsgType, []byte) {
	m, err := control.DecodeAbortMsg(body)
	if err != nil {
		e.controlMalformed("CANCELED", from, err)
		return 0, nil
	}
	if !e.mayHaveTouched(from, m.RequestID, m.Generation) {
		e.stats.canceledDropped.Add(1)
		e.peerWarn("canceled", from, "kvferry: dropped CANCELED of a request the peer never touched here",
			"peer", from, "request", m.RequestID, "generation", m.Generation)
		return 0, nil
	}
	e.emit(Event{Kind: EventCanceled, Peer: from, RequestID: m.RequestID, Generation: m.Generation})
	return 0, nil
}

// mayHaveTouched reports whether peer could have been touching request rid
// at generation gen in this engine's memory (see handleCanceled).
func (e *Engine) mayHaveTouched(peer string, rid uint64, gen uint32) bool {
	if gen > e.reqs.Generation(rid) {
		return false // a generation never issued
	}
	if e.admitted.seen(peer, rid) || e.reqs.Granted(peer, rid) {
		return true
	}
	return slices.Contains(e.holders(rid), peer)
}

// tellCanceled tells each owner of the tasks that ended TIMEOUT or CANCELED
// by their caller that we gave up on their request ids (SAFETY.md promise
// 3: best effort, once per owner and request id).
func (e *Engine) tellCanceled(tasks []*task) {
	type key struct {
		owner string
		rid   uint64
		gen   uint32
	}
	seen := map[key]bool{}
	for _, t := range tasks {
		st := TaskStatus(t.status.Load())
		if t.req.RequestID == 0 || t.req.Segment.self || (st != Timeout && st != Canceled) {
			continue
		}
		k := key{t.req.Segment.name, t.req.RequestID, t.req.Generation}
		if seen[k] {
			continue
		}
		seen[k] = true
		_ = e.plane.Send(k.owner, control.MsgCanceled, control.AbortMsg{RequestID: k.rid, Generation: k.gen}.Encode())
	}
}

// notified queues a notification that arrived in-band over rdma. Unlike one
// on the control plane it cannot be refused: when the event queue is full
// it is dropped and counted (Stats.EventsDropped).
func (e *Engine) notified(from string, requestID uint64, data []byte) {
	if e.emit(Event{Kind: EventNotify, Peer: from, RequestID: requestID, Data: data}) {
		e.stats.notifications.Add(1)
	}
}

// inbandNotifier is an endpoint that carries notifications on its own
// queue pairs (rdma).
type inbandNotifier interface {
	Quiet(ctx context.Context, requestID uint64) error
	Notify(ctx context.Context, requestID uint64, data []byte) error
}

// notifyInband sends a notification on seg's rdma paths, after every work
// request of requestID on any of them completed; ok is false when seg has
// no rdma path to carry it (the control plane then does).
func (e *Engine) notifyInband(ctx context.Context, seg *Segment, requestID uint64, data []byte) (ok bool, err error) {
	seg.mu.Lock()
	if seg.proto != "rdma" {
		seg.mu.Unlock()
		return false, nil
	}
	var eps []inbandNotifier
	for _, p := range seg.paths {
		if p == nil || p.ep.Dead() {
			continue
		}
		if n, ok := p.ep.(inbandNotifier); ok {
			eps = append(eps, n)
		}
	}
	seg.mu.Unlock()
	if len(eps) == 0 {
		return false, nil
	}
	for _, n := range eps {
		if err := n.Quiet(ctx, requestID); err != nil {
			return true, fmt.Errorf("notify %s: %w: %w", seg.name, ErrTimeout, err)
		}
	}
	if err := eps[0].Notify(ctx, requestID, data); err != nil {
		if ctx.Err() != nil {
			return true, fmt.Errorf("notify %s: %w: %w", seg.name, ErrTimeout, err)
		}
		return true, fmt.Errorf("notify %s: %w: %w", seg.name, ErrConnection, err)
	}
	return true, nil
}
