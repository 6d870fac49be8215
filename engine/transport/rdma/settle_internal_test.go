package rdma

import (
	"bytes"
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/engine/transport/transporttest"
	"github.com/kvferry/kvferry/internal/fakeverbs"
)

// Work flushed on a broken NIC path may still land (the fake in late-land
// mode places flushed work requests, as a real NIC's packets already sent
// may land), so its request stays uncertain, and no drain of it may be
// promised, until the owner has answered the reconnect of the broken slot:
// the owner moves the responder QP of that slot to the error state before
// it answers, and nothing of the old QP lands after that. Here the
// reconnect is held back: the request must stay uncertain for as long as
// it is held, and become certain once it went through, with not one byte
// landing after that. Taking a flush for a drain (never marking the work)
// fails the first check; settling before the owner's answer fails it too.
func TestFlushedWorkIsUncertainUntilTheOwnerReplacedTheBrokenQP(t *testing.T) {
	fakeverbs.NeedFake(t, "fault injection: delay and late_land")
	const size, rid, peer = 8 << 20, 88, "owner:1"
	lib, devices := fakeverbs.Library(t), fakeverbs.Devices("")
	ownerReg, initReg := memory.NewRegistry(), memory.NewRegistry()
	owner, err := New(Options{Library: lib, Devices: devices,
		Exchange: func(context.Context, string, []byte) ([]byte, error) {
			return nil, errors.New("the owner dials nobody")
		}})
	if err != nil {
		t.Fatalf("owner transport: %v", err)
	}
	t.Cleanup(func() { _ = owner.Close() })
	if _, err := owner.Listen(transporttest.NewOwner(ownerReg)); err != nil {
		t.Fatalf("listen: %v", err)
	}
	ownerReg.Watch(owner)
	var hold atomic.Bool
	var held atomic.Int64
	init, err := New(Options{Library: lib, Devices: devices,
		Exchange: func(ctx context.Context, _ string, body []byte) ([]byte, error) {
			if len(body) > 0 && body[0] == kindConnect && hold.Load() {
				held.Add(1)
				return nil, errors.New("connect held by the test")
			}
			return owner.Serve("initiator:1", body)
		}})
	if err != nil {
		t.Fatalf("initiator transport: %v", err)
	}
	t.Cleanup(func() { _ = init.Close() })
	initReg.Watch(init)

	region := func(reg *memory.Registry) ([]byte, *memory.Region) {
		mem, _, err := memory.Alloc(size)
		if err != nil {
			t.Fatal(err)
		}
		regs, err := reg.Register([]memory.Range{{Mem: mem, Location: "cpu"}})
		if err != nil {
			t.Fatal(err)
		}
		// Unregistered before the transports close (cleanups run last
		// first), so no NIC touches freed memory.
		t.Cleanup(func() { _ = memory.Free(mem) })
		t.Cleanup(func() { _, _ = reg.Unregister([]uint64{regs[0].Addr}) })
		return mem, regs[0]
	}
	dst, dreg := region(ownerReg)
	src, sreg := region(initReg)
	const mark = 0xab
	for i := range src {
		src[i] = mark
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	ep, err := init.Dial(ctx, peer, "initiator:1")
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	t.Cleanup(func() { _ = ep.Close() })

	// 5 ms per 64 KiB: a 1 MiB work request takes 80 ms to place, longer
	// than a cancel's grace, after which the pairs holding it are flushed.
	fakeverbs.Control(t, "delay dev=fake0 us=5000;delay dev=fake1 us=5000;late_land dev=fake0 on=1;late_land dev=fake1 on=1")
	done := make(chan error, 1)
	s := &transport.Slice{Op: transport.Write, Local: src, LocalReg: sreg, Key: dreg.Key, Remote: dreg.Addr,
		RequestID: rid, Extent: transport.Span{Addr: dreg.Addr, Len: size},
		Done: func(_ *transport.Slice, err error) { done <- err }}
	s.Reset()
	ep.Post([]*transport.Slice{s})
	landed := func() int { return bytes.Count(dst, []byte{mark}) }
	if !transporttest.WaitFor(10*time.Second, func() bool { return landed() > 0 }) {
		t.Fatal("no byte landed")
	}
	hold.Store(true)
	if err := ep.(transport.SliceCanceler).Cancel(ctx, []*transport.Slice{s}); err != nil {
		t.Fatalf("cancel: %v", err)
	}
	atCancel := landed()
	if !transporttest.WaitFor(10*time.Second, func() bool { return held.Load() > 0 }) {
		t.Fatal("no broken pair tried to reconnect")
	}
	// Every reconnect is held: the flushed work may still land.
	if !init.Uncertain(peer, rid) {
		t.Fatalf("request %d is certain while the broken QPs it was posted on are not replaced (%d reconnects held)", rid, held.Load())
	}
	// Stays so while held (a reconnect is retried within a second).
	heldBefore := held.Load()
	if !transporttest.WaitFor(10*time.Second, func() bool { return held.Load() > heldBefore }) {
		t.Fatal("no reconnect retried")
	}
	if !init.Uncertain(peer, rid) {
		t.Fatalf("request %d became certain while its reconnects are still held", rid)
	}
	hold.Store(false)
	if !transporttest.WaitFor(10*time.Second, func() bool { return !init.Uncertain(peer, rid) }) {
		t.Fatalf("request %d still uncertain 10 s after the reconnects were let through", rid)
	}
	atSettle := landed()
	// Nothing lands after: wait for 250 ms without a change, as long as
	// the fake would take to place what was flushed.
	last, since := atSettle, time.Now()
	transporttest.WaitFor(10*time.Second, func() bool {
		if n := landed(); n != last {
			last, since = n, time.Now()
		}
		return time.Since(since) >= 250*time.Millisecond
	})
	t.Logf("%d bytes landed at the cancel, %d when the request settled, %d after; %d reconnects held; reconnects %d",
		atCancel, atSettle, last, held.Load(), init.Stats().Reconnects)
	if last != atSettle {
		t.Fatalf("%d bytes landed after the request settled", last-atSettle)
	}
}
