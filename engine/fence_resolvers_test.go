package engine_test

// The fence by memory range (SAFETY.md promise 7) against descriptors that
// lag it: a cluster store that hands out the descriptor published once, a
// descriptor fetch that overtakes the fence notice, and this engine's own
// Submit whose plan waits on a descriptor fetch while it fences. Each test
// failed before the protection its comment describes was built.

import (
	"bytes"
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/engine/control"
)

// storeResolver is a cluster store (etcd and the like, what the Resolver
// interface exists for): it hands out the descriptor the owner published
// once, at registration. Such a store lags every fence the owner makes
// afterwards; the README says so ("a descriptor from a Resolver's store may
// be older than the fence").
type storeResolver struct {
	name string
	d    atomic.Pointer[control.Descriptor]
}

func (r *storeResolver) Resolve(ctx context.Context, name string) (*control.Descriptor, error) {
	if name != r.name {
		return nil, errors.New("storeResolver knows only " + r.name)
	}
	return r.d.Load(), nil
}

// A refresh that sees a descriptor whose FenceEpoch is below the one the
// initiator holds resets everything the initiator knows of the owner's
// fences (segment.go refresh: "a lower epoch is a restart we missed ... or
// a descriptor overtaken by a FENCE"), down to the descriptor's epoch. With
// a Resolver whose store lags (published at registration, FenceEpoch 0),
// every refresh throws away the epoch the initiator learned from the FENCE
// notice, the PONGs and askFenceEpoch, and the next transfer is stamped 0.
// And a refresh comes after every fence refusal (finish sets Segment.stale),
// so once one stale transfer is refused the segment is poisoned for good:
// every later transfer into the fenced pages, planned after Fence returned
// and after the initiator acknowledged the fence, is refused as fenced,
// sets stale again, and the next one refreshes and resets again. The
// heartbeats' and askFenceEpoch's Learn never win, since each submit
// refreshes first. Promise 7: "in the normal flow ... the next request's
// transfers never fail because of the fence".
//
// Here a WRITE without a request id lands slowly in the owner's pages; the
// owner fences them mid-WRITE (Safe, the writer acknowledges); the old
// WRITE is refused, as it should be. Then three next requests into the same
// pages, each planned after Fence returned: all are refused.
func TestFenceAStaleStoreDoesNotMakeTheFencedPagesUnwritable(t *testing.T) {
	const size = 16 << 20
	owner := newEngineWith(t, engine.Options{Testing: engine.Testing{ApplyDelay: 2 * time.Millisecond}})
	dst := alloc(t, owner, size)
	store := &storeResolver{name: owner.Name()}
	store.d.Store(owner.Descriptor()) // published once, at registration
	init := newEngineWith(t, engine.Options{SliceSize: 64 << 10, Resolver: store})
	src := alloc(t, init, size)
	seg := openSegment(t, init, owner.Name())

	fillByte(src, oldByte)
	old := submit(t, init, write(src, seg, engine.AddrOf(dst), size))
	waitFor(t, 10*time.Second, "first bytes landed", func() bool { return bytes.IndexByte(dst, oldByte) >= 0 })
	res := requireSafeFence(t, owner, dst)
	t.Logf("fence epoch %d told %v acked %v", res.Epoch, res.Told, res.Acked)
	got := waitBatch(t, old, 60*time.Second)[0]
	t.Logf("old WRITE: %v after %d bytes (%v)", got.Status, got.Transferred, got.Err)
	if got.Status == engine.Completed {
		t.Skip("the old WRITE completed before the fence: nothing was refused, no refresh follows")
	}

	// Fence returned: the owner hands the pages to the next requests and
	// tells the writer, which acknowledged the fence already.
	failed := 0
	for i := range 3 {
		fillPattern(src, uint64(20+i))
		res, err := init.Transfer(testCtx(t, 30*time.Second), []engine.Request{write(src, seg, engine.AddrOf(dst), size)})
		if err != nil {
			failed++
			t.Logf("next request %d (planned after Fence returned): %v", i, err)
			continue
		}
		if res[0].Status != engine.Completed {
			failed++
			continue
		}
		requireEqual(t, "the next request's pages", dst, src)
	}
	if failed > 0 {
		t.Fatalf("%d of 3 next requests into the fenced pages, planned after Fence returned, failed: each refresh from the store (FenceEpoch %d) reset the fence epoch %d the initiator had learned, and each refusal brings another refresh",
			failed, store.d.Load().FenceEpoch, res.Epoch)
	}
}

// gatedResolver hands out the peer's current descriptor, but once armed
// its next Resolve waits (a slow etcd, a GET_DESCRIPTOR in flight) until
// released.
type gatedResolver struct {
	peer    *engine.Engine
	armed   atomic.Bool
	entered chan struct{}
	release chan struct{}
}

func (r *gatedResolver) Resolve(ctx context.Context, name string) (*control.Descriptor, error) {
	if name != r.peer.Name() {
		return nil, errors.New("gatedResolver knows only " + r.peer.Name())
	}
	if r.armed.CompareAndSwap(true, false) {
		close(r.entered)
		select {
		case <-r.release:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return r.peer.Descriptor(), nil
}

// cancelOwnTasks cancels only the tasks it
// finds listed in a live batch. A Submit called before Fence whose tasks
// are not listed yet is missed: Batch.Submit plans (resolves remote keys,
// which may fetch the descriptor again) before it stamps and lists its
// tasks, and the fetch can take up to the Submit's ctx. So a READ this
// engine submitted into its own pages before it fenced them lands in them
// after Fence returned Safe, in pages already handed to the next request.
// Nothing decided by what anyone issued: the READ's local memory carries no
// stamp, and Fence never waits for Submits in progress.
//
// Here the engine submits a READ from a peer buffer registered after the
// segment was opened (so the plan refreshes the descriptor; the Resolver
// holds that fetch), fences its own landing pages while the Submit is in
// its plan, and reuses them once Fence says Safe; then the fetch returns.
// Fence may instead report not Safe (it could wait for the Submit); it must
// not report Safe and let the READ land.
func TestFenceStopsTheEnginesOwnTransfersBeingSubmitted(t *testing.T) {
	const size = 4 << 20
	peer := newEngineWith(t, engine.Options{})
	gate := &gatedResolver{peer: peer, entered: make(chan struct{}), release: make(chan struct{})}
	e := newEngineWith(t, engine.Options{Resolver: gate})
	into := alloc(t, e, size)
	seg := openSegment(t, e, peer.Name())
	from := alloc(t, peer, size) // not in e's cached descriptor: the plan refreshes it
	fillByte(from, oldByte)

	gate.armed.Store(true)
	b, err := e.AllocateBatch(1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Cancel(); _ = b.Free() })
	submitted := make(chan error, 1)
	go func() {
		submitted <- b.Submit(testCtx(t, time.Minute), []engine.Request{read(into, seg, engine.AddrOf(from), size)})
	}()
	<-gate.entered // the Submit is planning: called, not yet listed

	res, err := e.Fence(testCtx(t, 5*time.Second), []engine.FenceRange{{Addr: engine.AddrOf(into), Len: size}})
	if err != nil {
		t.Fatal(err)
	}
	close(gate.release)
	if !res.Safe {
		t.Logf("fence not Safe (%v): the application does not reuse the pages", res.Reason)
		if err := <-submitted; err == nil {
			waitBatch(t, b, 60*time.Second)
		}
		return
	}
	fillByte(into, reusedByte) // Safe: the pages go to the next request
	if err := <-submitted; err != nil {
		t.Logf("submit: %v", err)
	} else {
		got := waitBatch(t, b, 60*time.Second)[0]
		t.Logf("READ submitted before the fence: %v, %d bytes (%v)", got.Status, got.Transferred, got.Err)
	}
	if n := bytes.Count(into, []byte{oldByte}); n != 0 {
		t.Fatalf("%d bytes of a READ submitted before Fence landed in the fenced pages after Fence returned Safe", n)
	}
}

// lateResolver models a GET_DESCRIPTOR answered just before a fence and
// taken by the initiator just after the FENCE notice (the notice's handler
// runs on the plane's loop, the refresh on the submitter's goroutine):
// once armed, its next Resolve reads the owner's descriptor, then returns
// it only after the initiator handled a FENCE.
type lateResolver struct {
	owner   *engine.Engine
	init    atomic.Pointer[engine.Engine]
	armed   atomic.Bool
	fetched chan struct{}
}

func (r *lateResolver) Resolve(ctx context.Context, name string) (*control.Descriptor, error) {
	if name != r.owner.Name() {
		return nil, errors.New("lateResolver knows only " + r.owner.Name())
	}
	d := r.owner.Descriptor()
	if r.armed.CompareAndSwap(true, false) {
		close(r.fetched)
		for r.init.Load().Stats().FencesReceived == 0 {
			select {
			case <-ctx.Done():
				return nil, ctx.Err()
			case <-time.After(time.Millisecond): // polling a condition
			}
		}
	}
	return d, nil
}

// The reset on a lower descriptor epoch fires in the very race its comment
// names ("a descriptor overtaken by a FENCE"), and that race is the normal
// flow of a busy writer: a refresh (here for pages the owner registered
// after the segment was opened) fetches the descriptor just before a fence
// of other pages and stores it just after the writer applied the FENCE
// and acknowledged it. The reset throws the fence away: the writer stamps
// its next transfers with the older epoch, and the next request into the
// fenced pages, which the owner handed out only after Fence returned (with
// the writer among Acked), is refused. "Starting afresh costs at most a
// refusal" is exactly what promise 7 rules out: "the next request's
// transfers never fail because of the fence".
func TestFenceADescriptorOvertakenByTheNoticeDoesNotUndoIt(t *testing.T) {
	const size = 1 << 20
	owner := newEngineWith(t, engine.Options{})
	late := &lateResolver{owner: owner, fetched: make(chan struct{})}
	init := newEngineWith(t, engine.Options{Resolver: late})
	late.init.Store(init)
	dst, src := alloc(t, owner, size), alloc(t, init, size)
	seg := openSegment(t, init, owner.Name())
	fillByte(src, oldByte)
	transfer(t, init, 30*time.Second, write(src, seg, engine.AddrOf(dst), size)) // the room's pages, written

	other := alloc(t, owner, size) // registered later: the next plan refreshes
	late.armed.Store(true)
	wrote := make(chan error, 1)
	go func() {
		_, err := init.Transfer(testCtx(t, 30*time.Second), []engine.Request{write(src, seg, engine.AddrOf(other), size)})
		wrote <- err
	}()
	<-late.fetched // the descriptor is read, fence epoch 0

	res := requireSafeFence(t, owner, dst)
	if err := <-wrote; err != nil {
		t.Fatalf("the WRITE into other pages: %v", err)
	}
	t.Logf("fence epoch %d told %v acked %v", res.Epoch, res.Told, res.Acked)
	// Fence returned: the owner hands dst to the next request.
	fillPattern(src, 31)
	got, err := init.Transfer(testCtx(t, 30*time.Second), []engine.Request{write(src, seg, engine.AddrOf(dst), size)})
	if err != nil || got[0].Status != engine.Completed {
		t.Fatalf("the next request's WRITE into the fenced pages, planned after Fence returned and after the writer acknowledged the fence, failed: %v", err)
	}
	requireEqual(t, "the next request's pages", dst, src)
}
