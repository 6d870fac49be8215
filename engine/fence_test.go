package engine_test

// Fences by memory range (SAFETY.md promise 7) in one process, on tcp, local
// and fake rdma: a writer passing no request id streams into owner pages,
// the owner fences them mid-transfer and reuses them at once. With the
// protection off the old bytes land in the reused pages; with it on none do,
// the old transfer ends refused as fenced, and the next request's transfer
// into the same pages, planned after the fence, completes. tests/pd runs the
// same rows across processes, with the writer paused and killed.

import (
	"bytes"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/internal/fakeverbs"
)

const newByte = 0x3C

// fenceRig is one row's owner, writer and the owner pages the writer fills.
type fenceRig struct {
	owner, init *engine.Engine
	seg         *engine.Segment
	dst, src    []byte
}

func newFenceRig(t *testing.T, proto string, unsafe bool, size int) *fenceRig {
	t.Helper()
	testing := engine.Testing{UnsafeFence: unsafe}
	r := &fenceRig{}
	switch proto {
	case "tcp":
		// Each 64 KiB frame waits 2 ms at the owner: the WRITE lands
		// over about 256 ms.
		testing.ApplyDelay = 2 * time.Millisecond
		r.owner = newEngineWith(t, engine.Options{Testing: testing})
		r.init = newEngineWith(t, engine.Options{SliceSize: 64 << 10})
	case "shm":
		// As tcp: each 64 KiB slice waits 2 ms at the owner after its
		// admission, before the owner copies it.
		testing.ApplyDelay = 2 * time.Millisecond
		r.owner = newEngineWith(t, engine.Options{Protocol: "shm", Testing: testing})
		r.init = newEngineWith(t, engine.Options{Protocol: "shm", SliceSize: 64 << 10})
	case "local":
		testing.LocalChunkDelay = 8 * time.Millisecond
		r.owner = newEngineWith(t, engine.Options{Testing: testing})
		r.init = r.owner
	case "rdma":
		r.owner = newEngineWith(t, rdmaOpts(t, engine.Options{Testing: testing}))
		r.init = newEngineWith(t, rdmaOpts(t, engine.Options{}))
		if !fakeverbs.Real() {
			// 64 KiB chunks, 3 ms apart. Soft-RoCE in the emulated
			// guest is slow enough as it is.
			fakeControl(t, "delay dev=fake0 us=3000;delay dev=fake1 us=3000")
		}
	}
	r.dst, r.src = alloc(t, r.owner, size), alloc(t, r.init, size)
	r.seg = openSegment(t, r.init, r.owner.Name())
	return r
}

// settle waits until nothing lands in b any more: the old transfer's task
// has ended; over rdma the fake may still place work it holds.
func settle(t *testing.T, proto string, b []byte) int {
	t.Helper()
	if proto == "rdma" {
		return settledOldBytes(t, b)
	}
	return bytes.Count(b, []byte{oldByte})
}

func TestFenceRowsOfSafetyMD(t *testing.T) { fenceRows(t, "tcp", "local", "shm") }

// The rdma rows, on the fake provider or, with KVFERRY_TEST_RDMA=1, on this
// machine's devices (tests/rxe runs them on soft-RoCE).
func TestRDMAFenceRowsOfSafetyMD(t *testing.T) { fenceRows(t, "rdma") }

func fenceRows(t *testing.T, protos ...string) {
	size := 32 << 20
	if fakeverbs.Real() {
		size = 64 << 20
	}
	for _, proto := range protos {
		for _, unsafe := range []bool{true, false} {
			name := proto + "/protection on"
			if unsafe {
				name = proto + "/protection off"
			}
			t.Run(name, func(t *testing.T) {
				r := newFenceRig(t, proto, unsafe, size)
				fillByte(r.src, oldByte)
				// The writer passes no request id, as SGLang's and vLLM's
				// Mooncake wrappers do.
				old := submit(t, r.init, write(r.src, r.seg, engine.AddrOf(r.dst), size))
				waitFor(t, 10*time.Second, "first bytes landed", func() bool { return bytes.IndexByte(r.dst, oldByte) >= 0 })
				res := requireSafeFence(t, r.owner, r.dst)
				// The pages go to the next request at once.
				fillByte(r.dst, reusedByte)
				oldRes := waitBatch(t, old, 60*time.Second)[0]
				corrupt := settle(t, proto, r.dst)
				t.Logf("old task %v after %d bytes (%v); %d old bytes in the reused pages; fence epoch %d, told %v, acked %v, cut %v",
					oldRes.Status, oldRes.Transferred, oldRes.Err, corrupt, res.Epoch, res.Told, res.Acked, res.Cut)
				if unsafe {
					if corrupt == 0 {
						t.Fatal("with the fence off no old byte landed in the reused pages: the protected row proves nothing")
					}
					return
				}
				if corrupt != 0 {
					t.Fatalf("%d bytes of a transfer planned before the fence landed after it returned Safe", corrupt)
				}
				if oldRes.Status == engine.Completed || !errors.Is(oldRes.Err, engine.ErrFenced) {
					t.Errorf("old task %v, %v; want it refused as fenced", oldRes.Status, oldRes.Err)
				}
				// The normal flow: the writer hears of the pages after the
				// fence returned, and its next transfer into them passes.
				fillPattern(r.src, 7)
				transfer(t, r.init, 60*time.Second, write(r.src, r.seg, engine.AddrOf(r.dst), size))
				requireEqual(t, "the next request's pages", r.dst, r.src)
				if proto != "local" && !contains(res.Acked, r.init.Name()) {
					// Fence waits FenceGrace for ACKs and no longer: a
					// writer slower than that (soft-RoCE in an emulated
					// guest) acknowledges after the call, and the owner
					// counts that late ACK as its own.
					if !contains(res.Told, r.init.Name()) {
						t.Errorf("fence told %v; want the writer %s", res.Told, r.init.Name())
					}
					waitFor(t, 10*time.Second, "the writer's FENCE_ACK", func() bool { return r.owner.Stats().FenceAcks >= 1 })
				}
				if st := r.owner.Stats(); st.FencesSafe != 1 || st.FenceEpoch != res.Epoch {
					t.Errorf("owner stats: %d safe fences at epoch %d; want 1 at %d", st.FencesSafe, st.FenceEpoch, res.Epoch)
				}
				if proto == "rdma" && len(res.Cut) == 0 {
					t.Errorf("no rdma initiator cut: the writer held rkeys for the whole registration")
				}
			})
		}
	}
}

func contains(names []string, n string) bool {
	for _, x := range names {
		if x == n {
			return true
		}
	}
	return false
}

// A READ planned before a fence never reads what the owner put in the
// pages after Fence returned: the reader's buffer holds no byte of the
// next request.
func TestFenceStopsReadsOfTheFencedPages(t *testing.T) { fenceReads(t, "local") }

// The same over rdma (fake provider, or real devices under tests/rxe).
func TestRDMAFenceStopsReadsOfTheFencedPages(t *testing.T) { fenceReads(t, "rdma") }

func fenceReads(t *testing.T, protos ...string) {
	size := 16 << 20
	if fakeverbs.Real() {
		size = 64 << 20
	}
	for _, proto := range protos {
		t.Run(proto, func(t *testing.T) {
			r := newFenceRig(t, proto, false, size)
			fillByte(r.dst, oldByte)
			fillByte(r.src, 0)
			rd := submit(t, r.init, read(r.src, r.seg, engine.AddrOf(r.dst), size))
			waitFor(t, 10*time.Second, "first bytes read", func() bool { return bytes.IndexByte(r.src, oldByte) >= 0 })
			requireSafeFence(t, r.owner, r.dst)
			fillByte(r.dst, reusedByte)
			got := waitBatch(t, rd, 60*time.Second)[0]
			if proto == "rdma" {
				settledOldBytes(t, r.src)
			}
			if n := bytes.Count(r.src, []byte{reusedByte}); n != 0 {
				t.Fatalf("a READ planned before the fence read %d bytes the owner wrote after it returned Safe", n)
			}
			if got.Status == engine.Completed {
				t.Errorf("the READ completed although the fence struck in its middle: %+v", got)
			}
		})
	}
}

// Transfers to ranges the fence does not name, in flight while it strikes,
// complete untouched, and so does a transfer of a request id into the
// fenced pages planned after it.
func TestFenceLeavesOtherRangesAlone(t *testing.T) {
	const size = 8 << 20
	r := newFenceRig(t, "tcp", false, 2*size)
	fenced, other := r.dst[:size], r.dst[size:]
	fillPattern(r.src, 3)
	b := submit(t, r.init, write(r.src[size:], r.seg, engine.AddrOf(other), size))
	waitFor(t, 10*time.Second, "first bytes landed", func() bool { return !bytes.Equal(other[:4096], make([]byte, 4096)) })
	res, err := r.owner.Fence(testCtx(t, 20*time.Second), []engine.FenceRange{{Addr: engine.AddrOf(fenced), Len: size}})
	if err != nil || !res.Safe {
		t.Fatalf("fence = %+v, %v", res, err)
	}
	if got := waitBatch(t, b, 60*time.Second)[0]; got.Status != engine.Completed {
		t.Fatalf("a transfer to unfenced pages ended %v (%v)", got.Status, got.Err)
	}
	requireEqual(t, "unfenced pages", other, r.src[size:])
	transfer(t, r.init, 30*time.Second, withRID(write(r.src[:size], r.seg, engine.AddrOf(fenced), size), 42, 0))
	requireEqual(t, "fenced pages after the fence", fenced, r.src[:size])
}

func TestFenceArgumentsAreChecked(t *testing.T) {
	e := newEngine(t)
	buf := alloc(t, e, 1<<20)
	a := engine.AddrOf(buf)
	ctx := testCtx(t, 5*time.Second)
	for _, c := range []struct {
		name   string
		ranges []engine.FenceRange
		want   error
	}{
		{"no ranges", nil, engine.ErrInvalidArg},
		{"empty range", []engine.FenceRange{{Addr: a, Len: 0}}, engine.ErrInvalidArg},
		{"wrapping range", []engine.FenceRange{{Addr: ^uint64(0) - 10, Len: 100}}, engine.ErrInvalidArg},
		{"unregistered memory", []engine.FenceRange{{Addr: a + 1<<20, Len: 4096}}, engine.ErrNotRegistered},
		{"partly registered", []engine.FenceRange{{Addr: a + 1<<20 - 4096, Len: 8192}}, engine.ErrNotRegistered},
	} {
		if res, err := e.Fence(ctx, c.ranges); !errors.Is(err, c.want) {
			t.Errorf("%s: Fence = %+v, %v; want %v", c.name, res, err, c.want)
		}
	}
	first := e.Stats().FenceEpoch
	if res, err := e.Fence(ctx, []engine.FenceRange{{Addr: a, Len: 4096}, {Addr: a + 8192, Len: 4096}}); err != nil || !res.Safe || res.Epoch != first+1 {
		t.Fatalf("fence of registered pages = %+v, %v; want Safe at epoch %d", res, err, first+1)
	}
}

// An Abort that names an initiator writing into our memory without request
// ids says, once, that it does not stop those transfers and that a fence
// does; an initiator that always passes ids causes no such line.
func TestAbortOfAnInitiatorWritingWithoutIDsPointsToFence(t *testing.T) {
	lc := &lineCounter{lines: map[string]int{}}
	owner := newEngineWith(t, engine.Options{Logger: slog.New(lc)})
	withIDs, without := newEngine(t), newEngine(t)
	dst := alloc(t, owner, 1<<20)
	for _, w := range []*engine.Engine{withIDs, without} {
		src := alloc(t, w, 1<<20)
		req := write(src, openSegment(t, w, owner.Name()), engine.AddrOf(dst), 1<<20)
		if w == withIDs {
			req = withRID(req, 9, 0)
		}
		transfer(t, w, 30*time.Second, req)
	}
	const line = "abort names an initiator that writes into this engine's memory without request ids"
	for i := 0; i < 3; i++ {
		if res, err := owner.Abort(testCtx(t, 10*time.Second), 9+uint64(i), []string{withIDs.Name()}); err != nil || !res.Safe {
			t.Fatalf("abort = %+v, %v", res, err)
		}
	}
	if n := lc.count(line); n != 0 {
		t.Fatalf("%d warnings for an initiator that passes request ids", n)
	}
	for i := 0; i < 3; i++ {
		if res, err := owner.Abort(testCtx(t, 10*time.Second), 20+uint64(i), []string{without.Name()}); err != nil || !res.Safe {
			t.Fatalf("abort = %+v, %v", res, err)
		}
	}
	if n := lc.count(line); n != 1 {
		t.Fatalf("%d warnings for an initiator that writes without request ids; want exactly 1", n)
	}
}

// A peer that fetched the owner's descriptor and went away is not told of
// later fences, nor waited for: only peers holding a control connection
// are, so a departed prefill never costs each fence its grace.
func TestFenceTellsOnlyConnectedPlanners(t *testing.T) {
	owner, stays, leaves := newEngine(t), newEngine(t), newEngine(t)
	dst := alloc(t, owner, 1<<20)
	openSegment(t, stays, owner.Name())
	openSegment(t, leaves, owner.Name())
	if err := leaves.Close(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the departed peer's control connection closed", func() bool { return owner.Stats().ControlConns == 1 })
	res, err := owner.Fence(testCtx(t, 10*time.Second), []engine.FenceRange{{Addr: engine.AddrOf(dst), Len: 4096}})
	if err != nil || !res.Safe {
		t.Fatalf("fence = %+v, %v", res, err)
	}
	if len(res.Told) != 1 || res.Told[0] != stays.Name() || len(res.Acked) != 1 {
		t.Fatalf("told %v, acked %v; want only %s, which stayed", res.Told, res.Acked, stays.Name())
	}
}
