package engine_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/engine/control"
)

// FreeBuffer unregisters every registration inside the buffer, also parts
// the caller registered again, before it unmaps it: a later transfer naming
// that memory fails instead of touching unmapped memory.
func TestFreeBufferUnregistersPartsRegisteredAgain(t *testing.T) {
	e := newEngine(t)
	buf, err := e.AllocBuffer(1<<20, "cpu")
	if err != nil {
		t.Fatal(err)
	}
	other := alloc(t, e, 1<<16)
	before := e.Stats().Registrations
	if err := e.UnregisterMemory(engine.AddrOf(buf)); err != nil {
		t.Fatal(err)
	}
	if _, err := e.RegisterMemory(buf[4096:], "cpu"); err != nil {
		t.Fatal(err)
	}
	if err := e.FreeBuffer(engine.AddrOf(buf)); err != nil {
		t.Fatal(err)
	}
	if got := e.Stats().Registrations; got != before-1 {
		t.Fatalf("%d registrations after FreeBuffer, want %d", got, before-1)
	}
	self, _ := e.OpenSegment(context.Background(), e.Name())
	_, err = e.Transfer(context.Background(), []engine.Request{{Op: engine.Write, Local: engine.AddrOf(other), Segment: self,
		Remote: engine.AddrOf(buf) + 4096, Length: 4096}})
	if !errors.Is(err, engine.ErrNotRegistered) {
		t.Fatalf("transfer into freed memory: %v, want ErrNotRegistered", err)
	}
}

// A failed OpenSegment leaves no control socket behind.
func TestFailedOpensLeaveNoSockets(t *testing.T) {
	e := newEngine(t)
	fds := func() int { d, _ := os.ReadDir("/proc/self/fd"); return len(d) }
	before := fds()
	for p := 0; p < 30; p++ {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		_, err := e.OpenSegment(ctx, fmt.Sprintf("127.0.0.1:%d", 1+p))
		cancel()
		if err == nil {
			t.Fatal("opened a segment nobody serves")
		}
	}
	// The count is the process's: judged once, by the wait (a second
	// reading can catch a socket of the runtime's or another engine's
	// passing through).
	if !waitUntil(2*time.Second, func() bool { return fds() <= before+2 }) {
		t.Fatalf("%d file descriptors after 30 failed opens, %d before", fds(), before)
	}
}

// stallingResolver answers the first fetch, then stalls until ctx ends.
type stallingResolver struct {
	peer  *engine.Engine
	calls atomic.Int32
}

func (r *stallingResolver) Resolve(ctx context.Context, name string) (*control.Descriptor, error) {
	if r.calls.Add(1) == 1 {
		return r.peer.Descriptor(), nil
	}
	<-ctx.Done()
	return nil, ctx.Err()
}

// A Transfer waiting for another caller's descriptor refresh still returns
// by its own deadline.
func TestTransferWaitingOnARefreshKeepsItsDeadline(t *testing.T) {
	peer := newEngine(t)
	r := &stallingResolver{peer: peer}
	e := newEngineWith(t, engine.Options{Resolver: r})
	local := alloc(t, e, 1<<16)
	seg, err := e.OpenSegment(context.Background(), peer.Name())
	if err != nil {
		t.Fatal(err)
	}
	req := []engine.Request{{Op: engine.Write, Local: engine.AddrOf(local), Segment: seg, Remote: 0x1000, Length: 64}}
	go func() { // a refresh holding the turn for 3 s
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		_, _ = e.Transfer(ctx, req)
	}()
	// The refresh holds the turn once it called the resolver a second time
	// (the first call was OpenSegment's).
	waitFor(t, 10*time.Second, "the refresh to reach the resolver", func() bool { return r.calls.Load() >= 2 })
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	if _, err := e.Transfer(ctx, req); err == nil {
		t.Fatal("transfer to an unregistered remote range succeeded")
	}
	if took := time.Since(start); took > time.Second {
		t.Fatalf("Transfer with a 100 ms deadline returned after %v", took)
	}
}
