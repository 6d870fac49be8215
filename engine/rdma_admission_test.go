package engine_test

// The owner admits every rdma request id before its first byte: an
// initiator asks for rkeys once per request id (and generation, grant and
// buffer key) on a path, and the owner can refuse or, later, fence it.

import (
	"bytes"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/internal/fakeverbs"
)

// The owner is asked once per new request id on a path, not once per
// transfer: what a new request id costs is one control-plane round trip,
// and a request id's later transfers ask nothing. Request id 0 is admitted
// for the whole registration at once.
func TestRDMAOwnerIsAskedOncePerRequestIDOnAPath(t *testing.T) {
	opts := engine.Options{PathsPerPeer: 1}
	owner := newEngineWith(t, rdmaOpts(t, opts))
	init := newEngineWith(t, rdmaOpts(t, opts))
	const n = 64 << 10
	dst, src := alloc(t, owner, 16*n), alloc(t, init, n)
	seg := openSegment(t, init, owner.Name())
	asked := func(what string, want uint64, reqs func(i int) engine.Request) {
		t.Helper()
		before := owner.Stats().RDMAKeyRequests
		for i := 0; i < 5; i++ {
			transfer(t, init, 30*time.Second, reqs(i))
		}
		if got := owner.Stats().RDMAKeyRequests - before; got != want {
			t.Errorf("%s: the owner was asked for rkeys %d times, want %d", what, got, want)
		}
	}
	at := func(i int) uint64 { return engine.AddrOf(dst) + uint64(i)*n }
	asked("5 transfers of one request id", 1, func(int) engine.Request {
		return withRID(write(src, seg, at(0), n), 11, 0)
	})
	asked("5 transfers of 5 new request ids", 5, func(i int) engine.Request {
		return withRID(write(src, seg, at(i), n), uint64(100+i), 0)
	})
	asked("5 transfers without a request id", 1, func(i int) engine.Request {
		return write(src, seg, at(i), n)
	})
}

// A path releases the rkeys of a request id it stopped using (after a
// second or two idle): the owner then no longer counts the initiator among
// the request's holders, so an abort of it needs neither the initiator's
// ACK nor a fence, and a later transfer of the request asks the owner
// again, which refuses it.
func TestRDMAIdleRKeysAreReleasedAndAskedForAgain(t *testing.T) {
	opts := engine.Options{PathsPerPeer: 1}
	owner := newEngineWith(t, rdmaOpts(t, opts))
	init := newEngineWith(t, rdmaOpts(t, opts))
	const n, rid = 64 << 10, 515
	dst, src := alloc(t, owner, n), alloc(t, init, n)
	seg := openSegment(t, init, owner.Name())
	transfer(t, init, 30*time.Second, withRID(write(src, seg, engine.AddrOf(dst), n), rid, 0))
	if h := owner.Stats().RDMAHolders; h != 1 {
		t.Fatalf("the owner records %d holders after the transfer, want 1", h)
	}
	waitFor(t, 30*time.Second, "the initiator released the idle rkeys", func() bool {
		st := owner.Stats()
		return st.RDMAHolders == 0 && st.RDMAKeyReleases > 0
	})
	fences := owner.Stats().RDMAFences
	res, err := owner.Abort(testCtx(t, 10*time.Second), rid, nil)
	if err != nil || !res.Safe {
		t.Fatalf("abort naming no initiator after the release = %+v, %v; want Safe: nobody holds rkeys for it", res, err)
	}
	if st := owner.Stats(); st.RDMAFences != fences {
		t.Errorf("the abort fenced %d initiators: none held rkeys", st.RDMAFences-fences)
	}
	asked := owner.Stats().RDMAKeyRequests
	r, err := init.Transfer(testCtx(t, 10*time.Second), []engine.Request{withRID(write(src, seg, engine.AddrOf(dst), n), rid, 0)})
	if err == nil || r[0].Status != engine.Aborted {
		t.Fatalf("a transfer of the aborted request after the release: %+v, %v; want ABORTED", r, err)
	}
	if owner.Stats().RDMAKeyRequests == asked {
		t.Error("the transfer did not ask the owner for rkeys again")
	}
}

// Revoke stops an initiator that already holds the request's rkeys: the
// grant's initiator is fenced, asks again and is refused, and no byte of
// the request lands after Revoke returned.
func TestRDMARevokeStopsAnInitiatorHoldingRKeys(t *testing.T) {
	// On real devices decode and the initiator use different NICs, so
	// that the WRITE crosses the link SlowPlacement shapes.
	owner := newEngineWith(t, rdmaOpts(t, engine.Options{RDMADevices: fakeverbs.Devices("owner")}))
	init := newEngineWith(t, rdmaOpts(t, engine.Options{RDMADevices: fakeverbs.Devices("initiator")}))
	const size, rid = 8 << 20, 4242
	dst, src := alloc(t, owner, size), alloc(t, init, size)
	fillByte(src, oldByte)
	g, err := owner.Grant(init.Name(), rid, []engine.GrantRange{{Addr: engine.AddrOf(dst), Len: size}})
	if err != nil {
		t.Fatal(err)
	}
	seg := openSegment(t, init, owner.Name())
	fakeverbs.SlowPlacement(t, 3000)
	b := submit(t, init, withRID(write(src, seg, engine.AddrOf(dst), size), rid, g.Generation))
	waitFor(t, 10*time.Second, "first bytes landed", func() bool { return bytes.IndexByte(dst, oldByte) >= 0 })
	if err := owner.Revoke(testCtx(t, 10*time.Second), g.ID); err != nil {
		t.Fatalf("revoke: %v", err)
	}
	atRevoke := bytes.Count(dst, []byte{oldByte})
	if after := settledOldBytes(t, dst); after != atRevoke {
		t.Errorf("%d bytes of the request landed after Revoke returned (%d then, %d settled)", after-atRevoke, atRevoke, after)
	}
	res := waitBatch(t, b, 30*time.Second)
	if res[0].Status == engine.Completed {
		t.Errorf("the WRITE completed after its grant was revoked: %+v", res[0])
	}
	if st := owner.Stats(); st.RDMAFences == 0 {
		t.Errorf("no fence: %+v", st)
	}
}

// Notify keeps its deadline when its SEND is neither completed nor flushed
// (the fake's hang on both responder NICs): it cuts the pair and returns
// at most a short grace past the deadline, saying the notification may
// still arrive, instead of waiting seconds for a flush that never comes.
func TestRDMANotifyKeepsItsDeadlineWhenTheNICNeverFlushes(t *testing.T) {
	owner := newEngineWith(t, rdmaOpts(t, engine.Options{}))
	init := newEngineWith(t, rdmaOpts(t, engine.Options{PathsPerPeer: 1}))
	dst, src := alloc(t, owner, 64<<10), alloc(t, init, 64<<10)
	seg := openSegment(t, init, owner.Name())
	transfer(t, init, 30*time.Second, write(src, seg, engine.AddrOf(dst), len(src))) // the path is up
	fakeControl(t, "hang dev=fake0 on=1;hang dev=fake1 on=1")
	t.Cleanup(func() { fakeControl(t, "hang dev=fake0 on=0;hang dev=fake1 on=0") })
	const deadline = 200 * time.Millisecond
	start := time.Now()
	err := init.Notify(testCtx(t, deadline), seg, 5, []byte("ready"))
	took := time.Since(start)
	t.Logf("Notify with a %v deadline returned after %v: %v", deadline, took, err)
	if err == nil {
		t.Fatal("Notify succeeded while the owner's NICs execute nothing")
	}
	if took > deadline+time.Second {
		t.Errorf("Notify returned %v past its deadline: it waited for a flush that never came", took-deadline)
	}
}
