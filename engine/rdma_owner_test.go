package engine_test

// The owner's word on an aborted request over rdma, where the owner's NIC
// moves the bytes without the owner's code (SAFETY.md promise 1): it must
// hold after the initiator forgot the abort, against an initiator the
// abort did not name, and against an initiator that knows the owner by
// another name. Each scenario that can run on tcp runs there too, where
// the owner's refusal is the fence: the transports must agree. They run on
// the fake libibverbs, or with KVFERRY_TEST_RDMA=1 on real devices (slow
// placement then shapes the links, see fakeverbs.SlowPlacement).

import (
	"bytes"
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/engine/control"
	"github.com/kvferry/kvferry/internal/fakeverbs"
)

// ownerRow is one way of running an owner-side scenario: over tcp, or over
// rdma with the owner-side QP fence on or off (off, Safe rests on the
// initiators' drain-aware ABORT_ACK).
type ownerRow struct {
	name    string
	proto   string
	noFence bool
}

var ownerRows = []ownerRow{
	{"rdma fence", "rdma", false},
	{"rdma drain-aware ACK", "rdma", true},
	{"tcp", "tcp", false},
}

// roleOpts completes o for an engine of role ("owner" or "initiator") in
// row: tcp, or rdma on the role's devices.
func roleOpts(t *testing.T, row ownerRow, role string, o engine.Options) engine.Options {
	t.Helper()
	if row.proto == "tcp" {
		o.Protocol = "tcp"
		return o
	}
	if role == "owner" {
		o.RDMANoFence = row.noFence
	}
	o.RDMADevices = fakeverbs.Devices(role)
	return rdmaOpts(t, o)
}

// awaitAbortEvent reads e's events until the EventAborted of rid: the
// initiator has then handled the owner's ABORT (its tombstone is recorded,
// and older ones past MaxTombstones forgotten).
func awaitAbortEvent(t *testing.T, e *engine.Engine, rid uint64) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		ev := nextEvent(t, e, time.Until(deadline))
		if ev.Kind == engine.EventAborted && ev.RequestID == rid {
			return
		}
	}
}

// countDiff counts the bytes where a and b differ.
func countDiff(a, b []byte) int {
	n := 0
	for i := range a {
		if a[i] != b[i] {
			n++
		}
	}
	return n
}

// An owner's abort binds the request id at the owner, however long the
// initiator remembers it. The owner's memory is one registered pool of
// 64 KiB slots; the initiator writes request X into slot 0 and requests
// X+1.. into the others, one transfer each (so every path of the segment
// has used the pool), and completes. The owner aborts X (Safe,
// acknowledged), then aborts the initiator's other requests until the
// initiator's small tombstone table (MaxTombstones 4) forgot X. The owner
// refills X's slot for its next request; the initiator submits X again at
// generation 0, the aborted one. The owner never re-granted X, so it must
// refuse it: the task ends ABORTED and not one byte of the slot changes.
// On tcp the owner's refusal does that; over rdma the owner's NIC must not
// accept a write the owner's code would refuse (an initiator that keeps
// the owner's rkeys per buffer key for the life of its path writes the
// slot without asking the owner).
func TestRDMAOwnerRefusesAnAbortedRequestAfterTheInitiatorForgotTheAbort(t *testing.T) {
	const slot, maxTombs = 64 << 10, 4
	const rid, others = 4242, 2 * maxTombs
	for _, row := range ownerRows {
		t.Run(row.name, func(t *testing.T) {
			owner := newEngineWith(t, roleOpts(t, row, "owner", engine.Options{}))
			init := newEngineWith(t, roleOpts(t, row, "initiator", engine.Options{MaxTombstones: maxTombs}))
			pool, src := alloc(t, owner, (1+others)*slot), alloc(t, init, slot)
			dst := pool[:slot]
			fillPattern(src, 71)
			seg := openSegment(t, init, owner.Name())
			for i := 0; i <= others; i++ {
				transfer(t, init, 30*time.Second, withRID(write(src, seg, engine.AddrOf(pool[i*slot:]), slot), rid+uint64(i), 0))
			}
			requireEqual(t, "slot after the first write of X", dst, src)
			if row.proto == "rdma" && init.Stats().RDMAWorkRequests == 0 {
				t.Fatalf("stats %+v: the writes did not go over rdma", init.Stats())
			}

			abort := func(id uint64) {
				t.Helper()
				res, err := owner.Abort(testCtx(t, 20*time.Second), id, []string{init.Name()})
				if err != nil || !res.Safe {
					t.Fatalf("abort of %d = %+v, %v; want Safe", id, res, err)
				}
				awaitAbortEvent(t, init, id)
			}
			abort(rid)
			// More aborts naming the initiator than its table holds: X's
			// tombstone, the oldest, is forgotten.
			for i := uint64(1); i <= others; i++ {
				abort(rid + i)
			}
			waitFor(t, 20*time.Second, "every abort acknowledged", func() bool {
				st := owner.Stats()
				return st.AbortAcks >= 1+others && st.RDMAFencesPending == 0
			})
			if n := init.Stats().InitiatorTombstones; n > maxTombs {
				t.Fatalf("the initiator remembers %d aborted requests, more than MaxTombstones %d: X's tombstone may not have been forgotten", n, maxTombs)
			}

			// The owner reuses the slot for its next request.
			fillPattern(dst, 72)
			want := bytes.Clone(dst)
			r := waitBatch(t, submit(t, init, withRID(write(src, seg, engine.AddrOf(dst), slot), rid, 0)), 60*time.Second)[0]
			changed := countDiff(dst, want)
			t.Logf("X again at generation 0: task %v after %d bytes (%v); %d bytes of the refilled slot changed; owner fences %d", r.Status, r.Transferred, r.Err, changed, owner.Stats().RDMAFences)
			if changed != 0 || r.Status != engine.Aborted || !errors.Is(r.Err, engine.ErrAborted) {
				t.Fatalf("request %d, aborted by its owner at generation 0 and never re-granted, was written again at generation 0 once the initiator forgot the abort: task %v (%v), %d of %d bytes of the owner's reused slot overwritten; want ABORTED and 0 bytes",
					rid, r.Status, r.Err, changed, slot)
			}
		})
	}
}

// An abort stops its request whoever writes it, not only the initiators
// it names (promise 1: Safe means no further byte of the request lands,
// "whatever the initiators do next"). Initiators A and B both write
// request 77 into the owner, into ranges of their own, slowly, so that
// both are in flight; the owner aborts 77 naming only A. Once Abort
// returned Safe, no further byte of B's write may land in B's range: the
// count of B's bytes there at Abort's return must equal the count once
// placement settled. On tcp the owner refuses every access of 77, B's
// included; over rdma the fence must not be confined to the initiators
// named, nor Safe rest on their ACKs alone.
func TestRDMAAbortStopsAnInitiatorItDoesNotName(t *testing.T) {
	// B writes more than A, so that it is still writing when an abort
	// resting on A's drain-aware ACK returns.
	const sizeA, sizeB, rid = 4 << 20, 32 << 20, 77
	for _, row := range ownerRows {
		t.Run(row.name, func(t *testing.T) {
			oo := engine.Options{}
			if row.proto == "tcp" {
				// The owner applies each WRITE frame 200 ms after admitting
				// it: both writes are in flight when the owner aborts.
				oo.Testing.ApplyDelay = 200 * time.Millisecond
			}
			owner := newEngineWith(t, roleOpts(t, row, "owner", oo))
			// A drained ACK waits for the work B posted before the ABORT:
			// under software emulation (soft-RoCE in qemu) on a busy host
			// that can take longer than the default 5 s, after which B
			// would cut its paths and say so, and a drain-aware abort is
			// then honestly not Safe. The property here is what lands
			// after Safe, not how fast: give the drain room.
			slowDrain := engine.Options{AbortDrainTimeout: 45 * time.Second}
			a := newEngineWith(t, roleOpts(t, row, "initiator", slowDrain))
			b := newEngineWith(t, roleOpts(t, row, "initiator", slowDrain))
			dstA, dstB := alloc(t, owner, sizeA), alloc(t, owner, sizeB)
			srcA, srcB := alloc(t, a, sizeA), alloc(t, b, sizeB)
			fillByte(srcA, oldByte)
			fillByte(srcB, oldByte)
			segA, segB := openSegment(t, a, owner.Name()), openSegment(t, b, owner.Name())
			if row.proto == "rdma" {
				// 64 KiB placed every 5 ms: B's write takes over a second.
				fakeverbs.SlowPlacement(t, 5000)
			}
			batchA := submit(t, a, withRID(write(srcA, segA, engine.AddrOf(dstA), sizeA), rid, 0))
			batchB := submit(t, b, withRID(write(srcB, segB, engine.AddrOf(dstB), sizeB), rid, 0))
			waitFor(t, 20*time.Second, "first bytes of both writes landed", func() bool {
				return bytes.IndexByte(dstA, oldByte) >= 0 && bytes.IndexByte(dstB, oldByte) >= 0
			})

			atCall := bytes.Count(dstB, []byte{oldByte})
			res, err := owner.Abort(testCtx(t, 60*time.Second), rid, []string{a.Name()})
			atReturn := bytes.Count(dstB, []byte{oldByte})
			if err != nil || !res.Safe {
				t.Fatalf("abort of %d naming A = %+v, %v; want Safe", rid, res, err)
			}
			// B must still have been writing when the abort began. It may
			// have landed whole by Abort's return: an abort resting on B's
			// drained ACK waits for every work request B had posted.
			if atCall == sizeB {
				t.Fatalf("B's write had landed whole when Abort was called: placement too fast for this test to show anything")
			}
			ra := waitBatch(t, batchA, 60*time.Second)[0]
			rb := waitBatch(t, batchB, 60*time.Second)[0]
			later := settledOldBytes(t, dstB)
			t.Logf("abort %+v; A's task %v after %d bytes; B's task %v after %d bytes (%v); B's bytes in its range: %d at Abort's return, %d once settled",
				res, ra.Status, ra.Transferred, rb.Status, rb.Transferred, rb.Err, atReturn, later)
			if later != atReturn {
				t.Fatalf("%d bytes of request %d from B, which the abort did not name, landed in the owner's memory after Abort returned Safe (%d at its return, %d once placement settled)",
					later-atReturn, rid, atReturn, later)
			}
		})
	}
}

// aliasResolver answers for the owner's own name and for one alias of it
// (another host:port reaching the same control endpoint, as a cluster
// store or a DNS name may give) with the owner's current descriptor; the
// default resolver refuses a descriptor whose name is not the one asked.
type aliasResolver struct {
	alias string
	owner *engine.Engine
}

func (r aliasResolver) Resolve(ctx context.Context, name string) (*control.Descriptor, error) {
	if name != r.alias && name != r.owner.Name() {
		return nil, errors.New("aliasResolver knows only " + r.alias + " and " + r.owner.Name())
	}
	return r.owner.Descriptor(), nil
}

// The drain-aware ACK holds when the initiator knows the owner by another
// name. The initiator's Resolver maps an alias (localhost:port for the
// owner's 127.0.0.1:port) to the owner's descriptor, and the initiator
// writes request R, slowly, through the segment it opened by the alias.
// While R is in flight the initiator also reaches the owner by its own
// name (an initiator told of the owner by two sources may), so the owner's
// control socket routes its next messages, the ABORT among them, on that
// newer connection: the ABORT comes from the owner's own name, not from
// the name R's segment was opened by. The owner's rdma fence is off, so
// Safe rests on the initiator's ABORT_ACK saying its work of R drained; the
// owner aborts R naming the initiator. Once Abort returned Safe and the
// owner reused its range, no byte of R may land there, and the initiator's
// task ends ABORTED. An initiator that matches an ABORT only against the
// name of the segment finds no task of R and answers "drained" at once
// while R's writes go on.
// aliasedPair starts an rdma owner with ownerOpts and an initiator, on one
// path, that reaches it also by an alias, "localhost:<port>"
// (aliasResolver).
func aliasedPair(t *testing.T, ownerOpts engine.Options) (owner, init *engine.Engine, alias string) {
	t.Helper()
	ownerOpts.RDMADevices = fakeverbs.Devices("owner")
	owner = newEngineWith(t, rdmaOpts(t, ownerOpts))
	_, port, err := net.SplitHostPort(owner.Name())
	if err != nil {
		t.Fatal(err)
	}
	alias = net.JoinHostPort("localhost", port)
	if alias == owner.Name() {
		t.Fatalf("alias %s is the owner's own name", alias)
	}
	init = newEngineWith(t, rdmaOpts(t, engine.Options{
		Resolver: aliasResolver{alias, owner}, RDMADevices: fakeverbs.Devices("initiator"),
		PathsPerPeer: 1, HeartbeatInterval: time.Minute,
	}))
	return owner, init, alias
}

func TestRDMADrainAwareAckHoldsForASegmentOpenedByAnAlias(t *testing.T) {
	const size, rid = 16 << 20, 91
	owner, init, alias := aliasedPair(t, engine.Options{RDMANoFence: true})
	dst, src := alloc(t, owner, size), alloc(t, init, size)
	fillByte(src, oldByte)
	seg := openSegment(t, init, alias)
	// A write without request id into the range over the alias:
	// its path is dialed and knows the range's key.
	const probe = 64 << 10
	transfer(t, init, 30*time.Second, write(src[:probe], seg, engine.AddrOf(dst), probe))
	fillByte(dst, 0)
	// 64 KiB placed every 5 ms: the write takes over a second.
	fakeverbs.SlowPlacement(t, 5000)
	b := submit(t, init, withRID(write(src, seg, engine.AddrOf(dst), size), rid, 0))
	waitFor(t, 20*time.Second, "first bytes landed", func() bool { return bytes.IndexByte(dst, oldByte) >= 0 })
	// R has its rkeys; now the owner's own name, for another range.
	own := openSegment(t, init, owner.Name())
	probeDst, probeSrc := alloc(t, owner, probe), alloc(t, init, probe)
	transfer(t, init, 30*time.Second, write(probeSrc, own, engine.AddrOf(probeDst), probe))

	requireAbortOfAliasedWriteSafe(t, owner, init, b, dst, rid, "segment "+seg.Name()+" opened by the alias "+alias)
}

// requireAbortOfAliasedWriteSafe aborts request rid at owner naming init,
// which writes it in batch b, reuses dst and fails the test when a byte of
// the request lands in dst afterwards or the initiator's task does not end
// ABORTED (the owner aborted its request). how says which segment wrote
// the request.
func requireAbortOfAliasedWriteSafe(t *testing.T, owner, init *engine.Engine, b *engine.Batch, dst []byte, rid uint64, how string) {
	t.Helper()
	res, err := owner.Abort(testCtx(t, 20*time.Second), rid, []string{init.Name()})
	if err != nil || !res.Safe {
		t.Fatalf("abort of %d naming %s = %+v, %v; want Safe", rid, init.Name(), res, err)
	}
	fillByte(dst, reusedByte)
	r := waitBatch(t, b, 60*time.Second)[0]
	old := settledOldBytes(t, dst)
	var from []string
	for len(init.Events()) > 0 {
		if ev := <-init.Events(); ev.Kind == engine.EventAborted {
			from = append(from, ev.Peer)
		}
	}
	t.Logf("R through %s; ABORT heard from %v; abort %+v; task %v after %d bytes (%v); %d bytes of R in the reused range",
		how, from, res, r.Status, r.Transferred, r.Err, old)
	if old != 0 {
		t.Fatalf("%d bytes of request %d landed in the owner's reused range after a Safe abort (ABORT heard from %v, R written through %s)", old, rid, from, how)
	}
	if r.Status != engine.Aborted || !errors.Is(r.Err, engine.ErrAborted) {
		t.Errorf("the initiator's task ended %v (%v); want ABORTED: the owner aborted its request", r.Status, r.Err)
	}
}

// The mirror of TestRDMADrainAwareAckHoldsForASegmentOpenedByAnAlias: the
// request's WRITE goes through the segment opened by the owner's OWN name,
// and the initiator reaches the owner by an alias afterwards, so the
// owner's control socket routes the ABORT on the alias's (newer)
// connection: the initiator hears the ABORT from the alias. A segment
// opened by the alias is known by both names (Segment.knownAs), but the
// segment opened by the own name knows only its own name, so the task
// index misses the task, the drain drains only the alias segment's path
// (which holds nothing of the request) and the initiator answers
// "drained" while the WRITE goes on. With the owner's fence on, the
// drained ACK inside RDMAFenceGrace spares the initiator the fence; with
// it off, Safe rests on that ACK alone. Either way Abort reports Safe and
// bytes of the request land in the reused range.
func TestRDMAAbortHeardFromAnAliasStopsWorkOnTheOwnNameSegment(t *testing.T) {
	for _, row := range []struct {
		name    string
		noFence bool
		grace   time.Duration
	}{
		// A grace long enough for any drained ACK (a control plane
		// slower than loopback needs more than the default 10 ms): the
		// outcome does not depend on how fast the initiator drains.
		{"rdma fence", false, 2 * time.Second},
		{"rdma drain-aware ACK", true, 0},
	} {
		t.Run(row.name, func(t *testing.T) {
			const size, rid = 16 << 20, 93
			owner, init, alias := aliasedPair(t, engine.Options{RDMANoFence: row.noFence, RDMAFenceGrace: row.grace})
			dst, src := alloc(t, owner, size), alloc(t, init, size)
			fillByte(src, oldByte)
			own := openSegment(t, init, owner.Name())
			const probe = 64 << 10
			// A write without request id: the own-name path is dialed
			// (and with it the control connection to the own name).
			transfer(t, init, 30*time.Second, write(src[:probe], own, engine.AddrOf(dst), probe))
			fillByte(dst, 0)
			fakeverbs.SlowPlacement(t, 5000) // 64 KiB every 5 ms: the write takes over a second
			b := submit(t, init, withRID(write(src, own, engine.AddrOf(dst), size), rid, 0))
			waitFor(t, 20*time.Second, "first bytes landed", func() bool { return bytes.IndexByte(dst, oldByte) >= 0 })
			// Now the alias, for another range: its control connection is
			// the newest, and the owner routes the ABORT on it.
			aliasSeg := openSegment(t, init, alias)
			probeDst, probeSrc := alloc(t, owner, probe), alloc(t, init, probe)
			transfer(t, init, 30*time.Second, write(probeSrc, aliasSeg, engine.AddrOf(probeDst), probe))

			if r := b.Results()[0]; r.Status.Final() {
				t.Fatalf("setup: request %d's WRITE ended %v before the abort; nothing would be shown", rid, r.Status)
			}
			requireAbortOfAliasedWriteSafe(t, owner, init, b, dst, rid, "segment "+own.Name()+" opened by the own name")
		})
	}
}
