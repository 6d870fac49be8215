package engine_test

// Attacks on the fence by memory range (SAFETY.md promise 7): epochs the
// owner never issued, initiators that are never told, fences that must not
// cost bystanders, departed planners, the engine's own transfers into the
// fenced pages. Each test failed before the protection it names was built.

import (
	"bytes"
	"context"
	"errors"
	"runtime"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/engine/control"
)

// An initiator can come to hold a fence epoch its owner never issued: a
// FENCE forged under the owner's name (the control plane takes a peer's
// claimed name as given, as for ABORT), or one of an earlier incarnation of
// the owner handled late. Stamped with it, a transfer would look planned
// after every fence the owner makes until its epoch caught up: "planned
// before" would no longer be decided by what the owner issued. So the owner
// refuses a stamp above its own epoch, and the initiator, seeing the
// owner's descriptor epoch below the one it holds, starts afresh from it.
//
// Here a peer claiming the owner's name sends the initiator a well-formed
// FENCE of epoch 2^64-1. The initiator's next WRITE is refused without a
// byte landing; the owner's Fence is Safe; the WRITE after that, planned
// once the initiator refreshed, completes.
func TestFenceRefusesAStampTheOwnerNeverIssued(t *testing.T) {
	const size = 16 << 20
	r := newFenceRig(t, "tcp", false, size)
	spoof := newFakeInitiator(t, r.init.Name(), r.owner.Name())
	spoof.send(t, control.MsgFence, 0, control.FenceMsg{Epoch: ^uint64(0), Ranges: []control.FenceRange{{Addr: 1, Len: 1}}}.Encode())
	waitFor(t, 10*time.Second, "the forged FENCE handled", func() bool { return r.init.Stats().FencesReceived == 1 })

	fillByte(r.src, oldByte)
	got, err := r.init.Transfer(testCtx(t, 30*time.Second), []engine.Request{write(r.src, r.seg, engine.AddrOf(r.dst), size)})
	if err == nil || got[0].Status == engine.Completed || !errors.Is(got[0].Err, engine.ErrFenced) {
		t.Fatalf("a WRITE stamped with an epoch the owner never issued: %+v, %v; want it refused as fenced", got, err)
	}
	if n := bytes.Count(r.dst, []byte{oldByte}); n != 0 {
		t.Fatalf("%d bytes of a WRITE stamped 2^64-1 landed", n)
	}
	res, err := r.owner.Fence(testCtx(t, 20*time.Second), []engine.FenceRange{{Addr: engine.AddrOf(r.dst), Len: size}})
	if err != nil || !res.Safe {
		t.Fatalf("fence = %+v, %v; want Safe", res, err)
	}
	fillPattern(r.src, 5)
	transfer(t, r.init, 60*time.Second, write(r.src, r.seg, engine.AddrOf(r.dst), size))
	requireEqual(t, "pages written after the initiator refreshed", r.dst, r.src)
}

var _ = errors.Is

// The normal flow breaks for an initiator that finds segments through a
// Resolver other than the default (a cluster store, which the Resolver
// interface exists for): the owner tells FENCE only to "planners", the
// peers that sent it GET_DESCRIPTOR, so such an initiator is never told.
// Its next request's WRITE into the fenced pages, planned after Fence
// returned (the owner told it of the pages only then), is stamped with the
// epoch of the descriptor it fetched before the fence and is refused as
// fenced: the task FAILS. Promise 7: "in the normal flow ... the next
// request's transfers never fail because of the fence". The resolver here
// is the most generous store there is (it hands out the owner's current
// descriptor); one that is not republished after every fence makes the
// fenced pages unwritable for the initiator for good, refresh or not.
func TestFenceNextRequestPassesForAnInitiatorWithACustomResolver(t *testing.T) {
	const size = 1 << 20
	owner := newEngineWith(t, engine.Options{})
	init := newEngineWith(t, engine.Options{Resolver: aliasResolver{owner.Name(), owner}})
	dst, src := alloc(t, owner, size), alloc(t, init, size)
	seg := openSegment(t, init, owner.Name())
	fillByte(src, oldByte)
	transfer(t, init, 30*time.Second, write(src, seg, engine.AddrOf(dst), size)) // the first request

	res, err := owner.Fence(testCtx(t, 20*time.Second), []engine.FenceRange{{Addr: engine.AddrOf(dst), Len: size}})
	if err != nil || !res.Safe {
		t.Fatalf("fence = %+v, %v; want Safe", res, err)
	}
	// Fence returned: the owner hands the pages to the next request and
	// tells the writer.
	fillPattern(src, 11)
	got, err := init.Transfer(testCtx(t, 30*time.Second), []engine.Request{write(src, seg, engine.AddrOf(dst), size)})
	t.Logf("fence told %v, acked %v; next request's WRITE: %+v, %v", res.Told, res.Acked, got, err)
	if err != nil || got[0].Status != engine.Completed {
		t.Fatalf("the next request's WRITE, planned after Fence returned, failed (%v): an initiator that resolves segments through its own Resolver is never told of fences", err)
	}
	requireEqual(t, "the next request's pages", dst, src)
}

// Over rdma, a fence of one range fails transfers into other ranges. Each
// FENCE an rdma initiator hears aborts every path of its segment to the
// owner (handleFence: seg.cutPaths), which fails the slices on them with
// a connection error; the engine posts them again, but that spends one of
// the slice's MaxRetries (2 by default) each time. So a transfer into
// pages no fence names, planned after the first fence, fails once three
// fences of other pages strike during one of its slices: a decode server
// that fences each finished request's pages fails the transfers of the
// requests still running. (The owner's own cut of the QPs needs none of
// this: the path's pairs reconnect and repost for up to 30 s without
// spending a retry.) TestFenceLeavesOtherRangesAlone states the property
// for tcp only.
func TestRDMAFencesOfOtherPagesDoNotFailATransfer(t *testing.T) {
	const size = 16 << 20
	owner := newEngineWith(t, rdmaOpts(t, engine.Options{}))
	init := newEngineWith(t, rdmaOpts(t, engine.Options{}))
	fenced := alloc(t, owner, 1<<20)
	dst, src := alloc(t, owner, size), alloc(t, init, size)
	seg := openSegment(t, init, owner.Name())
	fillPattern(src, 5)
	fakeControl(t, "delay dev=fake0 us=3000;delay dev=fake1 us=3000")
	b := submit(t, init, write(src, seg, engine.AddrOf(dst), size))
	waitFor(t, 10*time.Second, "first bytes landed", func() bool { return !bytes.Equal(dst[:4096], make([]byte, 4096)) })
	fences := 0
	for ; fences < 5 && !b.Results()[0].Status.Final(); fences++ {
		// Each fence strikes once the initiator is connected again.
		waitFor(t, 10*time.Second, "initiator connected", func() bool {
			return owner.Stats().RDMAResponderQPs > 0 || b.Results()[0].Status.Final()
		})
		res, err := owner.Fence(testCtx(t, 20*time.Second), []engine.FenceRange{{Addr: engine.AddrOf(fenced), Len: 1 << 20}})
		if err != nil || !res.Safe {
			t.Fatalf("fence %d = %+v, %v; want Safe", fences+1, res, err)
		}
		// At least once: FENCE is resent while the owner waits for the ACK.
		waitFor(t, 10*time.Second, "the FENCE handled", func() bool { return init.Stats().FencesReceived >= uint64(fences+1) })
	}
	got := waitBatch(t, b, 60*time.Second)[0]
	t.Logf("%d fences of other pages; the WRITE ended %v after %d bytes (%v); initiator retries %d", fences, got.Status, got.Transferred, got.Err, init.Stats().Retries)
	if got.Status != engine.Completed {
		t.Fatalf("a WRITE into pages no fence named ended %v after %d fences of other pages: %v", got.Status, fences, got.Err)
	}
	requireEqual(t, "unfenced pages", dst, src)
}

// A peer that fetched the owner's descriptor once is a "planner" for good
// (only the 4097th planner evicts the oldest), and every later Fence tells
// it and waits the whole FenceGrace for its FENCE_ACK, even after it closed
// and no connection to it is left (SendIfConnected drops the notice, but
// the name stays in the set Fence waits on). So one initiator that came and
// went (a restarted prefill worker, a health probe, kvferry-bench) costs
// every Fence the owner makes from then on FenceGrace (50 ms by default): a
// decode server fencing each finished request's pages is held to 20 fences
// a second. The options document "a paused or partitioned peer costs a
// Fence this long"; a peer that is gone for good should not. The grace is
// 3 s here so the cost is unmistakable.
func TestFenceAPlannerThatLeftDoesNotCostEveryFenceTheGrace(t *testing.T) {
	owner := newEngineWith(t, engine.Options{FenceGrace: 3 * time.Second})
	dst := alloc(t, owner, 1<<20)
	plannerThatLeft(t, owner)
	waitFor(t, 10*time.Second, "the owner saw the peer's control connection close", func() bool { return owner.Stats().ControlConns == 0 })
	for i := 0; i < 3; i++ {
		start := time.Now()
		res, err := owner.Fence(testCtx(t, 20*time.Second), []engine.FenceRange{{Addr: engine.AddrOf(dst), Len: 4096}})
		if err != nil || !res.Safe {
			t.Fatalf("fence = %+v, %v; want Safe", res, err)
		}
		t.Logf("fence %d took %v; told %v, acked %v", i+1, time.Since(start), res.Told, res.Acked)
		if len(res.Told) != 0 {
			t.Fatalf("fence %d told %v and waited for its FENCE_ACK: a peer that closed before the first fence", i+1, res.Told)
		}
	}
}

// engine.MaxFenceRanges says one Fence takes up to 2^19 ranges (it is
// control.MaxFenceRanges, what a FENCE notice can carry), and Fence checks
// against it, but the owner's table refuses more than fence.MaxRanges,
// 2^16: a Fence of 65,537 valid, registered, disjoint ranges fails with
// ErrInvalidArg although the documented cap allows it.
func TestFenceTakesMaxFenceRanges(t *testing.T) {
	const n = 1<<16 + 1
	e := newEngine(t)
	buf := alloc(t, e, 2*n)
	if n > engine.MaxFenceRanges {
		t.Skipf("MaxFenceRanges is %d", engine.MaxFenceRanges)
	}
	rs := make([]engine.FenceRange, n)
	for i := range rs {
		rs[i] = engine.FenceRange{Addr: engine.AddrOf(buf) + uint64(2*i), Len: 1}
	}
	res, err := e.Fence(testCtx(t, 20*time.Second), rs)
	if err != nil || !res.Safe {
		t.Fatalf("Fence of %d ranges (MaxFenceRanges %d) = %+v, %v; want Safe", n, engine.MaxFenceRanges, res, err)
	}
}

// Fence checks only the owner side of a transfer: the remote range of
// accesses it admits. A transfer of this engine's own whose LOCAL buffer
// lies in the fenced ranges is not stopped: a READ lands in them, a WRITE
// reads from them, after Fence returned Safe. Here the engine reads, over
// its own segment (the local transport, whose owner code copies every
// byte), from one of its ranges into another, fences the landing range
// mid-READ and reuses it: the READ's later chunks overwrite the reused
// pages. Promise 7 says no transfer planned before the call "can write into
// or read from any byte of those ranges any more", whoever the initiator;
// the same hole is there for an rdma or tcp READ this engine pulls from a
// peer into pages it then fences (vLLM's NIXL-style pull, where decode
// READs KV into its own pages).
func TestFenceStopsTheEnginesOwnTransfersIntoTheRanges(t *testing.T) {
	const size = 16 << 20
	e := newEngineWith(t, engine.Options{Testing: engine.Testing{LocalChunkDelay: 8 * time.Millisecond}})
	from, into := alloc(t, e, size), alloc(t, e, size)
	self := openSegment(t, e, e.Name())
	fillByte(from, oldByte)
	rd := submit(t, e, read(into, self, engine.AddrOf(from), size))
	waitFor(t, 10*time.Second, "first bytes read", func() bool { return bytes.IndexByte(into, oldByte) >= 0 })
	requireSafeFence(t, e, into)
	fillByte(into, reusedByte)
	got := waitBatch(t, rd, 60*time.Second)[0]
	n := bytes.Count(into, []byte{oldByte})
	t.Logf("READ %v after %d bytes (%v); %d bytes of it in the reused pages", got.Status, got.Transferred, got.Err, n)
	if n != 0 {
		t.Fatalf("%d bytes of a READ planned before the fence landed in the fenced pages after Fence returned Safe", n)
	}
}

// The same departed planner also costs memory: each Fence that it does
// not acknowledge leaves a goroutine resending FENCE to it (with the
// notice's body, up to 1 MiB for 2^16 ranges, and a timer) until the
// Fence's deadline, DefaultTimeout (30 s) for a context without one. An
// owner fencing 1,000 times a second with a short FenceGrace keeps 30,000
// of them. 200 fences here, a grace of 1 ms, and a planner that closed
// before the first.
func TestFencesToAPlannerThatLeftLeaveNoGoroutines(t *testing.T) {
	owner := newEngineWith(t, engine.Options{FenceGrace: time.Millisecond})
	dst := alloc(t, owner, 1<<20)
	plannerThatLeft(t, owner)
	before := runtime.NumGoroutine()
	for i := 0; i < 200; i++ {
		if res, err := owner.Fence(context.Background(), []engine.FenceRange{{Addr: engine.AddrOf(dst), Len: 4096}}); err != nil || !res.Safe {
			t.Fatalf("fence %d = %+v, %v", i+1, res, err)
		}
	}
	if grew := runtime.NumGoroutine() - before; grew > 50 {
		t.Fatalf("%d goroutines more after 200 fences: each keeps resending FENCE to a planner that left, until the fence's deadline", grew)
	}
}

// plannerThatLeft opens the owner from an engine of its own, which then
// closes: a planner the owner knows and that is gone for good.
func plannerThatLeft(t *testing.T, owner *engine.Engine) {
	t.Helper()
	gone, err := engine.New(engine.Options{IgnoreEnv: true, Protocol: "tcp"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := gone.OpenSegment(testCtx(t, 10*time.Second), owner.Name()); err != nil {
		t.Fatal(err)
	}
	if err := gone.Close(); err != nil {
		t.Fatal(err)
	}
}

// requireSafeFence has e fence all of mem, and fails the test unless the
// fence is Safe; it returns the result.
func requireSafeFence(t *testing.T, e *engine.Engine, mem []byte) engine.FenceResult {
	t.Helper()
	res, err := e.Fence(testCtx(t, 20*time.Second), []engine.FenceRange{{Addr: engine.AddrOf(mem), Len: uint64(len(mem))}})
	if err != nil || !res.Safe {
		t.Fatalf("fence = %+v, %v; want Safe", res, err)
	}
	return res
}
