package tcp

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/engine/transport/transporttest"
)

// goAwayPair is an owner with idle timeout idle serving one buffer, and an
// initiator's endpoint to it.
type goAwayPair struct {
	owner, init *Transport
	ep          transport.Endpoint
	dst         []byte // owner memory
	key         memory.Key
	src         []byte // initiator memory
	srcReg      *memory.Region
}

func newGoAwayPair(t *testing.T, idle time.Duration) *goAwayPair {
	t.Helper()
	p := &goAwayPair{dst: make([]byte, 4096), src: make([]byte, 4096)}
	regs, err := memory.NewRegistry().Register([]memory.Range{{Mem: p.src}})
	if err != nil {
		t.Fatal(err)
	}
	p.srcReg = regs[0]
	ownerReg := memory.NewRegistry()
	if regs, err = ownerReg.Register([]memory.Range{{Mem: p.dst}}); err != nil {
		t.Fatal(err)
	}
	p.key = regs[0].Key
	p.owner = New(Options{IdleTimeout: idle})
	addr, err := p.owner.Listen(transporttest.NewOwner(ownerReg))
	if err != nil {
		t.Fatal(err)
	}
	p.init = New(Options{})
	t.Cleanup(func() { _ = p.init.Close(); _ = p.owner.Close() })
	if p.ep, err = p.init.Dial(context.Background(), addr, "init:1"); err != nil {
		t.Fatal(err)
	}
	return p
}

// write posts a WRITE of the initiator's buffer, filled with v, and returns
// the slice and where its outcome arrives.
func (p *goAwayPair) write(v byte) (*transport.Slice, chan error) {
	for i := range p.src {
		p.src[i] = v
	}
	done := make(chan error, 1)
	s := &transport.Slice{Op: transport.Write, Local: p.src, LocalReg: p.srcReg, Key: p.key, Remote: memory.AddrOf(p.dst),
		Done: func(_ *transport.Slice, err error) { done <- err }}
	p.ep.Post([]*transport.Slice{s})
	return s, done
}

func outcome(t *testing.T, done chan error) error {
	t.Helper()
	select {
	case err := <-done:
		return err
	case <-time.After(10 * time.Second):
		t.Fatal("slice never ended")
	}
	return nil
}

// An owner closes an idle connection with GOAWAY; the initiator's path then
// ends, and a slice posted to it after that ends with ErrUnsent (wrapped in
// ErrConnection): the engine posts it again without spending a retry.
func TestIdlePathEndsWithGoAway(t *testing.T) {
	p := newGoAwayPair(t, 300*time.Millisecond)
	if _, done := p.write(1); outcome(t, done) != nil {
		t.Fatal("the first WRITE failed")
	}
	deadline := time.Now().Add(10 * time.Second)
	for !p.ep.Dead() {
		if time.Now().After(deadline) {
			t.Fatalf("the idle path is still alive after 10s (owner %+v)", p.owner.Stats())
		}
		time.Sleep(time.Millisecond)
	}
	if o, i := p.owner.Stats(), p.init.Stats(); o.IdleClosed != 1 || i.GoAways != 1 {
		t.Fatalf("owner stats %+v, initiator stats %+v: want 1 idle close and 1 GOAWAY", o, i)
	}
	_, done := p.write(2)
	if err := outcome(t, done); !errors.Is(err, transport.ErrUnsent) || !errors.Is(err, transport.ErrConnection) {
		t.Fatalf("a slice posted to the idled-out path ended with %v, want ErrUnsent and ErrConnection", err)
	}
}

// A WRITE the initiator sends at the moment the owner finds the connection
// idle crosses the owner's GOAWAY: the owner has not read it and never
// applies it, and the initiator learns that from the GOAWAY, so the slice
// ends with ErrUnsent rather than as a plain connection failure.
func TestRequestCrossingGoAwayIsUnsent(t *testing.T) {
	idle, proceed := make(chan struct{}), make(chan struct{})
	hook := func() {
		close(idle)
		<-proceed
	}
	testHookGoAway.Store(&hook)
	t.Cleanup(func() { testHookGoAway.Store(nil) })
	p := newGoAwayPair(t, 300*time.Millisecond)
	if _, done := p.write(1); outcome(t, done) != nil {
		t.Fatal("the first WRITE failed")
	}
	select {
	case <-idle:
	case <-time.After(10 * time.Second):
		t.Fatal("the owner did not find the connection idle within 10s")
	}
	s, done := p.write(2)
	deadline := time.Now().Add(10 * time.Second)
	for s.State() != transport.StateSent {
		if time.Now().After(deadline) {
			t.Fatalf("the WRITE was not sent within 10s (state %d)", s.State())
		}
		time.Sleep(time.Millisecond)
	}
	close(proceed)
	if err := outcome(t, done); !errors.Is(err, transport.ErrUnsent) || !errors.Is(err, transport.ErrConnection) {
		t.Fatalf("a WRITE crossing the owner's GOAWAY ended with %v, want ErrUnsent and ErrConnection", err)
	}
	if p.dst[0] != 1 || p.owner.Stats().BytesIn != uint64(len(p.dst)) {
		t.Fatalf("the owner applied the WRITE it said it had not read (byte %d, %d bytes in)", p.dst[0], p.owner.Stats().BytesIn)
	}
}
