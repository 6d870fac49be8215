package engine_test

import (
	"bytes"
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/internal/fakeverbs"
)

// Cancels and deadlines that must hold wherever a slice is: waiting for
// its rkeys from an owner that stopped answering (the owner is a target
// process, stopped with SIGSTOP like a paused decode server), or in its
// last staging chunk.

// A Transfer over rdma whose slice waits for its rkeys (the first slice of
// a new request id asks the owner) from an owner that stopped answering
// returns by its deadline: the cancel ends the slice's rkey request, which
// would otherwise run until its own 5 s timeout (SAFETY.md promise 3).
func TestRDMATransferToAStoppedOwnerKeepsItsDeadlineWhileAskingForRKeys(t *testing.T) {
	fakeverbs.NeedFake(t, "a stopped owner process on the fake fabric")
	const size = 8 << 20
	const deadline = 200 * time.Millisecond
	tp := startTarget(t, targetConfig{size: size, rdma: fakeverbs.Path(t)})
	a := newEngineWith(t, rdmaOpts(t, engine.Options{}))
	local := alloc(t, a, size)
	seg := openSegment(t, a, tp.name)
	warmPaths(t, a, seg, local, tp.addr) // every path dialed, rkeys of request id 0 cached
	tp.signal(t, syscall.SIGSTOP)

	start := time.Now()
	res, err := a.Transfer(testCtx(t, deadline), []engine.Request{withRID(write(local, seg, tp.addr, 1<<20), 7, 0)})
	took := time.Since(start)
	t.Logf("Transfer with a %v deadline returned after %v: %v (results %+v)", deadline, took, err, res)
	if took > deadline+timeoutBound {
		t.Errorf("Transfer returned %v after its deadline, want at most %v (SAFETY.md promise 3)", took-deadline, timeoutBound)
	}
}

// A cancel that lands during a slice's last staging chunk: the cancel
// leaves a Staging slice to the stager, which must see the task ended once
// the chunk is done and end the slice instead of posting it. Otherwise the
// TIMEOUT task's bytes go on the wire after the deadline and Transfer waits
// for the whole network transfer, not one staging chunk (promise 3).
func TestGPUStagedSliceCanceledDuringItsLastChunkIsNotPosted(t *testing.T) {
	needFakeGPU(t, "slow copies")
	const n = 1 << 20
	const deadline = 100 * time.Millisecond
	const copyTime = 300 * time.Millisecond
	owner := newEngineWith(t, gpuOpts(t, engine.Options{Testing: engine.Testing{ApplyDelay: 3 * time.Second}}))
	init := newEngineWith(t, gpuOpts(t, engine.Options{PathsPerPeer: 1}))
	d, initGPU := gpuAlloc(t, 1, n)
	if _, err := init.RegisterMemory(initGPU, "*"); err != nil {
		t.Fatal(err)
	}
	gpuWrite(t, d, 1, initGPU, bytes.Repeat([]byte{oldByte}, n))
	dst := alloc(t, owner, n)
	seg := openSegment(t, init, owner.Name())
	if err := d.Control(fmt.Sprintf("delay op=cuMemcpyDtoHAsync_v2 us=%d", copyTime.Microseconds())); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Control("reset") })

	start := time.Now()
	res, err := init.Transfer(testCtx(t, deadline), []engine.Request{write(initGPU, seg, engine.AddrOf(dst), n)})
	took := time.Since(start)
	landed := bytes.Count(dst, []byte{oldByte})
	t.Logf("Transfer with a %v deadline returned after %v: %v; %d bytes of it in the owner's memory", deadline, took, err, landed)
	if len(res) == 1 && res[0].Status == engine.Completed {
		t.Fatalf("the transfer completed: the cancel did not land during staging")
	}
	if bound := deadline + copyTime + timeoutBound; took > bound {
		t.Errorf("Transfer returned after %v, want at most %v (deadline + one staging chunk + %v)", took, bound, timeoutBound)
	}
	if landed > 0 {
		t.Errorf("%d bytes of a task that ended %v were written into the owner after its cancel", landed, res[0].Status)
	}
}
