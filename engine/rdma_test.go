package engine_test

// The engine over rdma, on the fake libibverbs (tests/fakeverbs) or, with
// KVFERRY_TEST_RDMA=1, on this machine's RDMA devices (tests/rxe runs them
// on soft-RoCE): transfers striped across NIC pairs, transport selection,
// clean errors without RDMA, failover between NIC paths, and SAFETY.md's
// fake-rdma rows in one process (tests/pd runs them across two processes,
// with the initiator stopped). Tests that need the fake's fault injection
// skip on real devices, saying so.

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/engine/control"
	"github.com/kvferry/kvferry/internal/fakeverbs"
	"github.com/kvferry/kvferry/verbs"
)

func rdmaOpts(t *testing.T, o engine.Options) engine.Options {
	t.Helper()
	o.Protocol = "rdma"
	o.RDMALibrary = fakeverbs.Library(t)
	if o.RDMADevices == "" {
		o.RDMADevices = fakeverbs.Devices("")
	}
	return o
}

// fakeControl gives the fake a fault command; on real devices the test is
// skipped (a skip, not a pass: real devices take no fault commands).
func fakeControl(t *testing.T, cmd string) {
	t.Helper()
	fakeverbs.NeedFake(t, "fault injection: "+cmd)
	fakeverbs.Control(t, cmd)
}

// slowWrite starts, over rdma, one WRITE of size bytes of oldByte for
// request rid into a fresh owner range, with the fake placing it slowly
// (faults), and returns once its first bytes landed.
func slowWrite(t *testing.T, opts engine.Options, size int, rid uint64, faults string) (owner, init *engine.Engine, dst []byte, b *engine.Batch) {
	t.Helper()
	owner = newEngineWith(t, rdmaOpts(t, opts))
	init = newEngineWith(t, rdmaOpts(t, opts))
	dst, src := alloc(t, owner, size), alloc(t, init, size)
	fillByte(src, oldByte)
	seg := openSegment(t, init, owner.Name())
	fakeControl(t, faults)
	b = submit(t, init, withRID(write(src, seg, engine.AddrOf(dst), size), rid, 0))
	waitFor(t, 10*time.Second, "first bytes landed", func() bool { return bytes.IndexByte(dst, oldByte) >= 0 })
	return owner, init, dst, b
}

// onePathPair starts an rdma owner and an initiator with one path to it,
// a size-byte buffer on each (the initiator's filled from seed), and the
// owner opened by the initiator.
func onePathPair(t *testing.T, size int, seed uint64) (owner, init *engine.Engine, dst, src []byte, seg *engine.Segment) {
	t.Helper()
	owner = newEngineWith(t, rdmaOpts(t, engine.Options{}))
	init = newEngineWith(t, rdmaOpts(t, engine.Options{PathsPerPeer: 1}))
	dst, src = alloc(t, owner, size), alloc(t, init, size)
	fillPattern(src, seed)
	return owner, init, dst, src, openSegment(t, init, owner.Name())
}

// settledOldBytes waits until nothing lands in b any more, then counts
// its bytes of oldByte: the fake places a chunk every few milliseconds
// while it places anything, so a count unchanged for 250 ms means no WRITE
// into b is being placed (work the fake still held when the initiator's
// task ended, late-landing flushed work included, has landed).
func settledOldBytes(t *testing.T, b []byte) int {
	t.Helper()
	const quiet = 250 * time.Millisecond
	n, since := bytes.Count(b, []byte{oldByte}), time.Now()
	waitFor(t, 30*time.Second, "placement into the range settled", func() bool {
		if m := bytes.Count(b, []byte{oldByte}); m != n {
			n, since = m, time.Now()
		}
		return time.Since(since) >= quiet
	})
	return n
}

// Data both ways over rdma, with every byte checked, and the slices spread
// across every local NIC: all NICs are equally good for "cpu" memory (the
// fake's and soft-RoCE's alike), so no NIC may sit idle while another
// carries everything.
func TestRDMAMovesDataBothWaysStripedAcrossNICs(t *testing.T) {
	owner := newEngineWith(t, rdmaOpts(t, engine.Options{}))
	init := newEngineWith(t, rdmaOpts(t, engine.Options{}))
	const size = 24 << 20
	dst, src, back := alloc(t, owner, size), alloc(t, init, size), alloc(t, init, size)
	fillPattern(src, 1)
	seg := openSegment(t, init, owner.Name())
	transfer(t, init, 30*time.Second, write(src, seg, engine.AddrOf(dst), size))
	requireEqual(t, "owner memory after rdma WRITE", dst, src)
	transfer(t, init, 30*time.Second, read(back, seg, engine.AddrOf(dst), size))
	requireEqual(t, "initiator memory after rdma READ", back, src)
	st := init.Stats()
	if st.RDMANICs == 0 || st.RDMAWorkRequests == 0 {
		t.Fatalf("stats %+v: the transfer did not go over rdma", st)
	}
	want := "nics=fake0:1,fake1:1;cpu="
	if fakeverbs.Real() {
		want = "nics="
	}
	if a, ok := seg.Descriptor().Transport("rdma"); !ok || !strings.HasPrefix(a, want) || !strings.Contains(a, ";cpu=") {
		t.Errorf("the descriptor's rdma entry is %q; want the NICs and their preference per location", a)
	}
	t.Logf("work requests per NIC: %v", st.RDMAPostedByNIC)
	if len(st.RDMAPostedByNIC) > 1 {
		for nic, n := range st.RDMAPostedByNIC {
			if n == 0 {
				t.Errorf("NIC %s posted no work request of %d (%v): equally good NICs must share the work", nic, st.RDMAWorkRequests, st.RDMAPostedByNIC)
			}
		}
	}
	if o := owner.Stats(); o.OwnerBytesIn != 0 {
		t.Errorf("owner counted %d bytes in: its code copied, so tcp carried the data", o.OwnerBytesIn)
	}
	t.Logf("%d work requests on %d NICs", st.RDMAWorkRequests, st.RDMANICs)
}

func TestRDMAAutoFallsBackToTCPWithAPeerWithoutRDMA(t *testing.T) {
	owner := newEngineWith(t, engine.Options{Protocol: "tcp"})
	init := newEngineWith(t, engine.Options{Protocol: "auto", RDMALibrary: fakeverbs.Library(t), RDMADevices: fakeverbs.Devices("")})
	dst, src := alloc(t, owner, 1<<20), alloc(t, init, 1<<20)
	fillPattern(src, 2)
	seg := openSegment(t, init, owner.Name())
	transfer(t, init, 30*time.Second, write(src, seg, engine.AddrOf(dst), len(src)))
	requireEqual(t, "owner memory after tcp fallback", dst, src)
	if st := init.Stats(); st.RDMANICs == 0 || st.RDMAWorkRequests != 0 {
		t.Fatalf("stats %+v: want rdma up here but tcp used for the peer", st)
	}
	forced := newEngineWith(t, rdmaOpts(t, engine.Options{}))
	if _, err := forced.OpenSegment(testCtx(t, 10*time.Second), owner.Name()); !errors.Is(err, engine.ErrUnsupported) || !strings.Contains(err.Error(), "no rdma") {
		t.Fatalf("forced rdma to a tcp-only peer: %v, want ErrUnsupported saying it offers no rdma", err)
	}
}

func TestRDMAMissingLibraryIsACleanError(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "libibverbs.so.1")
	_, err := engine.New(engine.Options{IgnoreEnv: true, Protocol: "rdma", RDMALibrary: missing})
	if !errors.Is(err, verbs.ErrNotAvailable) || !strings.Contains(err.Error(), "rdma not available") {
		t.Fatalf("New with %s: %v, want an error saying rdma is not available", missing, err)
	}
	// "auto" goes on with tcp.
	e := newEngineWith(t, engine.Options{Protocol: "auto", RDMALibrary: missing})
	if e.Stats().RDMANICs != 0 {
		t.Fatal("rdma up without a library")
	}
}

func TestRDMANoDeviceListsWhatWasSearched(t *testing.T) {
	fakeverbs.NeedFake(t, "it names the fake's devices")
	// The fake's devices all filtered out.
	_, err := engine.New(rdmaOpts(t, engine.Options{IgnoreEnv: true, RDMADevices: "=mlx5_9"}))
	if !errors.Is(err, verbs.ErrNoDevice) || !strings.Contains(err.Error(), "fake0:1 (filtered out)") || !strings.Contains(err.Error(), `filter "=mlx5_9"`) {
		t.Fatalf("New with every device filtered out: %v, want ErrNoDevice listing fake0:1 and the filter", err)
	}
	// The system's libibverbs, where it is installed: on a machine without
	// RDMA it lists no device at all.
	_, err = engine.New(engine.Options{IgnoreEnv: true, Protocol: "rdma", RDMALibrary: verbs.DefaultLibrary})
	switch {
	case err == nil:
		t.Skip("this machine has an RDMA device; the no-device error cannot be shown with the system library")
	case errors.Is(err, verbs.ErrNotAvailable):
		t.Logf("no system libibverbs: %v", err)
	case !errors.Is(err, verbs.ErrNoDevice) || !strings.Contains(err.Error(), "lists no device") || !strings.Contains(err.Error(), "/sys/class/infiniband_verbs"):
		t.Fatalf("system libibverbs without devices: %v, want ErrNoDevice saying what was searched", err)
	default:
		t.Logf("system libibverbs: %v", err)
	}
}

// A NIC path whose work fails mid-transfer (the fake fails the 3rd work
// request its fake0 sends, as a link going down would) is reset; the
// slices on it move to another NIC pair and the transfer completes with
// every byte right.
func TestRDMAFailoverToAnotherNICPathCompletesTheTransfer(t *testing.T) {
	const size = 32 << 20
	_, init, dst, src, seg := onePathPair(t, size, 3)
	fakeControl(t, "fail dev=fake0 after=3")
	transfer(t, init, 60*time.Second, write(src, seg, engine.AddrOf(dst), size))
	requireEqual(t, "owner memory after failover", dst, src)
	st := init.Stats()
	if st.RDMAFailovers == 0 || st.RDMAErrorWCs == 0 {
		t.Fatalf("stats %+v: no NIC path failed, so no failover was shown", st)
	}
	t.Logf("%d error completions, %d failovers, %d engine retries", st.RDMAErrorWCs, st.RDMAFailovers, st.Retries)
}

// SAFETY.md's fake-rdma rows in one process: the owner aborts a large
// WRITE that the fake places slowly (a delay between chunks), reuses the
// range at once, and counts the aborted request's bytes in it afterwards.
// ACK on "heard" (UnsafeAbort) must find them; the owner-side QP fence and,
// separately, the drain-aware ACK must not.
func TestRDMAAbortRowsOfSafetyMD(t *testing.T) {
	const size = 8 << 20
	rows := []struct {
		name    string
		opts    engine.Options
		corrupt bool
	}{
		{"ACK on heard", engine.Options{Testing: engine.Testing{UnsafeAbort: true}}, true},
		{"owner-side QP fence", engine.Options{}, false},
		{"drain-aware ACK", engine.Options{RDMANoFence: true}, false},
	}
	for _, row := range rows {
		t.Run(row.name, func(t *testing.T) {
			const rid = 77
			// 64 KiB chunks, 3 ms apart: the WRITE lands over ~400 ms.
			owner, init, dst, b := slowWrite(t, row.opts, size, rid, "delay dev=fake0 us=3000;delay dev=fake1 us=3000")
			res, err := owner.Abort(testCtx(t, 20*time.Second), rid, []string{init.Name()})
			if err != nil || !res.Safe {
				t.Fatalf("abort = %+v, %v; want Safe", res, err)
			}
			fillByte(dst, reusedByte)
			r := waitBatch(t, b, 60*time.Second)[0]
			old := settledOldBytes(t, dst)
			st := owner.Stats()
			t.Logf("task %v after %d bytes; %d old bytes in the reused range; owner fences %d", r.Status, r.Transferred, old, st.RDMAFences)
			if row.corrupt {
				if old == 0 {
					t.Fatal("ACK on heard left the reused range clean: the fenced rows prove nothing")
				}
				return
			}
			if old != 0 {
				t.Fatalf("%d bytes of the aborted request landed after a Safe abort", old)
			}
			if row.opts.RDMANoFence == (st.RDMAFences > 0) {
				t.Errorf("owner fences = %d with RDMANoFence=%v", st.RDMAFences, row.opts.RDMANoFence)
			}
		})
	}
}

// A notification goes in-band over rdma, on the path's QPs, and arrives
// after the request's data even when it is sent while the WRITE is still
// landing (the fake places it slowly).
func TestRDMANotifyArrivesInBandAfterTheData(t *testing.T) {
	owner := newEngineWith(t, rdmaOpts(t, engine.Options{}))
	init := newEngineWith(t, rdmaOpts(t, engine.Options{}))
	const size, rid = 4 << 20, 31
	dst, src := alloc(t, owner, size), alloc(t, init, size)
	fillPattern(src, 4)
	seg := openSegment(t, init, owner.Name())
	fakeControl(t, "delay dev=fake0 us=1000;delay dev=fake1 us=1000")
	b := submit(t, init, withRID(write(src, seg, engine.AddrOf(dst), size), rid, 0))
	if err := init.Notify(testCtx(t, 20*time.Second), seg, rid, []byte("kv ready")); err != nil {
		t.Fatalf("notify: %v", err)
	}
	select {
	case ev := <-owner.Events():
		if ev.Kind != engine.EventNotify || ev.RequestID != rid || string(ev.Data) != "kv ready" || ev.Peer != init.Name() {
			t.Fatalf("event %+v", ev)
		}
		requireEqual(t, "owner memory when the notification arrived", dst, src)
	case <-time.After(20 * time.Second):
		t.Fatal("no notification")
	}
	waitBatch(t, b, 30*time.Second)
	if n := owner.Stats().RDMANotifications; n != 1 {
		t.Fatalf("%d notifications arrived in-band, want 1 (the control plane carried it?)", n)
	}
}

// The drain-aware ACK must not trust a flush: here the initiator's NIC
// pairs are flushed while its WRITE is on the wire (a cancel: each work
// request takes longer to place than the cancel's 50 ms grace; the fake in
// late-land mode flushes the work requests at once yet may still place
// them, as a real NIC's packets already sent may land), and the owner then
// aborts with the fence off. The initiator may promise a drain only once
// the owner has cut the responder QPs that work was posted to (the
// broken pairs' reconnects do that); until then its ACK says "cut". So
// the abort is either not Safe, or Safe with not one byte landing after
// it returned. Counting flushes as drained turns this test red: the late
// bytes land after a Safe (the fake's own self-test shows them landing).
func TestRDMADrainDoesNotTrustFlushedWork(t *testing.T) {
	const size, rid = 8 << 20, 88
	opts := engine.Options{RDMANoFence: true}
	owner := newEngineWith(t, rdmaOpts(t, opts))
	init := newEngineWith(t, rdmaOpts(t, opts))
	dst, src := alloc(t, owner, size), alloc(t, init, size)
	fillByte(src, oldByte)
	seg := openSegment(t, init, owner.Name())
	// 5 ms per 64 KiB: a 1 MiB work request takes 80 ms to place.
	fakeControl(t, "delay dev=fake0 us=5000;delay dev=fake1 us=5000;late_land dev=fake0 on=1;late_land dev=fake1 on=1")
	b := submit(t, init, withRID(write(src, seg, engine.AddrOf(dst), size), rid, 0))
	waitFor(t, 10*time.Second, "first bytes landed", func() bool { return bytes.IndexByte(dst, oldByte) >= 0 })
	_ = b.Cancel() // flushes the pairs: their work requests end, yet land
	r := waitBatch(t, b, 30*time.Second)[0]
	landedAtCancel := bytes.Count(dst, []byte{oldByte})
	res, err := owner.Abort(testCtx(t, 2*time.Second), rid, []string{init.Name()})
	landedAtSafe := bytes.Count(dst, []byte{oldByte})
	if err != nil {
		t.Fatal(err)
	}
	later := settledOldBytes(t, dst) // flushed work the fake lands late has landed

	t.Logf("task %v; %d bytes had landed at the cancel, %d when the abort returned, %d later; abort %+v; initiator rechecked %d drains",
		r.Status, landedAtCancel, landedAtSafe, later, res, init.Stats().DrainsRechecked)
	if res.Safe && later != landedAtSafe {
		t.Fatalf("abort reported Safe, and %d bytes of flushed work requests landed after it", later-landedAtSafe)
	}
}

// On real devices, a link under a transfer goes down (tests/rxe runs
// KVFERRY_TEST_RDMA_LINK_DOWN, which takes one veth of its soft-RoCE pair
// down, and KVFERRY_TEST_RDMA_LINK_UP afterwards): the NIC pairs across it
// fail for real (retries exceeded, flushes), their slices move on, and
// every transfer completes with every byte right. The first transfer is
// under way when the link drops, and whatever of it is still in flight
// fails with the link; under emulation it can also end first, so a second
// transfer is submitted once the link is down, and its work requests meet
// the dead link whatever the timing: the failover is shown on every run,
// never only when the race goes one way. On the fake,
// TestRDMAFailoverToAnotherNICPathCompletesTheTransfer shows it.
func TestRDMAFailoverWhenALinkGoesDown(t *testing.T) {
	down, up := os.Getenv("KVFERRY_TEST_RDMA_LINK_DOWN"), os.Getenv("KVFERRY_TEST_RDMA_LINK_UP")
	if !fakeverbs.Real() || down == "" || up == "" {
		t.Skip("needs real RDMA devices (KVFERRY_TEST_RDMA=1) and KVFERRY_TEST_RDMA_LINK_DOWN/_UP commands, which tests/rxe sets")
	}
	const size, after = 64 << 20, 16 << 20
	owner := newEngineWith(t, rdmaOpts(t, engine.Options{}))
	init := newEngineWith(t, rdmaOpts(t, engine.Options{PathsPerPeer: 1}))
	dst, src := alloc(t, owner, size), alloc(t, init, size)
	dst2, src2 := alloc(t, owner, after), alloc(t, init, after)
	fillPattern(src, 5)
	fillPattern(src2, 6)
	// Both owner ranges are known before the link drops: the second
	// transfer tests the data path, not a lookup of a range registered later.
	seg := openSegment(t, init, owner.Name())
	b := submit(t, init, write(src, seg, engine.AddrOf(dst), size))
	waitFor(t, 30*time.Second, "first slice landed", func() bool { return bytes.Equal(dst[:64<<10], src[:64<<10]) })
	if out, err := exec.Command("sh", "-c", down).CombinedOutput(); err != nil {
		t.Fatalf("%s: %v: %s", down, err, out)
	}
	t.Cleanup(func() {
		if out, err := exec.Command("sh", "-c", up).CombinedOutput(); err != nil {
			t.Errorf("%s: %v: %s", up, err, out)
		}
	})
	firstOpen := b.Results()[0].Status == engine.Pending
	b2 := submit(t, init, write(src2, seg, engine.AddrOf(dst2), after))
	r := waitBatch(t, b, 120*time.Second)[0]
	if r.Status != engine.Completed {
		t.Fatalf("transfer under way when the link went down ended %v: %v", r.Status, r.Err)
	}
	r2 := waitBatch(t, b2, 120*time.Second)[0]
	if r2.Status != engine.Completed {
		t.Fatalf("transfer submitted with the link down ended %v: %v", r2.Status, r2.Err)
	}
	requireEqual(t, "owner memory written while the link went down", dst, src)
	requireEqual(t, "owner memory written with the link down", dst2, src2)
	st := init.Stats()
	t.Logf("first transfer still open once the link was down: %v; error completions %d, failovers %d, stalls %d, engine retries %d, work requests per NIC %v",
		firstOpen, st.RDMAErrorWCs, st.RDMAFailovers, st.RDMAStalls, st.Retries, st.RDMAPostedByNIC)
	if st.RDMAFailovers == 0 && st.Retries == 0 {
		t.Fatal("no NIC path failed and nothing was retried, though a transfer was submitted with the link down")
	}
}

// A NIC path whose work requests never complete (the fake's responder
// fake1 sleeps 8 s before each, as a provider that retries for ever
// would) is broken after RDMACompletionTimeout: its QP goes to the error
// state, its work moves to the pairs that answer, and the transfer
// completes long before a single stalled work request could have. Without
// the watchdog the transfer waits on the stalled requests.
func TestRDMAStalledPathIsBrokenAfterTheCompletionTimeout(t *testing.T) {
	const stall = 8 * time.Second
	opts := engine.Options{RDMACompletionTimeout: 200 * time.Millisecond}
	owner := newEngineWith(t, rdmaOpts(t, opts))
	init := newEngineWith(t, rdmaOpts(t, opts))
	const size = 8 << 20
	dst, src := alloc(t, owner, size), alloc(t, init, size)
	fillPattern(src, 6)
	seg := openSegment(t, init, owner.Name())
	fakeControl(t, fmt.Sprintf("stall dev=fake1 ms=%d", stall.Milliseconds()))
	b := submit(t, init, write(src, seg, engine.AddrOf(dst), size))
	r := waitBatch(t, b, stall-2*time.Second)[0]
	if r.Status != engine.Completed {
		t.Fatalf("transfer ended %v: %v", r.Status, r.Err)
	}
	requireEqual(t, "owner memory", dst, src)
	st := init.Stats()
	t.Logf("stalls %d, failovers %d, error completions %d", st.RDMAStalls, st.RDMAFailovers, st.RDMAErrorWCs)
	if st.RDMAStalls == 0 {
		t.Fatal("no path was broken for stalling: the stall never held a work request")
	}
}

// A path that moves work slowly but well inside RDMACompletionTimeout is
// never declared stalled, after an idle spell too: a data WRITE, and a
// notification SEND, whose age the watchdog counts from its own post (it
// once counted from the pair's last data completion, and broke a healthy
// pair whose only work was a SEND posted milliseconds before).
func TestRDMAWatchdogTimesANotificationFromItsOwnPost(t *testing.T) {
	const ct = 400 * time.Millisecond
	owner := newEngineWith(t, rdmaOpts(t, engine.Options{RDMACompletionTimeout: ct}))
	init := newEngineWith(t, rdmaOpts(t, engine.Options{RDMACompletionTimeout: ct, PathsPerPeer: 1}))
	const size, rid = 1 << 20, 41
	dst, src := alloc(t, owner, size), alloc(t, init, size)
	fillPattern(src, 9)
	seg := openSegment(t, init, owner.Name())
	transfer(t, init, 30*time.Second, withRID(write(src, seg, engine.AddrOf(dst), size), rid, 0))

	// The scenario, not synchronization: an idle spell after which every
	// pair's last completion is older than the timeout (longer only
	// makes it older).
	time.Sleep(3 * ct)

	// Every WR now waits 150 ms in the responder before it runs: slow,
	// but each completes well inside the 400 ms completion timeout.
	fakeControl(t, "stall dev=fake0 ms=150;stall dev=fake1 ms=150")

	// Control: a data WRITE after the idle spell is not declared stalled.
	transfer(t, init, 30*time.Second, withRID(write(src, seg, engine.AddrOf(dst), size), rid, 0))
	if n := init.Stats().RDMAStalls; n != 0 {
		t.Fatalf("control: a data WRITE that took 150 ms broke %d paths", n)
	}
	time.Sleep(3 * ct) // idle again, as above

	err := init.Notify(testCtx(t, 10*time.Second), seg, rid, []byte("kv ready"))
	st := init.Stats()
	t.Logf("notify: %v; stalls %d, failovers %d, error completions %d", err, st.RDMAStalls, st.RDMAFailovers, st.RDMAErrorWCs)
	if err != nil || st.RDMAStalls != 0 {
		t.Fatalf("a notification SEND that needed 150 ms (completion timeout %v) was taken for a stall: notify err %v, %d paths broken", ct, err, st.RDMAStalls)
	}
}

// The watchdog breaking pairs all the time (a completion timeout shorter
// than one WR's placement) while the owner aborts and reuses the range; the
// fake places flushed WRs anyway (late_land), as packets a real NIC already
// sent may land. The abort is never Safe with bytes of the aborted request
// landing afterwards: the fence cuts them, and the drain-aware ACK counts
// the flushed work as uncertain (NotSafe).
func TestRDMAWatchdogChurnNeverMakesAnAbortSafeEarly(t *testing.T) {
	const size = 8 << 20
	rows := []struct {
		name string
		opts engine.Options
	}{
		{"fence", engine.Options{RDMACompletionTimeout: 30 * time.Millisecond}},
		{"drain-aware ACK", engine.Options{RDMANoFence: true, RDMACompletionTimeout: 30 * time.Millisecond}},
	}
	rounds := 3
	if testing.Short() {
		rounds = 1
	}
	for _, row := range rows {
		for round := 0; round < rounds; round++ {
			t.Run(row.name, func(t *testing.T) {
				// 1 MiB WRs of 16 chunks 3 ms apart: 48 ms each, past the 30 ms timeout.
				rid := uint64(900 + round)
				owner, init, dst, b := slowWrite(t, row.opts, size, rid, "delay dev=fake0 us=3000;delay dev=fake1 us=3000;late_land dev=fake0 on=1;late_land dev=fake1 on=1")
				waitFor(t, 10*time.Second, "watchdog broke a path", func() bool { return init.Stats().RDMAStalls > 0 })
				// Not synchronization: each round aborts at another point
				// of the churn.
				time.Sleep(time.Duration(round*40) * time.Millisecond)
				res, err := owner.Abort(testCtx(t, 3*time.Second), rid, []string{init.Name()})
				if err != nil {
					t.Fatal(err)
				}
				if res.Safe {
					fillByte(dst, reusedByte)
				}
				r := waitBatch(t, b, 60*time.Second)[0]
				old := settledOldBytes(t, dst)
				st := init.Stats()
				t.Logf("abort %+v; task %v; stalls %d failovers %d; old bytes after reuse %d", res, r.Status, st.RDMAStalls, st.RDMAFailovers, old)
				if res.Safe && old != 0 {
					t.Fatalf("Safe abort, then %d bytes of the aborted request landed in the reused range", old)
				}
			})
		}
	}
}

// A TRANSPORT message that does not decode is counted and logged as
// malformed; a sound one is answered and counts nothing, and a sound one
// refused here (a QP that cannot reach the peer's address) is logged as
// refused, with its cause, and counts nothing. Every handshake error used
// to be logged as "dropped malformed", so an unreachable address read as
// a hostile peer.
func TestRDMAHandshakeCountsOnlyMalformedMessagesAsMalformed(t *testing.T) {
	lc := &lineCounter{lines: map[string]int{}}
	owner := newEngineWith(t, rdmaOpts(t, engine.Options{Logger: slog.New(lc)}))
	f := newFakeInitiator(t, owner.Name(), "127.0.0.1:7")
	reply := func(corr uint64) control.MsgType {
		t.Helper()
		for {
			env, _, ok := f.recv(t, 10*time.Second)
			if !ok {
				t.Fatalf("no answer to TRANSPORT %d", corr)
			}
			if env.Corr == corr {
				return env.Type
			}
		}
	}
	before := owner.Stats().ControlDropped
	// The rdma transport's info request: kind 1 at its wire version, 3.
	f.send(t, control.MsgTransport, 1, []byte{1, 3})
	if got := reply(1); got != control.MsgTransportRep {
		t.Fatalf("a sound info request was answered %v", got)
	}
	if got := owner.Stats().ControlDropped; got != before {
		t.Fatalf("a sound request counted %d malformed messages", got-before)
	}
	// A sound connect request whose GID names no device the fake can
	// reach: the owner's QP cannot be connected, as on soft-RoCE when the
	// peer's address has no route. Refused, logged as such, not counted.
	connect := []byte{2, 3, 1, 0, 0, 0, 0, 0, 0, 0, 1} // kind, version, conn 1, one pair
	connect = append(connect, 0, 0, 0, 1, 3)           // slot, local, remote NIC 0, Ethernet, MTU 1024
	connect = append(connect, 1, 0, 0, 0, 1, 0, 0, 0)  // QPN 1, PSN 1
	connect = append(connect, 0, 0)                    // LID
	connect = append(connect, bytes.Repeat([]byte{0xaa}, 16)...)
	f.send(t, control.MsgTransport, 2, connect)
	if got := reply(2); got != control.MsgError {
		t.Fatalf("a connect to an unreachable GID was answered %v", got)
	}
	if got := owner.Stats().ControlDropped; got != before {
		t.Fatalf("a refused sound connect counted %d malformed messages", got-before)
	}
	if n := lc.count("rdma handshake refused"); n != 1 {
		t.Fatalf("%d lines say the handshake was refused, want 1", n)
	}
	f.send(t, control.MsgTransport, 3, []byte{99, 3})
	if got := reply(3); got != control.MsgError {
		t.Fatalf("a message of an unknown kind was answered %v", got)
	}
	if got := owner.Stats().ControlDropped; got != before+1 {
		t.Fatalf("%d malformed messages counted after one, want 1", got-before)
	}
	if n := lc.count("malformed TRANSPORT"); n != 1 {
		t.Fatalf("%d lines say malformed TRANSPORT, want 1", n)
	}
}
