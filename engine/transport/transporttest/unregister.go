package transporttest

// Unregistration during a copy: once Unregister returns, no byte of the
// region is touched, on the owner's side or the initiator's.

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
)

// testUnregisterInFlight: the owner unregisters the memory large WRITEs
// are landing in. After Unregister returns no byte of it may change.
func testUnregisterInFlight(t *testing.T, f Factory) {
	e, ss := unregisterDuringCopies(t, f, transport.Write)
	ok, refused := 0, 0
	for _, s := range ss {
		switch {
		case s.err == nil:
			ok++
		case errors.Is(s.err, transport.ErrRefused) && !transport.Retryable(s.err):
			refused++
		default:
			t.Errorf("slice %s failed with %q; want success or a final refusal", s.name, s.err)
		}
	}
	t.Logf("%d WRITEs completed, %d refused; %d chunks entered", ok, refused, e.owner.Enters.Load())
	if refused == 0 {
		t.Logf("every WRITE completed before Unregister: nothing was in flight this time")
	}
	if e.ep.Dead() {
		t.Errorf("the endpoint died of an unregistration; its refusals end slices, not the path")
	}
}

// testUnregisterLocalInFlight is testUnregisterInFlight from the other side:
// the initiator unregisters the memory large READs are landing in. After
// Unregister returns no byte of it may change.
func testUnregisterLocalInFlight(t *testing.T, f Factory) {
	_, ss := unregisterDuringCopies(t, f, transport.Read)
	ok, failed := 0, 0
	for _, s := range ss {
		if s.err == nil {
			ok++
		} else {
			failed++
			if failed == 1 {
				t.Logf("first failure: %v (retryable: %v)", s.err, transport.Retryable(s.err))
			}
		}
	}
	t.Logf("%d READs completed, %d failed", ok, failed)
}

// unregisterDuringCopies posts eight 16 MiB slices of op and unregisters
// the memory they land in (the owner's for WRITEs, the initiator's for
// READs) while they are copied; each half of that range alternately gets
// 0x11 and 0x22, so any byte landing after Unregister changes memory, which
// it checks. It returns the slices once they all ended.
func unregisterDuringCopies(t *testing.T, f Factory, op transport.Op) (*env, []*slice) {
	e := newEnv(t, f)
	const half = 16 * mib
	owner, local := e.alloc(e.ownerReg, 2*half, 21), e.alloc(e.initReg, 2*half, 22)
	src, dst, reg, side, name := local, owner, e.ownerReg, "owner", "WRITE"
	if op == transport.Read {
		src, dst, reg, side, name = owner, local, e.initReg, "initiator", "READ"
	}
	fillHalves(src, half)
	var ss []*slice
	for i := range 8 {
		srcOff, dstOff := ((i/2)%2)*half, (i%2)*half
		if op == transport.Write {
			ss = append(ss, e.newSlice(op, local, srcOff, owner, dstOff, half))
		} else {
			ss = append(ss, e.newSlice(op, local, dstOff, owner, srcOff, half))
		}
	}
	after := e.unregisterMidCopy(t, ss, reg, dst, name)
	compare(t, side+" memory after Unregister returned", after, dst.all)
	return e, ss
}

// unregisterMidCopy posts ss, waits until their copies are under way,
// unregisters b from reg while they are, and returns b's bytes as they
// stood when Unregister returned; before it returns every slice ended, once,
// and the path worked past them (barrier).
func (e *env) unregisterMidCopy(t *testing.T, ss []*slice, reg *memory.Registry, b *buffer, op string) (after []byte) {
	t.Helper()
	e.ep.Post(base(ss))
	// Wait for the first chunks to land, so the unregistration strikes
	// while a copy is under way.
	inFlight := waitFor(5*time.Second, func() bool {
		select {
		case <-ss[len(ss)-1].done:
			return true
		default:
		}
		return e.owner.Enters.Load() >= 2 || e.owner.progress() >= 2
	})
	if !inFlight {
		e.leak.Store(true)
		t.Fatalf("the %ss neither started nor ended within 5 s", op)
	}
	unregistered := make(chan error, 1)
	go func() {
		_, err := reg.Unregister([]uint64{b.reg.Addr})
		unregistered <- err
	}()
	select {
	case err := <-unregistered:
		if err != nil {
			t.Fatalf("unregister: %v", err)
		}
	case <-time.After(10 * time.Second):
		e.leak.Store(true)
		dumpGoroutines(t)
		t.Fatalf("Unregister hangs for 10 s while a %s is in flight", op)
	}
	after = bytes.Clone(b.all)
	e.endAll(t, ss)
	return after
}

// fillHalves fills b's first half bytes with 0x11 and the next with 0x22.
func fillHalves(b *buffer, half int) {
	for i := range b.data[:half] {
		b.data[i] = 0x11
	}
	for i := range b.data[half : 2*half] {
		b.data[half+i] = 0x22
	}
}
