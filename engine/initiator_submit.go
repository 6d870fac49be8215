package engine

import (
	"context"
	"fmt"
	"slices"

	"github.com/kvferry/kvferry/engine/metrics"
	"github.com/kvferry/kvferry/engine/transport"
)

// Submit checks every request, then starts them all; when any request is
// invalid (bad op, zero length, memory not registered here or at the
// segment) none starts and the error names the request. Task i of the batch
// is the i-th request ever submitted to it. ctx bounds only what Submit
// itself waits for (a descriptor refresh, dialing a path); the tasks run on
// until Wait, Cancel or Close.
func (b *Batch) Submit(ctx context.Context, reqs []Request) error {
	e := b.e
	if err := e.checkOpen(); err != nil {
		return err
	}
	if len(reqs) == 0 {
		return fmt.Errorf("submit: %w: no requests", ErrInvalidArg)
	}
	b.mu.Lock()
	switch {
	case b.freed:
		b.mu.Unlock()
		return ErrBatchFreed
	case len(b.tasks)+len(reqs) > b.capacity:
		n := len(b.tasks)
		b.mu.Unlock()
		return fmt.Errorf("submit %d requests to a batch holding %d of %d: %w", len(reqs), n, b.capacity, ErrBatchFull)
	}
	b.mu.Unlock()

	// The fence epochs are read before anything else: a transfer is
	// planned under what its owner had told us when Submit was called, so
	// one that straddles a fence (planning, refreshing a descriptor) is
	// refused where the fence covers it. ours is our own epoch, for the
	// local memory the transfers read from or land in.
	stamps := e.fenceStamps(ctx, reqs)
	ours := e.fences.Epoch()
	tasks, sl, err := b.plan(ctx, reqs)
	if err != nil {
		return err // the slab is left to the GC: plan may have failed mid-way
	}
	// Before the tasks are listed anywhere a cancel, an ABORT or Close
	// can end them: finish reads both.
	start := int64(0)
	if e.metrics != nil || e.traceID != 0 {
		start = monoNow()
	}
	for _, t := range tasks {
		t.transport, t.start = t.req.Segment.transport.Load(), start
	}
	// Between the tombstone check and listing the tasks in the batch and
	// the task index an ABORT's handler must not run: it would miss them
	// (see handleAbort).
	var aborted []*task
	anyRID := slices.ContainsFunc(tasks, func(t *task) bool { return t.req.RequestID != 0 })
	// Shared with Fence: a fence of our own memory published before this
	// point is seen below; one published after finds these tasks listed
	// in the batch (Fence waits for abortMu between the two).
	e.abortMu.RLock()
	stampFences(tasks, stamps)
	ownFenced := e.ownMemoryFenced(tasks, ours)
	if anyRID {
		if e.tombOwners.Len() > 0 {
			for _, t := range tasks {
				if t.req.RequestID != 0 && e.segAbortedLocked(t.req.Segment, t.req.RequestID, t.req.Generation) {
					t.final.Store(int32(Aborted))
					aborted = append(aborted, t)
				}
			}
		}
	}
	b.mu.Lock()
	if b.freed || len(b.tasks)+len(tasks) > b.capacity {
		freed := b.freed
		b.mu.Unlock()
		e.abortMu.RUnlock()
		if freed {
			return ErrBatchFreed
		}
		return fmt.Errorf("submit: %w", ErrBatchFull) // a concurrent submit filled it
	}
	b.slabs = append(b.slabs, sl)
	if b.idleClosed {
		b.idle, b.idleClosed = make(chan struct{}), false
	}
	b.running.Add(int64(len(tasks)))
	// Counted before any can end (they are not listed yet), so that an
	// idle segment's paths are never closed under a task.
	now := monoNow()
	for _, t := range tasks {
		t.req.Segment.inflight.Add(1)
		t.req.Segment.lastUsed.Store(now)
	}
	if anyRID {
		// Listed before a cancel can find them in the batch (a cancel
		// would end them, and unlist them, first), and before abortMu is
		// let go: an ABORT's handler finds them here, or they saw its
		// tombstone above.
		e.tasks.add(tasks)
	}
	if len(b.tasks) == 0 {
		b.tasks = tasks[:len(tasks):len(tasks)] // a later append copies
	} else {
		b.tasks = append(b.tasks, tasks...)
	}
	if len(aborted) > 0 {
		b.tainted.Store(true)
	}
	b.mu.Unlock()
	e.abortMu.RUnlock()
	e.stats.tasksInFlight.Add(int64(len(tasks)))
	if e.traceID != 0 {
		for _, t := range tasks {
			if t.req.RequestID == e.traceID {
				e.log.Debug("kvferry: trace: transfer submitted", "request", t.req.RequestID, "segment", t.req.Segment.name,
					"transport", metrics.Transports[t.transport], "op", t.req.Op, "local", fmt.Sprintf("%#x", t.req.Local),
					"remote", fmt.Sprintf("%#x", t.req.Remote), "bytes", t.req.Length, "slices", len(t.slices), "fence_epoch", t.epoch)
			}
		}
	}
	if len(aborted) > 0 {
		// Their owner aborted the request: they end ABORTED unposted.
		for _, t := range aborted {
			t.abort()
		}
	}
	if len(ownFenced) > 0 {
		// Our own memory they read from or land in was fenced while they
		// were planned: they end CANCELED unposted, as Fence cancels
		// those it finds in flight.
		b.tainted.Store(true)
		cut := map[*pathRef][]*transport.Slice{}
		for _, t := range ownFenced {
			t.cancel(Canceled, cut)
		}
	}
	if len(aborted) > 0 || len(ownFenced) > 0 {
		tasks = slices.DeleteFunc(slices.Clone(tasks), func(t *task) bool { return t.final.Load() != 0 })
	}
	b.post(ctx, tasks, sl)
	return nil
}

// slab holds the task and slice records of one Submit. Records are reused
// (sparing the allocator and the GC on the per-request path) only when no
// transport can still hold a pointer into them: every slice went through the
// local transport, which drops a slice when it ends it, and none was
// canceled or retried.
type slab struct {
	tasks  []task
	slices []sliceT
	ptrs   []*task
	sptrs  []*transport.Slice
	local  bool
}

// getSlab returns records for n tasks of m slices, zeroed.
func (e *Engine) getSlab(n, m int) *slab {
	if v, _ := e.slabs.Get().(*slab); v != nil && cap(v.tasks) >= n && cap(v.slices) >= m {
		v.tasks, v.slices, v.ptrs, v.sptrs = v.tasks[:n], v.slices[:m], v.ptrs[:n], v.sptrs[:m]
		clear(v.tasks)
		clear(v.slices)
		v.local = false
		return v
	}
	return &slab{tasks: make([]task, n), slices: make([]sliceT, m), ptrs: make([]*task, n), sptrs: make([]*transport.Slice, m)}
}

func (e *Engine) putSlab(sl *slab) {
	if sl.local {
		clear(sl.ptrs)
		clear(sl.sptrs)
		e.slabs.Put(sl)
	}
}
