package engine

import (
	"bytes"
	"context"
	"testing"
	"time"
)

// The engine-level demonstration of
// TestGuardUnderARevokedGrantStaysRefusedAfterTheCapForgetsTheRequest, over
// tcp, where the owner's refusal is the only fence: a WRITE of request R is
// admitted under R's grant and held by the owner (ApplyDelay) before its
// first chunk; the owner revokes the grant (Revoke returns at once: no
// chunk in progress), reuses the range, and goes on granting and revoking
// other requests as the normal flow does. Past MaxTombstones revoked
// request ids, the cap forgets R's state first ("acknowledged") and the
// held WRITE's chunk, admitted under the revoked grant, lands in the
// reused range.
func TestWithdrawnGrantsWriteDoesNotLandOnceTheCapForgetsItsRequest(t *testing.T) {
	for _, how := range []string{"revoke", "abort"} {
		t.Run(how, func(t *testing.T) { withdrawnGrantWrite(t, how) })
	}
}

// withdrawnGrantWrite: how is "revoke" (Revoke the grant, then revoke
// MaxTombstones+1 other requests' grants, the normal flow) or "abort"
// (Abort naming the initiator, Safe at once on tcp, then MaxTombstones+1
// aborts naming no initiator: the abort of R is still unacknowledged, its
// initiator's task held at the owner, when the cap forces it out).
func withdrawnGrantWrite(t *testing.T, how string) {
	const max, rid = 8, 41
	owner, init, seg, dst, src := ownerInitiatorPair(t, Options{MaxTombstones: max, MaxRetries: -1}, 2*time.Second)
	ctx := context.Background()
	fillByte(src[:4096], 0xAA)
	g, err := owner.Grant(init.Name(), rid, []GrantRange{{Addr: AddrOf(dst), Len: 4096}})
	if err != nil {
		t.Fatal(err)
	}
	b, err := init.AllocateBatch(1)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = b.Free() }()
	if err := b.Submit(ctx, []Request{{Op: Write, Local: AddrOf(src), Segment: seg, Remote: AddrOf(dst), Length: 4096,
		RequestID: rid, GrantID: g.ID}}); err != nil {
		t.Fatal(err)
	}
	// Admitted: the owner now sleeps ApplyDelay before its first chunk.
	waitAdmitted(t, owner, init, rid)
	rctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	if how == "revoke" {
		if err := owner.Revoke(rctx, g.ID); err != nil {
			t.Fatalf("revoke: %v", err)
		}
	} else if res, err := owner.Abort(rctx, rid, []string{init.Name()}); err != nil || !res.Safe {
		t.Fatalf("abort = %+v, %v; want Safe (tcp: refusal is the fence)", res, err)
	}
	fillByte(dst[:4096], 0x55) // reused at once: Revoke returned, or Abort returned Safe
	for other := uint64(1000); other < 1000+max+1; other++ {
		if how == "abort" {
			if res, err := owner.Abort(rctx, other, nil); err != nil || !res.Safe {
				t.Fatalf("abort of %d = %+v, %v", other, res, err)
			}
			continue
		}
		og, err := owner.Grant(init.Name(), other, []GrantRange{{Addr: AddrOf(dst) + 8192, Len: 4096}})
		if err != nil {
			t.Fatal(err)
		}
		if err := owner.Revoke(rctx, og.ID); err != nil {
			t.Fatal(err)
		}
	}
	if err := b.Wait(testDeadline(t, 10*time.Second)); err != nil {
		t.Fatal(err)
	}
	r := b.Results()[0]
	if n := bytes.Count(dst[:4096], []byte{0xAA}); n != 0 {
		t.Fatalf("%d bytes of request %d's WRITE, admitted under grant %d before the %s returned, landed in the reused range (task %v, %v; owner table %+v)",
			n, rid, g.ID, how, r.Status, r.Err, owner.reqs.Stats())
	}
	t.Logf("task %v (%v)", r.Status, r.Err)
}

func fillByte(b []byte, v byte) {
	for i := range b {
		b[i] = v
	}
}
