package engine

import (
	"fmt"

	"github.com/kvferry/kvferry/engine/transport"
)

// Admit checks a peer's (or our own local transport's) access against the
// registry (the key must be current and the range inside it) and against its
// request's state (not aborted, inside a grant when it has grants). The
// guard returned checks both again before each chunk. It implements
// transport.Owner.
func (e *Engine) Admit(a transport.Access) (transport.Target, error) {
	t, err := e.admit(a)
	if err != nil {
		if m := e.metrics; m != nil {
			m.refusals[refusalReason(err)].Add(1)
		}
	}
	if e.traceID != 0 && a.RequestID == e.traceID {
		e.log.Debug("kvferry: trace: peer access", "request", a.RequestID, "initiator", a.Initiator, "op", a.Op,
			"addr", fmt.Sprintf("%#x", a.Addr), "bytes", a.Length, "fence_epoch", a.Epoch, "direct", a.Direct, "refused", err)
	}
	return t, err
}

func (e *Engine) admit(a transport.Access) (transport.Target, error) {
	if a.Op != transport.Read && a.Op != transport.Write {
		return transport.Target{}, fmt.Errorf("%w: op %d", ErrInvalidArg, a.Op)
	}
	r, err := e.reg.Lookup(a.Key, a.Addr, a.Length)
	if err != nil {
		return transport.Target{}, err
	}
	var g transport.Guard = r
	if a.RequestID == 0 && a.Op == transport.Write {
		// For Abort's warning: this initiator writes without request ids,
		// which only a Fence of the ranges stops.
		e.admitted.note(a.Initiator, 0)
	}
	if a.RequestID != 0 {
		if !e.opts.Testing.UnsafeAbort {
			if g, err = e.reqs.Admit(&a, r); err != nil {
				return transport.Target{}, err
			}
		}
		// A CANCELED from this initiator for this request is now
		// believable (see handleCanceled).
		e.admitted.note(a.Initiator, a.RequestID)
	}
	if !e.opts.Testing.UnsafeFence {
		// Planned before a fence of a range it touches: refused. rdma
		// asks ahead of the bytes (Direct): the check is all there is
		// here, and the fence cuts the QPs its rkeys reach.
		if err := e.fences.Check(a.Epoch, a.Addr, a.Length); err != nil {
			e.stats.fenceRefused.Add(1)
			return transport.Target{}, err
		}
		if !a.Direct {
			g = e.fences.Guard(g, a.Epoch, a.Addr, a.Length)
		}
	}
	t := transport.Target{Guard: g, Mem: r.Bytes(a.Addr, a.Length)}
	if a.Direct {
		return t, nil
	}
	return e.stageTarget(t, r, &a)
}
