package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
)

// TaskStatus is the state of one request of a batch.
type TaskStatus int32

// Task states. WAITING and PENDING are in flight; the others are final.
const (
	Waiting   TaskStatus = 0 // accepted, not yet posted
	Pending   TaskStatus = 1 // slices posted, not all ended
	Completed TaskStatus = 2 // every byte landed (a WRITE was applied by the owner)
	Failed    TaskStatus = 3 // see TaskResult.Err
	Timeout   TaskStatus = 4 // the deadline passed; the engine no longer touches its memory
	Canceled  TaskStatus = 5 // canceled by the caller or Close; likewise
	Aborted   TaskStatus = 6 // the owner aborted its request id
)

func (s TaskStatus) String() string {
	switch s {
	case Waiting:
		return "WAITING"
	case Pending:
		return "PENDING"
	case Completed:
		return "COMPLETED"
	case Failed:
		return "FAILED"
	case Timeout:
		return "TIMEOUT"
	case Canceled:
		return "CANCELED"
	case Aborted:
		return "ABORTED"
	}
	return fmt.Sprintf("TaskStatus(%d)", int32(s))
}

// Final reports whether the status is final.
func (s TaskStatus) Final() bool { return s >= Completed }

// Request is one transfer: Length bytes between our registered memory at
// Local and the segment's registered memory at Remote.
type Request struct {
	Op        Op
	Local     uint64 // address in our registered memory
	Segment   *Segment
	Remote    uint64 // address in the segment's registered memory
	Length    uint64
	RequestID uint64 // the application's request id (0: none); aborts act on it
	// Generation is the request id's generation at the owner: 0 until the
	// owner aborts the request id, then AbortResult.Generation (or a
	// Grant's Generation); accesses below the owner's are refused.
	Generation uint32
	// GrantID names the owner's grant the access falls under; 0 lets the
	// owner find it by initiator and range.
	GrantID uint64
}

// TaskResult is the outcome of one request.
type TaskResult struct {
	Status      TaskStatus
	Transferred uint64 // bytes confirmed moved; a lower bound for failed tasks
	Err         error  // why it did not complete; nil when COMPLETED
}

// Batch is a set of requests submitted together and waited on together.
// Its methods are safe for concurrent use.
type Batch struct {
	e        *Engine
	capacity int

	mu         sync.Mutex
	tasks      []*task
	freed      bool
	running    atomic.Int64  // tasks not final
	idle       chan struct{} // closed once running reaches 0
	idleClosed bool
	slabs      []*slab     // task and slice records, reused after Free when safe
	tainted    atomic.Bool // a cancel or retry happened: a path may still hold a slice
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

// AllocateBatch returns a batch for up to capacity requests.
func (e *Engine) AllocateBatch(capacity int) (*Batch, error) {
	if err := e.checkOpen(); err != nil {
		return nil, err
	}
	if capacity <= 0 {
		return nil, fmt.Errorf("allocate batch: %w: capacity %d", ErrInvalidArg, capacity)
	}
	b := &Batch{e: e, capacity: capacity, idle: make(chan struct{}), idleClosed: true}
	close(b.idle)
	e.liveMu.Lock()
	e.live[b] = struct{}{}
	e.liveMu.Unlock()
	return b, nil
}

// Len returns the number of requests submitted so far.
func (b *Batch) Len() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.tasks)
}

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
		if len(e.tombs) > 0 {
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

// plan validates the requests and cuts them into slices.
func (b *Batch) plan(ctx context.Context, reqs []Request) ([]*task, *slab, error) {
	e := b.e
	slice := uint64(e.opts.SliceSize)
	nslices := 0
	for i := range reqs {
		r := &reqs[i]
		if r.Op != Read && r.Op != Write {
			return nil, nil, fmt.Errorf("request %d: %w: op %d", i, ErrInvalidArg, r.Op)
		}
		if r.Length == 0 || r.Local+r.Length < r.Local || r.Remote+r.Length < r.Remote {
			return nil, nil, fmt.Errorf("request %d: %w: length %d at local %#x, remote %#x", i, ErrInvalidArg, r.Length, r.Local, r.Remote)
		}
		if r.Segment == nil || r.Segment.e != e {
			return nil, nil, fmt.Errorf("request %d: %w: segment is not open on this engine", i, ErrInvalidArg)
		}
		// Before anything is allocated for it: the slice records below
		// are bounded by memory really registered here, so an absurd
		// length is an error, never an allocation the process dies of.
		if _, err := e.reg.Find(r.Local, r.Length); err != nil {
			return nil, nil, fmt.Errorf("request %d: local memory: %w", i, err)
		}
		nslices += int((r.Length + slice - 1) / slice)
	}
	sl := e.getSlab(len(reqs), nslices)
	tasks, slab, out := sl.tasks, sl.slices, sl.ptrs
	var refreshed map[*Segment]bool
	local := true
	for i := range reqs {
		r := reqs[i]
		t := &tasks[i]
		t.b, t.req = b, r
		out[i] = t
		lreg, err := e.reg.Find(r.Local, r.Length)
		if err != nil {
			return nil, nil, fmt.Errorf("request %d: local memory: %w", i, err)
		}
		var key BufferKey
		if r.Segment.self {
			reg, err := e.reg.Find(r.Remote, r.Length)
			if err != nil {
				return nil, nil, fmt.Errorf("request %d: remote memory at %s: %w", i, r.Segment.name, err)
			}
			key = reg.Key
		} else {
			local = false
			if refreshed == nil {
				refreshed = map[*Segment]bool{}
			}
			done := refreshed[r.Segment]
			key, err = r.Segment.resolve(ctx, r.Remote, r.Length, &done)
			refreshed[r.Segment] = done
			if err != nil {
				return nil, nil, fmt.Errorf("request %d: %w", i, err)
			}
		}
		n := int((r.Length + slice - 1) / slice)
		t.slices, slab = slab[:n:n], slab[n:]
		t.remaining.Store(int32(n))
		recheck := t.recheck
		for j := range t.slices {
			off := uint64(j) * slice
			ln := min(slice, r.Length-off)
			s := &t.slices[j]
			s.t = t
			s.Op, s.Key, s.Remote, s.RequestID = r.Op, key, r.Remote+off, r.RequestID
			s.Generation, s.GrantID = r.Generation, r.GrantID
			s.Extent = transport.Span{Addr: r.Remote, Len: r.Length}
			s.Local, s.LocalReg = lreg.Bytes(r.Local+off, ln), lreg
			s.Done, s.Tag, s.Recheck = sliceDone, s, recheck
		}
	}
	sl.local = local
	return out, sl, nil
}

// post spreads the slices over each segment's paths, one Post per path.
// The pointer arrays handed to the paths are cut from the slab.
func (b *Batch) post(ctx context.Context, tasks []*task, sl *slab) {
	type group struct {
		seg      *Segment
		k        uint32
		n, start int
	}
	var groups []group // few: (segment, path slot) pairs of this submit
	find := func(seg *Segment, k uint32, last int) int {
		if last < len(groups) && groups[last].seg == seg && groups[last].k == k {
			return last
		}
		for i := range groups {
			if groups[i].seg == seg && groups[i].k == k {
				return i
			}
		}
		groups = append(groups, group{seg: seg, k: k})
		return len(groups) - 1
	}
	// Each path takes SliceSize bytes of the submit before the next one
	// does, starting at a path that rotates per submit: a large request
	// spreads over every path, while small batches from several threads
	// each keep to one path instead of all waiting on all of them.
	type spread struct {
		seg   *Segment
		start uint32
		bytes uint64
	}
	var spreads []spread
	unit := uint64(b.e.opts.SliceSize)
	gi, si := 0, 0
	for _, t := range tasks {
		// A cancel may have ended the task already (Close, Batch.Cancel
		// racing this Submit): never overwrite a final state.
		t.status.CompareAndSwap(int32(Waiting), int32(Pending))
		seg := t.req.Segment
		if si >= len(spreads) || spreads[si].seg != seg {
			si = slices.IndexFunc(spreads, func(sp spread) bool { return sp.seg == seg })
			if si < 0 {
				spreads = append(spreads, spread{seg: seg, start: seg.next.Add(1)})
				si = len(spreads) - 1
			}
		}
		sp := &spreads[si]
		for j := range t.slices {
			s := &t.slices[j]
			s.hint = sp.start + uint32(sp.bytes/unit)
			sp.bytes += uint64(len(s.Local))
			gi = find(seg, s.hint%uint32(len(seg.paths)), gi)
			groups[gi].n++
		}
	}
	off := 0
	for i := range groups {
		groups[i].start = off
		off += groups[i].n
		groups[i].n = 0
	}
	ptrs := sl.sptrs[:off]
	for _, t := range tasks {
		seg := t.req.Segment
		for j := range t.slices {
			s := &t.slices[j]
			gi = find(seg, s.hint%uint32(len(seg.paths)), gi)
			g := &groups[gi]
			ptrs[g.start+g.n] = &s.Slice
			g.n++
		}
	}
	for _, g := range groups {
		slices := ptrs[g.start : g.start+g.n : g.start+g.n]
		ref, err := g.seg.path(ctx, g.k)
		for _, s := range slices {
			if err != nil {
				s.Finish(err)
			} else {
				s.Tag.(*sliceT).path.Store(ref)
			}
		}
		if err == nil {
			b.e.postStaged(ref, slices)
		}
	}
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

// startIn counts a goroutine in wg, unless the engine is closing: retryMu
// orders it against Close, which sets closing under it before waiting on
// wg.
func (e *Engine) startIn(wg *sync.WaitGroup) bool {
	e.retryMu.Lock()
	defer e.retryMu.Unlock()
	if e.closing.Load() {
		return false
	}
	wg.Add(1)
	return true
}

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
		t.err = fmt.Errorf("%s %s of [%#x, +%d) at %s: %w", st, t.req.Op, t.req.Remote, t.req.Length, t.req.Segment.name, cancelErr(st))
	} else if t.err != nil && isAbortRefusal(t.err) {
		st = Aborted
		t.err = fmt.Errorf("%s of [%#x, +%d) at %s: %w", t.req.Op, t.req.Remote, t.req.Length, t.req.Segment.name, t.err)
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
		t.err = fmt.Errorf("%s of [%#x, +%d) at %s: %w: %w", t.req.Op, t.req.Remote, t.req.Length, t.req.Segment.name, ErrTransferFailed, t.err)
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
	t.status.Store(int32(st))
	// Unlisted once final, and before the batch can count it out: a freed
	// batch's records may be reused.
	e.tasks.remove(t)
	e.stats.tasksInFlight.Add(-1)
	if b := t.b; b.running.Add(-1) == 0 {
		b.mu.Lock()
		if b.running.Load() == 0 && !b.idleClosed {
			close(b.idle)
			b.idleClosed = true
		}
		b.mu.Unlock()
	}
}

func cancelErr(st TaskStatus) error {
	switch st {
	case Timeout:
		return ErrTimeout
	case Aborted:
		return ErrAborted
	}
	return ErrCanceled
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

// Cancel ends every task still in flight as CANCELED and returns once the
// engine no longer touches their memory: nil then. It returns an error
// wrapping ErrMemoryInUse when that could not be confirmed within a bound
// of about 6 s (a NIC that neither completes nor flushes work): the tasks
// concerned stay in flight and their memory may still be touched.
func (b *Batch) Cancel() error { return b.cancel(Canceled, ErrCanceled) }

// Wait blocks until every submitted task is final or ctx ends; it returns
// ctx's error in the latter case, with the tasks still running.
func (b *Batch) Wait(ctx context.Context) error {
	b.mu.Lock()
	idle := b.idle
	b.mu.Unlock()
	select {
	case <-idle:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Status returns the state of task i.
func (b *Batch) Status(i int) (TaskResult, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if i < 0 || i >= len(b.tasks) {
		return TaskResult{}, fmt.Errorf("task %d: %w: batch holds %d", i, ErrInvalidArg, len(b.tasks))
	}
	return b.tasks[i].result(), nil
}

// Results returns the state of every task, in submission order.
func (b *Batch) Results() []TaskResult {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make([]TaskResult, len(b.tasks))
	for i, t := range b.tasks {
		out[i] = t.result()
	}
	return out
}

func (t *task) result() TaskResult {
	st := TaskStatus(t.status.Load())
	r := TaskResult{Status: st, Transferred: t.transferred.Load()}
	if st.Final() {
		t.errMu.Lock()
		r.Err = t.err
		t.errMu.Unlock()
	}
	return r
}

// Free releases the batch. It is refused with ErrBatchBusy while tasks are
// in flight: Wait or Cancel first.
func (b *Batch) Free() error {
	b.mu.Lock()
	if b.freed {
		b.mu.Unlock()
		return ErrBatchFreed
	}
	if n := b.running.Load(); n > 0 {
		b.mu.Unlock()
		return fmt.Errorf("free batch: %w: %d of %d tasks", ErrBatchBusy, n, len(b.tasks))
	}
	b.freed = true
	b.tasks = nil
	slabs := b.slabs
	b.slabs = nil
	b.mu.Unlock()
	if !b.tainted.Load() {
		for _, sl := range slabs {
			b.e.putSlab(sl)
		}
	}
	b.e.liveMu.Lock()
	delete(b.e.live, b)
	b.e.liveMu.Unlock()
	return nil
}

// Transfer runs requests synchronously. It returns when every request is
// final, or at ctx's deadline (DefaultTimeout when ctx has none): then the
// remaining tasks end TIMEOUT (CANCELED if ctx was canceled), and Transfer
// returns only after the engine stopped touching their memory: one syscall
// or memcpy chunk past the deadline on tcp and local, one staging chunk for
// GPU memory, and on rdma the completion of work already posted (after
// 50 ms the NIC paths holding it are flushed). When a path cannot confirm
// that within about 6 s, the error wraps ErrMemoryInUse. The error is nil
// when every task completed; otherwise it is the error of the first task
// that did not.
func (e *Engine) Transfer(ctx context.Context, reqs []Request) ([]TaskResult, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, e.opts.DefaultTimeout)
		defer cancel()
	}
	b, err := e.AllocateBatch(max(len(reqs), 1))
	if err != nil {
		return nil, err
	}
	defer func() { _ = b.Free() }()
	if err := b.Submit(ctx, reqs); err != nil {
		return nil, err
	}
	if werr := b.Wait(ctx); werr != nil {
		st := Timeout
		if errors.Is(werr, context.Canceled) {
			st = Canceled
		}
		if err := b.cancel(st, werr); err != nil {
			return b.Results(), fmt.Errorf("transfer: %w", err)
		}
	}
	res := b.Results()
	for i, r := range res {
		if r.Status != Completed {
			return res, fmt.Errorf("task %d: %w", i, r.Err)
		}
	}
	return res, nil
}
