package engine

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/kvferry/kvferry/engine/control"
	"github.com/kvferry/kvferry/engine/fence"
	"github.com/kvferry/kvferry/engine/transport"
)

// FenceRange is a range of this engine's registered memory to fence.
type FenceRange = fence.Range

// MaxFenceRanges caps the ranges of one Fence (a FENCE notice carries them
// all).
const MaxFenceRanges = fence.MaxRanges

// ErrFenced: a transfer touched a range its owner fenced after the transfer
// was planned; it ends FAILED and is never retried (SAFETY.md promise 6).
var ErrFenced = transport.ErrFenced

// FenceResult is the outcome of Engine.Fence.
type FenceResult struct {
	// Safe: no transfer planned before the call, whatever its request id
	// (0 included) and initiator, can write into or read from any byte of
	// the ranges any more. The memory may be handed to the next request
	// at once.
	Safe bool
	// Reason says why the fence is not Safe; nil when it is.
	Reason error
	// Epoch is the fence's epoch: transfers planned from now on carry it
	// (or a later one) and pass.
	Epoch uint64
	// Told lists the peers the fence notice went to (those that fetched
	// this engine's descriptor lately and still hold a control connection
	// to it, and rdma initiators), Acked those
	// that acknowledged it within FenceGrace: their next transfers are
	// planned under the new epoch. A peer that did not acknowledge in
	// time (paused, partitioned, gone) is fenced all the same; it learns
	// the epoch from the notice queued on its connection, its next
	// heartbeat's answer, or the refusal of its first stale transfer.
	Told, Acked []string
	// Cut lists the rdma initiators whose responder QPs were moved to the
	// error state (their work in flight is posted again on new QPs).
	Cut []string
}

// maxPlanners bounds the peers remembered as planners (they fetched our
// descriptor): past it the oldest is forgotten, which costs it only the
// fence notice (its first stale transfer is refused, and it refreshes).
const maxPlanners = 4096

// pendingFence is an owner's fence waiting for FENCE_ACKs.
type pendingFence struct {
	epoch uint64
	mu    sync.Mutex
	wait  map[string]bool
	acked []string
	done  chan struct{} // closed when wait is empty
}

// Fence fences ranges of this engine's registered memory, as their owner:
// from now on every access to them planned before the call is refused,
// whatever its request id (0 included) and initiator, and Fence returns
// once no copy of such an access is in progress (tcp, local) and no NIC can
// execute one (rdma: the responder QPs of every initiator go to the error
// state; their other work is posted again on new QPs, whose rkeys the owner
// admits again under the new epoch). Transfers planned after the call pass.
// The peers that may plan transfers to us are told (FENCE) and Fence waits
// up to Options.FenceGrace for their acknowledgement, so that in the normal
// flow (the application tells a writer about the pages only after Fence
// returned) the next request's transfers into the ranges never fail.
//
// Each range must lie in registered memory (one or several adjacent
// registrations). The result is Safe only when no transfer planned before
// can touch the ranges any more; otherwise it says why, by ctx's deadline
// (DefaultTimeout when ctx has none). The error is non-nil only for invalid
// arguments or a closed engine.
func (e *Engine) Fence(ctx context.Context, ranges []FenceRange) (FenceResult, error) {
	start := time.Now()
	res, err := e.fenceRanges(ctx, ranges)
	if err == nil && e.metrics != nil {
		observeSafe(e.metrics.fence, start, res.Safe)
	}
	return res, err
}

func (e *Engine) fenceRanges(ctx context.Context, ranges []FenceRange) (FenceResult, error) {
	if err := e.checkOpen(); err != nil {
		return FenceResult{}, err
	}
	if len(ranges) == 0 || len(ranges) > MaxFenceRanges {
		return FenceResult{}, fmt.Errorf("fence: %w: %d ranges (1 to %d)", ErrInvalidArg, len(ranges), MaxFenceRanges)
	}
	rs := make([]fence.Range, len(ranges))
	for i, r := range ranges {
		if r.Len == 0 || r.Addr+r.Len < r.Addr {
			return FenceResult{}, fmt.Errorf("fence: %w: range %d [%#x, +%d) is empty or wraps", ErrInvalidArg, i, r.Addr, r.Len)
		}
		if err := e.registeredSpan(r.Addr, r.Len); err != nil {
			return FenceResult{}, fmt.Errorf("fence: range %d [%#x, +%d): %w", i, r.Addr, r.Len, err)
		}
		rs[i] = r
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, e.opts.DefaultTimeout)
		defer cancel()
	}
	if e.opts.Testing.UnsafeFence {
		// Protection off, for the tests that show what it prevents.
		e.stats.fencesSafe.Add(1)
		return FenceResult{Safe: true}, nil
	}
	rs = fence.Normalize(rs)
	ep, inProgress, err := e.fences.Fence(rs)
	if err != nil {
		return FenceResult{}, fmt.Errorf("fence: %w: %w", ErrInvalidArg, err)
	}
	res := FenceResult{Epoch: ep}
	var reason error

	// rdma first: the NIC moves those bytes without our code, and rkeys
	// handed out before the new epoch reach the whole registration. After
	// the cut, an initiator's work reaches us only on QPs connected later,
	// with rkeys admitted under the epoch just published.
	for _, a := range e.servers() {
		if a.initiators == nil {
			continue
		}
		inits := a.initiators.Initiators()
		f := a.fence()
		if len(inits) > 0 && f == nil {
			if reason == nil {
				reason = fmt.Errorf("%s initiators %v may hold rkeys and the %s fence is off (KVFERRY_RDMA_FENCE=0): %w", a.t.Name(), inits, a.t.Name(), ErrUnsupported)
			}
			continue
		}
		for _, name := range inits {
			if err := f.Fence(ctx, name); err != nil && reason == nil {
				reason = fmt.Errorf("%s fence of %s: %w", a.t.Name(), name, err)
			}
			res.Cut = append(res.Cut, name)
		}
	}

	// Tell the planners, so that their next transfers carry the epoch.
	// Only those holding a control connection to us now are waited for:
	// one that fetched our descriptor and left must not cost every fence
	// its grace.
	floor := e.fences.Floor()
	var names []string
	for _, n := range e.plannerNames(res.Cut) {
		if e.plane.HasInbound(n) {
			names = append(names, n)
		}
	}
	res.Told = names
	var msg []byte
	pf := &pendingFence{epoch: ep, wait: make(map[string]bool, len(names)), done: make(chan struct{})}
	for _, n := range names {
		pf.wait[n] = true
	}
	if len(names) == 0 {
		close(pf.done)
	} else {
		cr := make([]control.FenceRange, len(rs))
		for i, r := range rs {
			cr[i] = control.FenceRange{Addr: r.Addr, Len: r.Len}
		}
		msg = control.FenceMsg{Epoch: ep, Floor: floor, Ranges: cr}.Encode()
		e.rememberFence(pf)
		// On a connection that exists; resent below while Fence waits
		// (a full send queue drops it), never after: a planner that
		// missed it learns the epoch from its next heartbeat or the
		// refusal of its first stale transfer, and no goroutine is left
		// behind per fence for a paused one.
		for _, n := range names {
			_ = e.plane.SendIfConnected(n, control.MsgFence, msg)
		}
	}

	// This engine's own transfers whose local memory lies in the ranges
	// (a READ landing in them, a WRITE reading from them) were planned
	// before too: they are canceled, and waited for. A Submit between
	// its stamp and listing its tasks holds abortMu shared: once we had
	// it, each such Submit either listed its tasks (found below) or will
	// see this fence (ownMemoryFenced).
	e.abortMu.Lock()
	e.abortMu.Unlock() //nolint:staticcheck // an empty critical section: a barrier
	if err := e.cancelOwnTasks(ctx, rs); err != nil && reason == nil {
		reason = err
	}
	if inProgress != nil && reason == nil {
		select {
		case <-inProgress:
		case <-ctx.Done():
			reason = fmt.Errorf("copies into or out of the ranges still in progress at the deadline: %w", ErrTimeout)
		}
	}
	if reason == nil && len(names) > 0 {
		grace := time.NewTimer(e.opts.FenceGrace)
		interval := abortResendFirst
		resend := time.NewTimer(interval)
	wait:
		for {
			select {
			case <-pf.done:
				break wait
			case <-grace.C:
				break wait
			case <-ctx.Done():
				break wait
			case <-resend.C:
				for _, n := range awaited(&pf.mu, pf.wait) {
					_ = e.plane.SendIfConnected(n, control.MsgFence, msg)
				}
				interval = min(2*interval, abortResendMax)
				resend.Reset(interval)
			}
		}
		grace.Stop()
		resend.Stop()
	}
	pf.mu.Lock()
	res.Acked = append([]string(nil), pf.acked...)
	pf.mu.Unlock()
	if reason != nil {
		reason = fmt.Errorf("fence of %d ranges: not safe: %w", len(ranges), reason)
	}
	res.Reason = e.countSafe(&e.stats.fencesSafe, &e.stats.fencesNotSafe, "fence", reason, "epoch", ep)
	res.Safe = res.Reason == nil
	return res, nil
}

// cancelOwnTasks cancels this engine's transfers in flight whose local
// memory meets the (normalized) ranges, as Batch.Cancel does, and returns
// once they no longer touch it, or an error wrapping ErrMemoryInUse by
// ctx's deadline.
func (e *Engine) cancelOwnTasks(ctx context.Context, ranges []fence.Range) error {
	e.liveMu.Lock()
	batches := make([]*Batch, 0, len(e.live))
	for b := range e.live {
		batches = append(batches, b)
	}
	e.liveMu.Unlock()
	var tasks []*task
	for _, b := range batches {
		b.mu.Lock()
		hit := false
		for _, t := range b.tasks {
			if !TaskStatus(t.status.Load()).Final() && fence.Overlaps(ranges, t.req.Local, t.req.Length) {
				tasks = append(tasks, t)
				hit = true
			}
		}
		if hit {
			// As Batch.Cancel: a Free from now on keeps its records out
			// of the pool, so these never point at reused ones.
			b.tainted.Store(true)
		}
		b.mu.Unlock()
	}
	if len(tasks) == 0 {
		return nil
	}
	cut := map[*pathRef][]*transport.Slice{}
	for _, t := range tasks {
		t.cancel(Canceled, cut)
	}
	_ = stopCut(ctx, cut, errors.New("this engine fenced their memory")) // waitFinal below says whether it worked
	deadline, _ := ctx.Deadline()
	if !e.waitFinal(tasks, deadline) {
		return fmt.Errorf("%w: %d of this engine's own transfers into the ranges still in flight at the deadline", ErrMemoryInUse, len(tasks))
	}
	e.tellCanceled(tasks)
	return nil
}

// registeredSpan checks that [addr, addr+n) lies in registered memory,
// across adjacent registrations.
func (e *Engine) registeredSpan(addr, n uint64) error {
	for n > 0 {
		r, err := e.reg.Find(addr, 1)
		if err != nil {
			return err
		}
		step := min(n, r.End()-addr)
		addr, n = addr+step, n-step
	}
	return nil
}

// notePlanner records that peer fetched our descriptor: it may plan
// transfers to us, so fences tell it. Called before the descriptor's fence
// epoch is read, so a fence either is in the descriptor or tells peer.
func (e *Engine) notePlanner(peer string) {
	now := time.Now()
	e.planMu.Lock()
	defer e.planMu.Unlock()
	if _, ok := e.planners[peer]; !ok && len(e.planners) >= maxPlanners {
		oldest, at := "", now
		for n, t := range e.planners {
			if t.Before(at) {
				oldest, at = n, t
			}
		}
		delete(e.planners, oldest)
	}
	e.planners[peer] = now
}

// plannerNames returns the planners, and extra names not among them.
func (e *Engine) plannerNames(extra []string) []string {
	e.planMu.Lock()
	names := make([]string, 0, len(e.planners)+len(extra))
	for n := range e.planners {
		names = append(names, n)
	}
	for _, n := range extra {
		if _, ok := e.planners[n]; !ok {
			names = append(names, n)
		}
	}
	e.planMu.Unlock()
	return names
}

// maxRememberedFences bounds the fences whose FENCE_ACKs are still matched
// after Fence returned (a paused planner answers when it resumes).
const maxRememberedFences = 1024

// rememberFence records pf for its FENCE_ACKs, forgetting the oldest past
// maxRememberedFences.
func (e *Engine) rememberFence(pf *pendingFence) {
	e.pendMu.Lock()
	defer e.pendMu.Unlock()
	e.pendFences[pf.epoch] = pf
	e.fenceOrder = append(e.fenceOrder, pf.epoch)
	for len(e.fenceOrder) > maxRememberedFences {
		delete(e.pendFences, e.fenceOrder[0])
		e.fenceOrder = e.fenceOrder[1:]
	}
}

// handleFenceAck takes a planner's FENCE_ACK (on the plane's loop). Safety
// never rests on it: it only tells Fence that the planner's next transfers
// carry the new epoch.
func (e *Engine) handleFenceAck(from string, body []byte) (control.MsgType, []byte) {
	m, err := control.DecodeFenceAck(body)
	if err != nil {
		e.controlMalformed("FENCE_ACK", from, err)
		return 0, nil
	}
	e.pendMu.Lock()
	pf := e.pendFences[m.Epoch]
	e.pendMu.Unlock()
	if pf == nil {
		e.stats.fenceAcksUnmatched.Add(1)
		return 0, nil
	}
	pf.mu.Lock()
	if !pf.wait[from] {
		pf.mu.Unlock()
		e.stats.fenceAcksUnmatched.Add(1)
		return 0, nil
	}
	delete(pf.wait, from)
	pf.acked = append(pf.acked, from)
	if len(pf.wait) == 0 {
		close(pf.done)
	}
	pf.mu.Unlock()
	e.stats.fenceAcks.Add(1)
	return 0, nil
}

// FenceEpoch implements transport.FenceEpocher: the epoch of the last fence.
func (e *Engine) FenceEpoch() uint64 { return e.fences.Epoch() }
