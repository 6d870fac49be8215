package engine

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/metrics"
	"github.com/kvferry/kvferry/engine/transport"
)

type task struct {
	b           *Batch
	req         Request
	status      atomic.Int32
	final       atomic.Int32 // status a cancel imposes, 0 if none
	cutting     atomic.Bool  // a cancel has taken the task's slices to cut
	epoch       uint64       // the owner's fence epoch it was planned under (see stampFences)
	remaining   atomic.Int32 // slices not ended
	transferred atomic.Uint64
	errMu       sync.Mutex
	err         error
	slices      []sliceT
	start       int64 // monoNow at Submit
	transport   int32 // index into metrics.Transports of the segment's transport at Submit

	// The engine's task index (taskIndex), under its shard's lock.
	idxPrev, idxNext *task
	indexed          bool
}

// sliceT is the engine's view of one slice.
type sliceT struct {
	transport.Slice
	t        *task
	attempts int
	reposts  int // posts again of the slice after its path ended before the owner read it
	// fenceReposts counts posts again after our rdma paths were cut for an
	// owner's fence (errFenceCut).
	fenceReposts int
	hint         uint32
	path         atomic.Pointer[pathRef]
	stage        *initStage // host staging of GPU memory on a path without DirectGPU
}

// sliceDone is every slice's Done callback: it retries a slice that failed
// on a broken path, unless its task was canceled meanwhile (a retry never
// routes around a cancel or an abort), and otherwise counts it.
func sliceDone(ts *transport.Slice, err error) {
	s := ts.Tag.(*sliceT)
	t := s.t
	e := t.b.e
	if err != nil && transport.Retryable(err) && t.final.Load() == 0 {
		// A slice the owner never read (it closed the idle path first) is
		// posted again without spending a retry: a path idled out by its
		// owner must not fail a transfer. maxReposts bounds an owner that
		// keeps doing it.
		unsent := errors.Is(err, transport.ErrUnsent) && s.reposts < maxReposts
		fenceCut := !unsent && errors.Is(err, errFenceCut) && s.fenceReposts < maxFenceReposts
		if (unsent || fenceCut || s.attempts < e.opts.MaxRetries) && e.startRetry() {
			switch {
			case unsent:
				s.reposts++
			case fenceCut:
				s.fenceReposts++
			default:
				s.attempts++
				e.stats.retries.Add(1)
			}
			t.b.tainted.Store(true)
			ts.Reset() // Queued again: a cancel from here on takes it
			go s.retry()
			return
		}
	}
	t.sliceEnded(s, err)
}

// maxReposts bounds the posts again of one slice that its path's owner did
// not read (transport.ErrUnsent); they do not count against MaxRetries.
const maxReposts = 8

// startRetry counts a retry goroutine in, unless the engine is closing;
// Close waits for those counted.
func (e *Engine) startRetry() bool { return e.startIn(&e.retrying) }

// retry posts the slice again on another path.
func (s *sliceT) retry() {
	t := s.t
	defer t.b.e.retrying.Done()
	if t.final.Load() != 0 {
		if s.TryCancel() {
			t.sliceEnded(s, transport.ErrCanceled)
		}
		return
	}
	if s.LocalReg.Dead() {
		s.Finish(fmt.Errorf("local memory [%#x, +%d): %w", memory.AddrOf(s.Local), len(s.Local), memory.ErrUnregistered))
		return
	}
	if t.fenceVoid() {
		// Its owner fenced a range of it after it was planned: posting it
		// again would route around the fence (SAFETY.md promise 6).
		s.Finish(fmt.Errorf("%w: %w: planned at fence epoch %d", transport.ErrRefused, transport.ErrFenced, t.epoch))
		return
	}
	seg := t.req.Segment
	ctx, cancel := context.WithTimeout(context.Background(), pathTimeout)
	defer cancel()
	stop := context.AfterFunc(t.b.e.closeCtx, cancel)
	defer stop()
	ref, err := seg.path(ctx, s.hint+uint32(s.attempts))
	if err != nil {
		s.Finish(err)
		return
	}
	s.path.Store(ref)
	t.b.e.postStaged(ref, []*transport.Slice{&s.Slice})
}

func (t *task) sliceEnded(s *sliceT, err error) {
	err = t.b.e.unstage(s, err)
	if err == nil {
		t.transferred.Add(uint64(len(s.Local)))
	} else {
		t.errMu.Lock()
		if t.err == nil {
			t.err = err
		}
		t.errMu.Unlock()
	}
	if t.remaining.Add(-1) == 0 {
		t.finish()
	}
}

// finish runs once, when the last slice ended.
func (t *task) finish() {
	e := t.b.e
	st := Completed
	t.errMu.Lock()
	if f := TaskStatus(t.final.Load()); f != 0 {
		st = f
		t.err = fmt.Errorf("%s %s of [%#x, +%d) at %s over %s: %w", st, t.req.Op, t.req.Remote, t.req.Length, t.req.Segment.name, t.transportName(), cancelErr(st))
	} else if t.err != nil && isAbortRefusal(t.err) {
		st = Aborted
		t.err = fmt.Errorf("%s of [%#x, +%d) at %s over %s: %w", t.req.Op, t.req.Remote, t.req.Length, t.req.Segment.name, t.transportName(), t.err)
	} else if t.err != nil {
		st = Failed
		if errors.Is(t.err, ErrRefused) && (errors.Is(t.err, ErrStaleKey) || errors.Is(t.err, ErrFenced)) {
			// Before the next plan: a stale key refreshes the
			// descriptor; a fence we were not told of (or a stamp we
			// hold that the owner never issued) asks the owner its
			// epoch, which a descriptor from a Resolver's store may lag.
			if errors.Is(t.err, ErrFenced) {
				t.req.Segment.fencedStale.Store(true)
			} else {
				t.req.Segment.stale.Store(true)
			}
		}
		t.err = fmt.Errorf("%s of [%#x, +%d) at %s over %s: %w: %w", t.req.Op, t.req.Remote, t.req.Length, t.req.Segment.name, t.transportName(), ErrTransferFailed, t.err)
	}
	t.errMu.Unlock()
	if st == Aborted {
		e.stats.tasksAborted.Add(1)
		if TaskStatus(t.final.Load()) != Aborted {
			// Learned from the owner's refusal, not from its ABORT.
			e.learnAbort(t.req.Segment.id(), t.req.RequestID, t.req.Generation)
		}
	}
	switch st {
	case Completed:
		e.stats.tasksCompleted.Add(1)
		if t.req.Op == Write {
			e.stats.bytesWritten.Add(t.req.Length)
		} else {
			e.stats.bytesRead.Add(t.req.Length)
		}
	case Canceled:
		e.stats.tasksCanceled.Add(1)
	default:
		e.stats.tasksFailed.Add(1)
	}
	if m := e.metrics; m != nil {
		m.taskEnded(t, st)
	}
	if e.traceID != 0 && t.req.RequestID == e.traceID {
		e.log.Debug("kvferry: trace: transfer ended", "request", t.req.RequestID, "segment", t.req.Segment.name,
			"transport", metrics.Transports[t.transport], "op", t.req.Op, "bytes", t.req.Length, "status", st,
			"took", time.Duration(monoNow()-t.start), "err", t.err)
	}
	t.status.Store(int32(st))
	// Unlisted once final, and before the batch can count it out: a freed
	// batch's records may be reused.
	e.tasks.remove(t)
	e.stats.tasksInFlight.Add(-1)
	t.req.Segment.inflight.Add(-1)
	if b := t.b; b.running.Add(-1) == 0 {
		b.mu.Lock()
		if b.running.Load() == 0 && !b.idleClosed {
			close(b.idle)
			b.idleClosed = true
		}
		b.mu.Unlock()
	}
}

// transportName names the transport the task's segment had at Submit.
func (t *task) transportName() string { return metrics.Transports[t.transport] }

func cancelErr(st TaskStatus) error {
	switch st {
	case Timeout:
		return ErrTimeout
	case Aborted:
		return ErrAborted
	}
	return ErrCanceled
}

// recheck is every slice's Recheck: a transport posting a slice again on
// its own first asks whether its task was aborted or canceled meanwhile.
func (t *task) recheck(*transport.Slice) error {
	if f := TaskStatus(t.final.Load()); f != 0 {
		return fmt.Errorf("%w: task ended %s", transport.ErrCanceled, f)
	}
	e := t.b.e
	e.abortMu.RLock()
	aborted := e.segAbortedLocked(t.req.Segment, t.req.RequestID, t.req.Generation)
	e.abortMu.RUnlock()
	if aborted {
		return fmt.Errorf("%w: %w: request %d", transport.ErrRefused, transport.ErrAborted, t.req.RequestID)
	}
	if t.fenceVoid() {
		return fmt.Errorf("%w: %w: planned at fence epoch %d", transport.ErrRefused, transport.ErrFenced, t.epoch)
	}
	return nil
}

// cancel ends every task still in flight with status st. It returns once
// none of their slices touches memory any more: queued and on-the-wire
// slices are dropped, slices a path is copying right now are stopped by
// the path (added to cut: one by one where the path can, else by cutting
// the path, whose other slices are retried elsewhere), and slices being
// staged end after the chunk being copied.
func (t *task) cancel(st TaskStatus, cut map[*pathRef][]*transport.Slice) {
	if TaskStatus(t.status.Load()).Final() {
		return
	}
	// The first status imposed wins; an owner's ABORT (task.abort) imposes
	// one without cutting the slices on the wire, leaving them to the
	// drain, so a later cancel still cuts them: the caller's own bound
	// (deadline, Cancel) must not wait for the drain's.
	t.final.CompareAndSwap(0, int32(st))
	if !t.cutting.CompareAndSwap(false, true) {
		return
	}
	t.b.tainted.Store(true)
	for i := range t.slices {
		s := &t.slices[i]
		for {
			if s.TryCancel() {
				t.sliceEnded(s, transport.ErrCanceled)
				break
			}
			st := s.State()
			if st == transport.StateActive || st == transport.StateReceiving {
				if ref := s.path.Load(); ref != nil {
					cut[ref] = append(cut[ref], &s.Slice)
				}
				break
			}
			if st == transport.StateDone || st == transport.StateCanceled || st == transport.StateStaging {
				break // the stager ends a staging slice after its chunk
			}
			// Queued or Sent again (it moved on between the two looks): retry.
		}
	}
}

// cancelBound is how long a cancel waits for paths to confirm that they
// stopped touching the memory of the slices it cut (a NIC completing or
// flushing its work, a staging copy ending) before it reports
// ErrMemoryInUse.
const cancelBound = 6 * time.Second

// cancel cancels every task in flight and waits until they are final, or
// reports ErrMemoryInUse after cancelBound.
func (b *Batch) cancel(st TaskStatus, reason error) error {
	tasks, idle := b.cancelSnapshot()
	cut := map[*pathRef][]*transport.Slice{}
	for _, t := range tasks {
		t.cancel(st, cut)
	}
	ctx, stop := context.WithTimeout(context.Background(), cancelBound)
	defer stop()
	inUse := stopCut(ctx, cut, reason)
	select {
	case <-idle:
	case <-ctx.Done():
		if inUse == nil {
			inUse = fmt.Errorf("%w: tasks still in flight %v after the cancel", ErrMemoryInUse, cancelBound)
		}
		b.e.log.Error("kvferry: cancel could not confirm the engine stopped touching the memory", "err", inUse)
		return fmt.Errorf("cancel: %w", inUse)
	}
	if st != Aborted && !errors.Is(reason, ErrClosed) {
		b.e.tellCanceled(tasks)
	}
	return nil
}

// stopCut stops the slices task.cancel found being copied, path by path at
// once: one by one where the path can (SliceCanceler), else by aborting the
// path, whose other slices are retried elsewhere. It returns the error of a
// path that could not confirm by ctx's deadline that it stopped touching
// their memory, nil otherwise.
func stopCut(ctx context.Context, cut map[*pathRef][]*transport.Slice, reason error) error {
	var wg sync.WaitGroup
	var errMu sync.Mutex
	var inUse error
	for ref, ss := range cut {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if c, ok := ref.ep.(transport.SliceCanceler); ok {
				if err := c.Cancel(ctx, ss); err != nil {
					errMu.Lock()
					inUse = err
					errMu.Unlock()
				}
				return
			}
			ref.ep.Abort(fmt.Errorf("%w: %w", transport.ErrCanceled, reason))
		}()
	}
	wg.Wait()
	return inUse
}

// cancelSnapshot returns the tasks to cancel and the channel that closes
// when they are final. The batch is tainted before the snapshot is taken: a
// Free from then on keeps its records out of the pool, so the snapshot never
// points at records reused by another batch.
func (b *Batch) cancelSnapshot() ([]*task, chan struct{}) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.tainted.Store(true)
	return append([]*task(nil), b.tasks...), b.idle
}
