package engine

import (
	"errors"
	"fmt"

	"github.com/kvferry/kvferry/engine/control"
	"github.com/kvferry/kvferry/engine/internal/bounded"
	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/engine/transport/rdma"
)

// handleTransport serves a peer's rdma handshake request (on the plane's
// loop: the work is a few verbs calls) with the transport that serves them
// (transport.HandshakeServer).
func (e *Engine) handleTransport(from string, body []byte) (control.MsgType, []byte) {
	var hs transport.HandshakeServer
	for _, a := range e.servers() {
		if a.handshakes != nil {
			hs = a.handshakes
			break
		}
	}
	if hs == nil {
		return control.MsgError, []byte("no rdma transport here")
	}
	rep, err := hs.Serve(from, body)
	if err != nil {
		switch {
		case errors.Is(err, rdma.ErrFencePending):
			e.log.Debug("kvferry: rdma connect refused until the abort is acknowledged", "peer", from)
		case errors.Is(err, rdma.ErrMalformed):
			e.controlMalformed("TRANSPORT", from, err)
		default:
			// A cap reached or a verbs call failed here (a QP that
			// cannot reach the peer's address, say): the message was
			// sound, so it is not counted as malformed, and the line
			// says what failed.
			e.peerWarn("rdma handshake", from, "kvferry: rdma handshake refused", "peer", from, "transport", "rdma", "err", err)
		}
		return control.MsgError, []byte(err.Error())
	}
	return control.MsgTransportRep, rep
}

// admitInitiator refuses an initiator's new QPs while it owes the ACK of
// an abort whose fence cut its old ones, and sends those ABORTs again: an
// ACK lost after the abort's deadline must not lock it out for good.
func (e *Engine) admitInitiator(initiator string) error {
	var pend []abortKey
	e.fenceMu.Lock()
	// Most handshakes come from initiators that owe nothing: they must
	// not pay for a walk over every other initiator's debts.
	if e.fenceOwed[initiator] > 0 {
		for d := range e.fenceDebts.All() {
			if d.initiator == initiator {
				pend = append(pend, d.abort)
			}
		}
	}
	e.fenceMu.Unlock()
	if len(pend) == 0 {
		return nil
	}
	for _, k := range pend {
		_ = e.plane.Send(initiator, control.MsgAbort, control.AbortMsg{RequestID: k.rid, Generation: k.gen}.Encode())
	}
	return fmt.Errorf("%w: %d aborts of %s unacknowledged", rdma.ErrFencePending, len(pend), initiator)
}

// maxFenceDebts bounds the unacknowledged fences remembered. They are not
// forgotten to make room: an initiator whose debt was dropped could connect
// again without knowing of the abort. Past the bound, Abort reports not
// Safe instead of fencing.
const maxFenceDebts = 1 << 20

// fenceDebt is an abort whose rdma fence cut initiator's QPs, and which
// initiator has not acknowledged yet.
type fenceDebt struct {
	initiator string
	abort     abortKey
}

// newFenceDebts returns an empty set of fence debts holding at most n. No
// debt is ever evicted: only the initiator's ACK settles it (ackedFence),
// and a full set refuses new ones (noteFence).
func newFenceDebts(n int) *bounded.Set[fenceDebt, struct{}] {
	return bounded.New(bounded.Options[fenceDebt, struct{}]{
		Cap:    n,
		Policy: func(fenceDebt, struct{}, bounded.Reason) bounded.Verdict { return bounded.Keep },
	})
}

// noteFence records, before the fence, that initiator owes an ACK for k.
func (e *Engine) noteFence(initiator string, k abortKey) error {
	e.fenceMu.Lock()
	defer e.fenceMu.Unlock()
	d := fenceDebt{initiator, k}
	if e.fenceDebts.Has(d) {
		return nil
	}
	// Checked first: a Put into a full set would walk every debt, all
	// kept, before refusing.
	if n := e.fenceDebts.Len(); n >= maxFenceDebts || !e.fenceDebts.Put(d, struct{}{}) {
		return fmt.Errorf("%d rdma fences await their initiators' ACKs (at most %d): %w", n, maxFenceDebts, ErrBusy)
	}
	e.fenceOwed[initiator]++
	return nil
}

// ackedFence clears initiator's debt for k.
func (e *Engine) ackedFence(initiator string, k abortKey) {
	e.fenceMu.Lock()
	if _, owed := e.fenceDebts.Remove(fenceDebt{initiator, k}); owed {
		if e.fenceOwed[initiator]--; e.fenceOwed[initiator] <= 0 {
			delete(e.fenceOwed, initiator)
		}
	}
	e.fenceMu.Unlock()
}
