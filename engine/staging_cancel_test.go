package engine_test

// SAFETY.md promise 3 (bounded syncs) against work the engine cannot stop
// at once. GPU staging on the initiator: the fake libcuda makes each
// device-to-host staging copy slow and counts the copies that entered and
// have not returned, so a test sees whether the source is still being read
// when Cancel or a deadline returns. rdma: a cancel of one request on a
// path that others share, and a NIC that neither completes nor flushes a
// work request (the fake libibverbs' hang fault).

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvferry/kvferry/cuda"
	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/internal/fakeverbs"
	"github.com/kvferry/kvferry/verbs"
)

// stageOp is the driver entry point of an initiator's staging copy of a
// WRITE: GPU memory (the source) into a host staging buffer.
const stageOp = "cuMemcpyDtoHAsync_v2"

// stagingCopies returns the fake driver's staging copies: those started
// so far, and those started and not yet returned (sleeping in their delay
// or copying; the source is read at the end of the delay).
func stagingCopies(t *testing.T, d *cuda.Driver) (started, running int64) {
	t.Helper()
	started, running = d.Stat("calls:"+stageOp), d.Stat("running:"+stageOp)
	if started < 0 || running < 0 {
		t.Fatalf("the fake libcuda does not count %s calls (stats calls:/running:)", stageOp)
	}
	return started, running
}

// gpuStagingSetup starts an owner (host memory) and an initiator whose
// source is GPU memory, over tcp with one path, so each slice of a WRITE is
// staged through host memory, one copy after another. The path is dialed
// here, so a deadline is not spent dialing. Every staging copy then takes
// 200 ms.
func gpuStagingSetup(t *testing.T, slice, n int) (init *engine.Engine, d *cuda.Driver, req engine.Request) {
	t.Helper()
	owner := newEngineWith(t, gpuOpts(t, engine.Options{SliceSize: slice}))
	init = newEngineWith(t, gpuOpts(t, engine.Options{SliceSize: slice, PathsPerPeer: 1}))
	d, src := gpuAlloc(t, 0, n)
	if _, err := init.RegisterMemory(src, "cuda:0"); err != nil {
		t.Fatal(err)
	}
	want := make([]byte, n)
	fillPattern(want, 21)
	gpuWrite(t, d, 0, src, want)
	dst := alloc(t, owner, n)
	seg := openSegment(t, init, owner.Name())
	transfer(t, init, 30*time.Second, write(alloc(t, init, 4096), seg, engine.AddrOf(dst), 4096))
	if err := d.Control("delay op=" + stageOp + " us=200000"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Control("reset") })
	return init, d, write(src, seg, engine.AddrOf(dst), n)
}

// A WRITE of 4 slices from GPU memory over tcp, canceled while its first
// staging copy runs: Cancel returns only once no staging copy reads the
// source any more, no staging copy starts after it returned, and every
// staging buffer goes back to the pool (the fake driver's count of
// page-locked host ranges is back where it was once the initiator closed).
func TestCancelWaitsForGPUStagingCopiesAndReturnsTheirBuffers(t *testing.T) {
	needFakeGPU(t, "slow staging copies it counts")
	const slice, nslices = 64 << 10, 4
	init, d, req := gpuStagingSetup(t, slice, slice*nslices)
	pinned := d.Stat("registered") // before any staging buffer exists
	started0, _ := stagingCopies(t, d)

	b, err := init.AllocateBatch(1)
	if err != nil {
		t.Fatal(err)
	}
	// Submit may run the staging copies itself (today it does, all of
	// them), so it runs aside; the test waits for it before the engines
	// close.
	submitted := make(chan error, 1)
	go func() { submitted <- b.Submit(context.Background(), []engine.Request{req}) }()
	var submitErr error
	waited := false
	waitSubmit := func() {
		if !waited {
			waited = true
			within(t, 30*time.Second, "Submit", func() { submitErr = <-submitted })
		}
	}
	t.Cleanup(waitSubmit)
	waitFor(t, 10*time.Second, "first staging copy started", func() bool {
		s, _ := stagingCopies(t, d)
		return s > started0
	})

	var cancelErr error
	within(t, 30*time.Second, "Cancel", func() { cancelErr = b.Cancel() })
	startedAtCancel, runningAtCancel := stagingCopies(t, d)
	inUse := init.Stats().StagingInUse

	// Settle: Submit returned, every task final, the initiator closed, so
	// none of its code runs any more.
	waitSubmit()
	res := waitBatch(t, b, 30*time.Second)
	if err := b.Free(); err != nil {
		t.Errorf("free: %v", err)
	}
	if err := init.Close(); err != nil {
		t.Errorf("close: %v", err)
	}
	startedAfter, _ := stagingCopies(t, d)
	leaked := d.Stat("registered") - pinned
	t.Logf("staging copies: %d started before Cancel returned, %d of them still running then, %d started after; task %v (%v); submit: %v; cancel: %v; StagingInUse %d; %d staging buffers left page-locked after Close",
		startedAtCancel-started0, runningAtCancel, startedAfter-startedAtCancel, res[0].Status, res[0].Err, submitErr, cancelErr, inUse, leaked)

	if runningAtCancel != 0 {
		t.Errorf("Cancel returned while %d staging copies of the canceled WRITE still ran: the engine may read the source GPU memory after Cancel returned", runningAtCancel)
	}
	if startedAfter != startedAtCancel {
		t.Errorf("%d staging copies of the canceled WRITE started after Cancel returned", startedAfter-startedAtCancel)
	}
	if leaked != 0 {
		t.Errorf("%d staging buffers still page-locked after the initiator closed: a canceled slice's staging buffer never went back to the pool", leaked)
	}
	if submitErr != nil {
		t.Errorf("submit: %v", submitErr)
	}
	if cancelErr != nil {
		t.Errorf("Cancel: %v; a staging copy of 200 ms ends well inside the engine's bound", cancelErr)
	}
	if res[0].Status != engine.Canceled || !errors.Is(res[0].Err, engine.ErrCanceled) {
		t.Errorf("task ended %v (%v); want CANCELED with ErrCanceled", res[0].Status, res[0].Err)
	}
	if inUse != 0 {
		t.Errorf("Stats.StagingInUse = %d once Cancel returned; want 0 with no transfer running", inUse)
	}
}

// Transfer with a 50 ms deadline of a 4-slice WRITE from GPU memory whose
// staging copies take 200 ms each: it ends TIMEOUT having started at most
// the copy that was running at the deadline, none of them running when it
// returned and none starting afterwards. (Copy counts, not elapsed time:
// staging every slice before waiting at all starts all 4.)
func TestTransferDeadlineStopsGPUStagingCopies(t *testing.T) {
	needFakeGPU(t, "slow staging copies it counts")
	const slice, nslices = 64 << 10, 4
	init, d, req := gpuStagingSetup(t, slice, slice*nslices)
	started0, _ := stagingCopies(t, d)

	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	var res []engine.TaskResult
	var err error
	within(t, 30*time.Second, "Transfer", func() { res, err = init.Transfer(ctx, []engine.Request{req}) })
	startedAtReturn, runningAtReturn := stagingCopies(t, d)
	if cerr := init.Close(); cerr != nil {
		t.Errorf("close: %v", cerr)
	}
	startedAfter, _ := stagingCopies(t, d)
	t.Logf("staging copies: %d of %d started by the time Transfer returned, %d still running then, %d started after; err %v",
		startedAtReturn-started0, nslices, runningAtReturn, startedAfter-startedAtReturn, err)

	if n := startedAtReturn - started0; n > 1 {
		t.Errorf("Transfer with a 50 ms deadline started %d staging copies of 200 ms each: only the first was running at the deadline, the others started after it", n)
	}
	if runningAtReturn != 0 {
		t.Errorf("Transfer returned while %d staging copies still ran", runningAtReturn)
	}
	if startedAfter != startedAtReturn {
		t.Errorf("%d staging copies started after Transfer returned", startedAfter-startedAtReturn)
	}
	if len(res) != 1 || res[0].Status != engine.Timeout || !errors.Is(err, engine.ErrTimeout) {
		t.Errorf("results %+v, err %v; want the task TIMEOUT and ErrTimeout", res, err)
	}
}

// Two batches on the same rdma path (one path to the owner), placed slowly
// by the fake: canceling batch A while batch B's work requests are posted
// behind A's leaves B alone: B completes with every byte right, and none of
// its slices fails or is retried by the engine because of the cancel (a
// cancel that aborts the shared path fails every slice of B, which the
// engine then posts again). A's work requests outlast the cancel's 50 ms
// grace here, so the NIC pairs holding them are flushed: B's work requests
// queued behind them on those pairs (an RC queue pair runs in order) move
// to the reconnected pairs inside the path, unseen by the engine.
func TestCancelOfOneRDMABatchDoesNotDisturbAnotherOnTheSamePath(t *testing.T) {
	owner := newEngineWith(t, rdmaOpts(t, engine.Options{RDMADevices: fakeverbs.Devices("owner")}))
	init := newEngineWith(t, rdmaOpts(t, engine.Options{PathsPerPeer: 1, RDMADevices: fakeverbs.Devices("initiator")}))
	const size = 8 << 20
	dstA, dstB := alloc(t, owner, size), alloc(t, owner, size)
	srcA, srcB := alloc(t, init, size), alloc(t, init, size)
	fillByte(srcA, oldByte)
	fillPattern(srcB, 22)
	seg := openSegment(t, init, owner.Name())
	// 64 KiB chunks 3 ms apart on both responder NICs: each batch takes a
	// few hundred ms to land.
	fakeverbs.SlowPlacement(t, 3000)
	posted0 := init.Stats().RDMAWorkRequests
	a := submit(t, init, write(srcA, seg, engine.AddrOf(dstA), size))
	waitFor(t, 10*time.Second, "A's first bytes landed", func() bool { return bytes.IndexByte(dstA, oldByte) >= 0 })
	perBatch := init.Stats().RDMAWorkRequests - posted0
	b := submit(t, init, write(srcB, seg, engine.AddrOf(dstB), size))
	waitFor(t, 10*time.Second, "B's work requests posted", func() bool {
		return init.Stats().RDMAWorkRequests-posted0 >= 2*perBatch
	})
	if st := a.Results()[0].Status; st.Final() {
		t.Fatalf("A ended %v before the cancel: nothing was shown", st)
	}
	before := init.Stats()
	if err := a.Cancel(); err != nil {
		t.Errorf("cancel A: %v", err)
	}
	rb := waitBatch(t, b, 60*time.Second)[0]
	after := init.Stats()
	t.Logf("%d work requests per batch; A %v; B %v after %d bytes (%v); because of the cancel: retries +%d, NIC path failovers +%d, error completions +%d",
		perBatch, a.Results()[0].Status, rb.Status, rb.Transferred, rb.Err, after.Retries-before.Retries,
		after.RDMAFailovers-before.RDMAFailovers, after.RDMAErrorWCs-before.RDMAErrorWCs)
	if rb.Status != engine.Completed {
		t.Fatalf("B ended %v (%v): canceling A broke B", rb.Status, rb.Err)
	}
	requireEqual(t, "B's data at the owner", dstB, srcB)
	if after.Retries != before.Retries {
		t.Errorf("canceling A made %d slices fail and be posted again by the engine: the cancel cut the path B shares",
			after.Retries-before.Retries)
	}
}

// A WRITE whose work requests the NIC neither completes nor flushes (the
// fake's hang on both responder NICs), under Transfer with a 200 ms
// deadline: Transfer returns within its bound (the deadline plus the
// engine's few seconds of flush wait; the test allows 30 s) with
// ErrMemoryInUse, since the engine cannot confirm the NIC stopped reading
// the source. Hanging until the NIC answers breaks promise 3.
func TestTransferDeadlineIsBoundedWhenTheNICNeverFlushes(t *testing.T) {
	const size = 1 << 20
	_, init, dst, src, seg := onePathPair(t, size, 23)
	transfer(t, init, 30*time.Second, write(src, seg, engine.AddrOf(dst), size)) // dials the path
	fakeControl(t, "hang dev=fake0 on=1;hang dev=fake1 on=1")

	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	done := make(chan struct{})
	var res []engine.TaskResult
	var err error
	start := time.Now()
	go func() {
		defer close(done)
		res, err = init.Transfer(ctx, []engine.Request{write(src, seg, engine.AddrOf(dst), size)})
	}()
	// Runs before the engines close and the memory is freed: the NIC lets
	// the work go (it flushes), then Transfer has returned.
	lib, lerr := verbs.Open(fakeverbs.Path(t))
	if lerr != nil {
		t.Fatal(lerr)
	}
	t.Cleanup(func() {
		if err := lib.Control("hang dev=fake0 on=0;hang dev=fake1 on=0"); err != nil {
			t.Errorf("end the hang: %v", err)
		}
		within(t, 30*time.Second, "Transfer after the NIC flushed", func() { <-done })
	})
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatalf("Transfer with a 200 ms deadline had not returned after 30 s while the NIC neither completed nor flushed its work: a deadline must bound the call")
	}
	t.Logf("Transfer returned after %v: %v", time.Since(start).Round(time.Millisecond), err)
	if len(res) != 1 || res[0].Status == engine.Completed {
		t.Fatalf("results %+v, err %v; the work never completed", res, err)
	}
	if !errors.Is(err, engine.ErrMemoryInUse) {
		t.Fatalf("Transfer returned %v (task %v); want an error matching ErrMemoryInUse: the NIC may still read the source", err, res[0].Status)
	}
}
