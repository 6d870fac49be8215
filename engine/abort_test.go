package engine_test

import (
	"bytes"
	"context"
	"errors"
	"net"
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
	within(t, 5*time.Second, "ACK", func() {
		for p.owner.Stats().AbortAcks == 0 {
			time.Sleep(time.Millisecond)
		}
	})
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
