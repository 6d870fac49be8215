package engine_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
)

// abortPair is an owner (decode) and an initiator (prefill) in one process.
type abortPair struct {
	owner, init *engine.Engine
	seg         *engine.Segment // the owner, opened by the initiator
	dst, src    []byte
}

func newAbortPair(t *testing.T, opts engine.Options, size int) *abortPair {
	t.Helper()
	p := &abortPair{owner: newEngineWith(t, opts), init: newEngineWith(t, opts)}
	var err error
	if p.dst, err = p.owner.AllocBuffer(size, "cpu"); err != nil {
		t.Fatal(err)
	}
	if p.src, err = p.init.AllocBuffer(size, "cpu"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = p.owner.FreeBuffer(engine.AddrOf(p.dst))
		_ = p.init.FreeBuffer(engine.AddrOf(p.src))
	})
	p.seg = openSegment(t, p.init, p.owner.Name())
	return p
}

// requireSafeAbort has p's owner abort request rid naming p's initiator,
// and fails the test unless Abort returns within 10 s and reports Safe. It
// returns how long Abort took.
func (p *abortPair) requireSafeAbort(t *testing.T, rid uint64) time.Duration {
	t.Helper()
	var res engine.AbortResult
	took := within(t, 10*time.Second, "Abort", func() {
		var err error
		if res, err = p.owner.Abort(testCtx(t, 5*time.Second), rid, []string{p.init.Name()}); err != nil {
			t.Errorf("abort: %v", err)
		}
	})
	if !res.Safe {
		t.Fatalf("abort = %+v; want Safe", res)
	}
	return took
}

func TestAbortRefusesLaterWritesAndTellsTheInitiator(t *testing.T) {
	p := newAbortPair(t, engine.Options{}, 4<<20)
	fillByte(p.src, 0xAA)
	const rid = 42
	req := write(p.src, p.seg, engine.AddrOf(p.dst), len(p.src))
	req.RequestID = rid
	transfer(t, p.init, 10*time.Second, req)

	res, err := p.owner.Abort(testCtx(t, 5*time.Second), rid, []string{p.init.Name()})
	if err != nil || !res.Safe {
		t.Fatalf("abort = %+v, %v; want safe", res, err)
	}
	if res.Generation != 1 {
		t.Errorf("generation after abort = %d, want 1", res.Generation)
	}
	select {
	case ev := <-p.init.Events():
		if ev.Kind != engine.EventAborted || ev.RequestID != rid || ev.Peer != p.owner.Name() {
			t.Errorf("event = %+v", ev)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no EventAborted at the initiator")
	}
	fillByte(p.dst, 0)
	res2, err := p.init.Transfer(testCtx(t, 10*time.Second), []engine.Request{req})
	if !errors.Is(err, engine.ErrAborted) || res2[0].Status != engine.Aborted {
		t.Fatalf("transfer after abort = %+v, %v; want ABORTED", res2, err)
	}
	requireAll(t, "owner memory after aborted transfer", p.dst, 0)

	// The new generation is admitted again.
	req.Generation = res.Generation
	if _, err := p.init.Transfer(testCtx(t, 10*time.Second), []engine.Request{req}); err == nil {
		// The initiator keeps its tombstone below generation 1 only.
		if !bytes.Equal(p.dst, p.src) {
			t.Error("write at the new generation did not land")
		}
	} else {
		t.Fatalf("write at the new generation: %v", err)
	}
	waitFor(t, 5*time.Second, "ACK", func() bool { return p.owner.Stats().AbortAcks > 0 })
}

func TestNotifyArrivesAsEvent(t *testing.T) {
	p := newAbortPair(t, engine.Options{}, 1<<20)
	if err := p.init.Notify(testCtx(t, 5*time.Second), p.seg, 7, []byte("done")); err != nil {
		t.Fatal(err)
	}
	var buf [4]engine.Event
	n, err := p.owner.TakeEvents(testCtx(t, 5*time.Second), buf[:])
	if err != nil || n != 1 || buf[0].Kind != engine.EventNotify || string(buf[0].Data) != "done" || buf[0].RequestID != 7 {
		t.Fatalf("TakeEvents = %d %v %+v", n, err, buf[0])
	}

}

func TestTimedOutTransferTellsTheOwner(t *testing.T) {
	p := newAbortPair(t, engine.Options{Testing: engine.Testing{ApplyDelay: 200 * time.Millisecond}}, 8<<20)
	req := write(p.src, p.seg, engine.AddrOf(p.dst), len(p.src))
	req.RequestID = 9
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	res, err := p.init.Transfer(ctx, []engine.Request{req})
	if err == nil || res[0].Status != engine.Timeout {
		t.Fatalf("transfer = %+v, %v; want TIMEOUT", res, err)
	}
	select {
	case ev := <-p.owner.Events():
		if ev.Kind != engine.EventCanceled || ev.RequestID != 9 || ev.Peer != p.init.Name() {
			t.Errorf("event = %+v, want CANCELED of request 9 from %s", ev, p.init.Name())
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the owner was not told")
	}
}

// TestOpenSegmentWhereNothingListensFailsAtOnce: ZMQ would retry the
// connection until the deadline; a refused TCP connect ends it at once.
func TestOpenSegmentWhereNothingListensFailsAtOnce(t *testing.T) {
	e := newEngineWith(t, engine.Options{})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	name := ln.Addr().String()
	_ = ln.Close() // nothing listens there now
	start := time.Now()
	_, err = e.OpenSegment(testCtx(t, 10*time.Second), name)
	if !errors.Is(err, engine.ErrUnreachable) {
		t.Fatalf("open %s: %v, want ErrUnreachable", name, err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("open %s took %v: waited for the deadline", name, d)
	}
}

// Abort refuses request id 0, names that are not segment names and more
// than MaxAbortInitiators initiators; without initiators it is Safe on tcp
// and bumps the generation each time; after Close it is ErrClosed.
func TestAbortArgumentsAndClosedEngine(t *testing.T) {
	e := newEngineWith(t, engine.Options{})
	ctx := testCtx(t, 10*time.Second)
	many := make([]string, engine.MaxAbortInitiators+1)
	for i := range many {
		many[i] = fmt.Sprintf("127.0.0.1:%d", 1000+i)
	}
	for _, c := range []struct {
		what  string
		rid   uint64
		names []string
	}{
		{"request id 0", 0, nil},
		{"a name without a port", 1, []string{"nohost"}},
		{"an empty name", 1, []string{""}},
		{"a name of 256 bytes", 1, []string{strings.Repeat("h", 251) + ":1234"}},
		{"a bad name after a good one", 1, []string{"127.0.0.1:1", "x"}},
		{fmt.Sprintf("%d initiators", len(many)), 1, many},
	} {
		res, err := e.Abort(ctx, c.rid, c.names)
		if !errors.Is(err, engine.ErrInvalidArg) {
			t.Errorf("abort with %s: %+v, %v; want ErrInvalidArg", c.what, res, err)
		}
	}
	if st := e.Stats(); st.Tombstones != 0 || st.AbortsSafe != 0 || st.AbortsNotSafe != 0 {
		t.Errorf("refused aborts left state: %+v", st)
	}
	for gen := uint32(1); gen <= 2; gen++ {
		res, err := e.Abort(ctx, 1, nil)
		if err != nil || !res.Safe || res.Reason != nil || res.Generation != gen || len(res.Acked) != 0 {
			t.Errorf("abort %d without initiators = %+v, %v; want Safe at generation %d", gen, res, err, gen)
		}
	}
	if st := e.Stats(); st.Tombstones != 1 || st.AbortsSafe != 2 {
		t.Errorf("after two aborts of one request: %d tombstones, %d safe", st.Tombstones, st.AbortsSafe)
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Abort(ctx, 1, nil); !errors.Is(err, engine.ErrClosed) {
		t.Errorf("abort after Close: %v, want ErrClosed", err)
	}
	if _, err := e.Grant("127.0.0.1:1", 1, []engine.GrantRange{{Addr: 4096, Len: 4096}}); !errors.Is(err, engine.ErrClosed) {
		t.Errorf("grant after Close: %v, want ErrClosed", err)
	}
	if err := e.Revoke(ctx, 1); !errors.Is(err, engine.ErrClosed) {
		t.Errorf("revoke after Close: %v, want ErrClosed", err)
	}
}

// Abort with a deadline far shorter than the transfer in flight (1 ms, or
// already past) returns by it plus a generous bound (a hang is the bug, not
// slowness). It may report Safe, and then the reused range stays intact, or
// not Safe with ErrTimeout; never Safe early.
func TestAbortWithATinyDeadlineReturnsByIt(t *testing.T) {
	size := 256 << 20
	if testing.Short() {
		size = 64 << 20
	}
	const bound = time.Second
	for _, tc := range []struct {
		name   string
		expiry time.Duration // relative to the call; <= 0: already expired
	}{{"1ms", time.Millisecond}, {"expired", -time.Second}} {
		t.Run(tc.name, func(t *testing.T) {
			const rid = 909
			p := newAbortPair(t, engine.Options{}, size)
			fillByte(p.src, oldByte)
			b := submit(t, p.init, withRID(write(p.src, p.seg, engine.AddrOf(p.dst), size), rid, 0))
			waitFor(t, 30*time.Second, "first bytes applied", func() bool {
				r, _ := b.Status(0)
				return p.owner.Stats().OwnerBytesIn > 0 || r.Status.Final()
			})
			start := time.Now()
			deadline := start.Add(tc.expiry)
			ctx, cancel := context.WithDeadline(context.Background(), deadline)
			defer cancel()
			var res engine.AbortResult
			var err error
			within(t, 30*time.Second, "Abort", func() { res, err = p.owner.Abort(ctx, rid, []string{p.init.Name()}) })
			// Past the deadline, or past the call for a deadline already gone.
			late := time.Since(deadline)
			if deadline.Before(start) {
				late = time.Since(start)
			}
			t.Logf("Abort returned %v after its deadline: safe %v, reason %v", late, res.Safe, res.Reason)
			if err != nil {
				t.Fatalf("abort: %v", err)
			}
			if late > bound {
				t.Errorf("Abort returned %v after its deadline (bound %v): a sync call must return by its deadline", late, bound)
			}
			if !res.Safe {
				if !errors.Is(res.Reason, engine.ErrTimeout) {
					t.Errorf("not safe with reason %v, want ErrTimeout", res.Reason)
				}
				waitBatch(t, b, 60*time.Second)
				return
			}
			fillByte(p.dst, reusedByte)
			r := waitBatch(t, b, 60*time.Second)[0]
			t.Logf("task %v after %d bytes", r.Status, r.Transferred)
			requireAll(t, "range reused after Safe", p.dst, reusedByte)
		})
	}
}
