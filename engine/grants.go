package engine

import (
	"context"
	"fmt"
	"net"
	"slices"

	"github.com/kvferry/kvferry/engine/requests"
)

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
	for _, a := range e.servers() {
		if a.tracker == nil || a.fencer == nil || !slices.Contains(a.tracker.Holders(g.RequestID), g.Initiator) {
			continue
		}
		if a.fence() == nil {
			return fmt.Errorf("revoke grant %d: %s holds rkeys and the rdma fence is off: %w", grantID, g.Initiator, ErrUnsupported)
		}
		if err := a.fencer.Fence(ctx, g.Initiator); err != nil {
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
