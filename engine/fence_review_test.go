package engine_test

// A hostile review of the fence by memory range (SAFETY.md promise 7). Each
// test fails on the code it was written against, for the reason its comment
// gives, and passes once that is fixed.

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/engine/control"
)

// The owner takes an access's fence epoch on the initiator's word and lets
// any stamp at or above its own epoch through, including a stamp it never
// issued. An initiator's known epoch for an owner only ever rises (Learn,
// Apply), and is reset only when the owner's tcp address changes, so once
// it is above the owner's, every transfer the initiator plans to that owner
// passes every fence the owner makes until the owner's epoch catches up:
// "planned before" is no longer decided by what the owner issued.
//
// Here a peer on the control network claims the owner's name (the plane
// takes the ZMTP identity as given, as it does for ABORT) and sends the
// initiator a well-formed FENCE of epoch 2^64-1 for one byte the owner does
// not even have. The initiator's next WRITE, planned well before the
// owner's real Fence, is stamped 2^64-1; the owner fences the pages, Fence
// reports Safe, the owner reuses them, and the old WRITE goes on landing.
// (The same stamp from the future arises without a hostile peer when an
// owner restarts and its descriptor keeps the tcp address, or when a late
// FENCE of the old incarnation is handled after the segment's Reset.)
func TestFenceReviewStampAboveTheOwnersEpochPassesItsFence(t *testing.T) {
	const size = 16 << 20
	r := newFenceRig(t, "tcp", false, size)
	spoof := newFakeInitiator(t, r.init.Name(), r.owner.Name())
	spoof.send(t, control.MsgFence, 0, control.FenceMsg{Epoch: ^uint64(0), Ranges: []control.FenceRange{{Addr: 1, Len: 1}}}.Encode())
	waitFor(t, 10*time.Second, "the forged FENCE handled", func() bool { return r.init.Stats().FencesReceived == 1 })

	fillByte(r.src, oldByte)
	old := submit(t, r.init, write(r.src, r.seg, engine.AddrOf(r.dst), size))
	waitFor(t, 10*time.Second, "first bytes landed", func() bool { return bytes.IndexByte(r.dst, oldByte) >= 0 })
	res, err := r.owner.Fence(testCtx(t, 20*time.Second), []engine.FenceRange{{Addr: engine.AddrOf(r.dst), Len: size}})
	if err != nil || !res.Safe {
		t.Fatalf("fence = %+v, %v; want Safe", res, err)
	}
	fillByte(r.dst, reusedByte)
	got := waitBatch(t, old, 60*time.Second)[0]
	corrupt := bytes.Count(r.dst, []byte{oldByte})
	t.Logf("owner epoch %d; old WRITE %v after %d bytes (%v); %d of its bytes in the reused pages", res.Epoch, got.Status, got.Transferred, got.Err, corrupt)
	if corrupt != 0 {
		t.Fatalf("%d bytes of a WRITE planned before the fence landed after Fence returned Safe: the owner passed a stamp (2^64-1) it never issued", corrupt)
	}
	if got.Status == engine.Completed {
		t.Errorf("the WRITE planned before the fence completed: %+v", got)
	}
}

var _ = errors.Is
