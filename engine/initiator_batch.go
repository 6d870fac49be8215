package engine

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
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

var taskStatusNames = [...]string{
	Waiting: "WAITING", Pending: "PENDING", Completed: "COMPLETED", Failed: "FAILED",
	Timeout: "TIMEOUT", Canceled: "CANCELED", Aborted: "ABORTED",
}

// String returns the status's name in capitals (COMPLETED, ABORTED...).
func (s TaskStatus) String() string {
	if s >= 0 && int(s) < len(taskStatusNames) {
		return taskStatusNames[s]
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
