package engine

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"github.com/kvferry/kvferry/engine/control"
	"github.com/kvferry/kvferry/engine/fence"
	"github.com/kvferry/kvferry/engine/transport"
)

// fenceStamps returns, per request, the fence epoch its segment's owner
// told us last (our own for the local segment). A segment whose last
// transfer was refused as fenced first asks its owner (fenceResync).
func (e *Engine) fenceStamps(ctx context.Context, reqs []Request) []uint64 {
	stamps := make([]uint64, len(reqs))
	var seg *Segment
	var ep uint64
	for i := range reqs {
		s := reqs[i].Segment
		if s == nil || s.e != e {
			continue // plan refuses it
		}
		if s != seg {
			seg = s
			if s.self {
				ep = e.fences.Epoch()
			} else {
				s.fenceResync(ctx)
				ep = s.fences.Epoch()
			}
		}
		stamps[i] = ep
	}
	return stamps
}

// stampFences stamps each task, and its slices, with its request's stamp:
// the owner refuses them for ranges it fenced later.
func stampFences(tasks []*task, stamps []uint64) {
	for i, t := range tasks {
		t.epoch = stamps[i]
		for j := range t.slices {
			t.slices[j].Epoch = stamps[i]
		}
	}
}

// ownMemoryFenced returns the tasks whose local memory a fence of ours,
// published since ours was read, covers. Called with abortMu shared.
func (e *Engine) ownMemoryFenced(tasks []*task, ours uint64) []*task {
	if e.fences.Epoch() == ours {
		return nil
	}
	var hit []*task
	for _, t := range tasks {
		if e.fences.Check(ours, t.req.Local, t.req.Length) != nil {
			hit = append(hit, t)
		}
	}
	return hit
}

// learnFenceEpoch takes the owner's fence epoch from a PONG body (8 bytes;
// an older engine sends none).
func (s *Segment) learnFenceEpoch(body []byte) {
	if len(body) == 8 {
		s.fences.Learn(binary.LittleEndian.Uint64(body))
	}
}

// fenceResync asks the owner its fence epoch when a transfer of ours was
// refused as fenced: we missed its notice, or hold an epoch it never issued
// (an earlier incarnation's, or a forged notice's). Bounded by ctx and 2 s
// per question; on failure the next refusal asks again.
func (s *Segment) fenceResync(ctx context.Context) {
	if !s.fencedStale.Swap(false) {
		return
	}
	pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	s.resync(func() (uint64, bool) {
		typ, body, err := s.e.plane.Request(pctx, s.name, control.MsgPing, nil)
		if err != nil || typ != control.MsgPong || len(body) != 8 {
			return 0, false
		}
		return binary.LittleEndian.Uint64(body), true
	})
}

// resyncAsks bounds the questions of one resync.
const resyncAsks = 3

// resync settles what we know of the owner's epoch with its answers (ask).
// An answer below what we know means ours is not its own (a restart, or an
// epoch from a forged or stale notice): what we know starts afresh from the
// answer. But an honest answer can be overtaken by a FENCE notice the owner
// sent just after it, and forgetting that notice would stamp the next
// transfers below a fence they were planned after (the owner would refuse
// them). So a low answer is asked again first: the owner answers the next
// question after it sent every notice we hold of it, so an honest second
// answer is at least what we know; one still below it is taken for what it
// says. The last answer decides, by the same rule as a single one would: a
// retry never keeps an epoch the owner's answer does not cover.
func (s *Segment) resync(ask func() (uint64, bool)) {
	for i := 1; ; i++ {
		ep, ok := ask()
		if !ok {
			s.fencedStale.Store(true)
			return
		}
		if ep < s.fences.Epoch() && i < resyncAsks {
			continue
		}
		if ep < s.fences.Epoch() {
			s.fences.Reset()
		}
		s.fences.Learn(ep)
		return
	}
}

// handleFence takes an owner's FENCE (on the plane's loop, so it must not
// block): every segment open to that owner learns the fence, so transfers
// planned from now on carry its epoch and a transfer planned before that
// touches the ranges is never posted again (see task.recheck); then it
// acknowledges. The owner's own checks refuse those transfers whatever we
// do, so nothing here is needed for safety; it makes the next request's
// transfers pass, and cuts our rdma paths to the owner at once (the owner
// moved their QPs to the error state) instead of waiting for the NIC's
// retry timeout to find out.
func (e *Engine) handleFence(from string, body []byte) (control.MsgType, []byte) {
	m, err := control.DecodeFenceMsg(body)
	if err != nil {
		e.controlMalformed("FENCE", from, err)
		return 0, nil
	}
	e.stats.fencesReceived.Add(1)
	owner := e.abortOwner(from)
	segs := e.segmentsKnownAs(owner)
	rs := make([]fence.Range, len(m.Ranges))
	for i, r := range m.Ranges {
		rs[i] = fence.Range{Addr: r.Addr, Len: r.Len}
	}
	// Sorted here, not under abortMu, which every Submit takes.
	notice := []fence.Fenced{{Epoch: m.Epoch, Ranges: fence.Normalize(rs)}}
	var rdmaSegs []*Segment
	// Exclusive: a Submit stamps its tasks under abortMu shared, so each
	// is stamped either before the fence (and void where it touches the
	// ranges) or with its epoch.
	e.abortMu.Lock()
	for _, seg := range segs {
		if seg.fences.ApplyNormalized(m.Floor, notice) && seg.protocol() == "rdma" {
			rdmaSegs = append(rdmaSegs, seg)
		}
	}
	e.abortMu.Unlock()
	if len(rdmaSegs) > 0 && e.startBackground() {
		go func() {
			defer e.bg.Done()
			for _, seg := range rdmaSegs {
				seg.cutPaths(fmt.Errorf("%w: %w", transport.ErrConnection, errFenceCut))
			}
		}()
	}
	_ = e.plane.SendIfConnected(from, control.MsgFenceAck, control.FenceAck{Epoch: m.Epoch}.Encode())
	return 0, nil
}

// errFenceCut marks the slices of rdma paths we cut because their owner
// fenced memory and cut its side: they are posted again on new paths
// without spending a retry (see sliceDone), since no path failed; at most
// maxFenceReposts times, so an owner fencing without end cannot keep a
// transfer going for ever.
var errFenceCut = errors.New("the owner fenced memory and cut our QPs")

// maxFenceReposts bounds the posts again of one slice after fence cuts.
const maxFenceReposts = 64

// fenceVoid reports whether the task was planned before a fence, known to
// us, of a range it touches.
func (t *task) fenceVoid() bool {
	seg := t.req.Segment
	if seg.self {
		return seg.e.fences.Check(t.epoch, t.req.Remote, t.req.Length) != nil
	}
	return seg.fences.Void(t.epoch, t.req.Remote, t.req.Length)
}

// isFenceRefusal reports whether err is an owner's fence refusal.
func isFenceRefusal(err error) bool {
	return errors.Is(err, ErrRefused) && errors.Is(err, ErrFenced)
}
