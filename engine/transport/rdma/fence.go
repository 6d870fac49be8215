// The owner-side fence: an initiator's responder QPs go to the error
// state, after which its NIC executes none of the initiator's work.

package rdma

import (
	"context"
	"errors"
	"fmt"

	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/verbs"
)

// Fence implements transport.Fencer: every responder QP of initiator goes
// to the error state, after which its NIC executes none of the initiator's
// work; the QPs are destroyed. The initiator's work on other requests fails
// with a retryable error and is posted again on new QPs once it connects
// again, which AdmitInitiator gates.
func (t *Transport) Fence(ctx context.Context, initiator string) error {
	if !t.opts.Fence {
		return fmt.Errorf("rdma: %w: the owner-side fence is off", transport.ErrProtocol)
	}
	return t.cut(ctx, initiator)
}

// cut moves every responder QP of initiator to the error state and
// destroys them; the rkeys it holds are void from then on (see holders).
func (t *Transport) cut(ctx context.Context, initiator string) error {
	t.connMu.Lock()
	conns := t.conns[initiator]
	delete(t.conns, initiator)
	t.holds.forget(initiator)
	var errs []error
	var qps []*verbs.QP
	for _, rc := range conns {
		for _, q := range rc.qps {
			if err := q.ToError(); err != nil {
				errs = append(errs, err)
			}
			qps = append(qps, q)
		}
	}
	t.connMu.Unlock()
	t.stats.Fences.Add(1)
	for _, q := range qps {
		t.dropRecvs(q)
		_ = q.Destroy()
		t.stats.respQPs.Add(-1)
	}
	if len(errs) > 0 {
		// A QP that did not reach the error state may still execute.
		return fmt.Errorf("rdma: fence %s: %w", initiator, errors.Join(errs...))
	}
	return ctx.Err()
}

// Initiators returns the initiators with responder QPs connected to us:
// those a fence by memory range must cut, since the rkeys they hold for
// request id 0 reach whole registrations.
func (t *Transport) Initiators() []string {
	t.connMu.Lock()
	defer t.connMu.Unlock()
	names := make([]string, 0, len(t.conns))
	for n := range t.conns {
		names = append(names, n)
	}
	return names
}

// FenceEnabled reports whether Fence works (the engine takes the transport
// for a Fencer only then).
func (t *Transport) FenceEnabled() bool { return t.opts.Fence }

// CutPeer moves every responder QP of initiator to the error state and
// destroys them, whether or not the owner-side fence is on: the engine
// calls it for a peer whose key was taken off the allowlist, which must
// not touch our memory again. The peer can connect again only through the
// control plane, which refuses it.
func (t *Transport) CutPeer(ctx context.Context, initiator string) error {
	return t.cut(ctx, initiator)
}
