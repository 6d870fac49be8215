package transporttest

// TryCancel of slices still queued behind a stalled one: a canceled slice's
// memory stays untouched.

import (
	"bytes"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
)

// stalled posts, while the owner admits nothing, two 16 MiB WRITEs and then
// tail: the first WRITE stalls in flight (the owner holds it at admission,
// so a socket fills and its sender blocks) and the tail stays queued behind
// it. It returns the head slices and the owner's release.
func (e *env) stalled(t *testing.T, owner, local *buffer, tail []*slice) (head []*slice, release func()) {
	t.Helper()
	release = e.owner.Hold()
	t.Cleanup(release) // runs before the factory's teardown
	head = []*slice{
		e.newSlice(transport.Write, local, 0, owner, 0, 16*mib),
		e.newSlice(transport.Write, local, 16*mib, owner, 0, 16*mib),
	}
	e.ep.Post(base(append(append([]*slice(nil), head...), tail...)))
	if !waitFor(5*time.Second, func() bool { return e.owner.Waiting.Load() > 0 }) {
		t.Fatalf("the first slice never reached the owner")
	}
	// Not a synchronization the checks rest on: the tail stays queued behind
	// the head while the owner admits nothing, whatever the timing. The
	// pause lets the head's sender fill a socket and block, the harder case
	// for TryCancel and Abort; a slow machine only reaches it later.
	time.Sleep(50 * time.Millisecond)
	return head, release
}

// tail makes small slices away from the head's owner range [0, 16 MiB)
// and local range [0, 32 MiB).
func (e *env) tail(owner, local *buffer, count int) []*slice {
	var ss []*slice
	for i := range count {
		op := transport.Write
		if i%2 == 1 {
			op = transport.Read
		}
		off := 16*mib + i*(128<<10)
		ss = append(ss, e.newSlice(op, local, 32*mib+i*(128<<10), owner, off, 64<<10+i))
	}
	return ss
}

func testTryCancelQueued(t *testing.T, f Factory) {
	e := newEnv(t, f)
	owner := e.alloc(e.ownerReg, 32*mib, 31)
	local := e.alloc(e.initReg, 48*mib, 32)
	ownerBefore, localBefore := bytes.Clone(owner.all), bytes.Clone(local.all)
	tail := e.tail(owner, local, 16)
	head, release := e.stalled(t, owner, local, tail)

	var canceled, kept []*slice
	for i, s := range tail {
		if st := s.State(); st != transport.StateQueued {
			t.Fatalf("setup: tail slice %s is in state %d, not queued, while the owner admits nothing", s.name, st)
		}
		if i%4 == 3 { // keep some, so cancels are shown not to disturb neighbours
			kept = append(kept, s)
			continue
		}
		if !s.TryCancel() {
			t.Errorf("TryCancel of queued slice %s failed", s.name)
			kept = append(kept, s)
			continue
		}
		canceled = append(canceled, s)
	}
	release()
	rest := append(append([]*slice(nil), head...), kept...)
	e.endAll(t, rest)
	for _, s := range rest {
		if s.err != nil {
			t.Errorf("slice %s failed: %v", s.name, s.err)
		}
	}
	for _, s := range canceled {
		if n := s.calls.Load(); n != 0 {
			t.Errorf("canceled slice %s: Done called %d times, want never", s.name, n)
		}
		if st := s.State(); st != transport.StateCanceled {
			t.Errorf("canceled slice %s is in state %d, want StateCanceled", s.name, st)
		}
		lo := GuardLen + int(s.Remote-owner.reg.Addr)
		ll := GuardLen + int(memory.AddrOf(s.Local)-local.reg.Addr)
		if s.Op == transport.Write {
			compare(t, "owner memory of canceled "+s.name, ownerBefore[lo:lo+len(s.Local)], owner.all[lo:lo+len(s.Local)])
		} else {
			compare(t, "initiator memory of canceled "+s.name, localBefore[ll:ll+len(s.Local)], local.all[ll:ll+len(s.Local)])
		}
	}
	for _, s := range kept {
		lo := GuardLen + int(s.Remote-owner.reg.Addr)
		ll := GuardLen + int(memory.AddrOf(s.Local)-local.reg.Addr)
		compare(t, "data of kept "+s.name, owner.all[lo:lo+len(s.Local)], local.all[ll:ll+len(s.Local)])
	}
	// Both head WRITEs covered the same owner range. An endpoint that runs
	// its slices in the order of Post leaves the last one's bytes; one that
	// spreads them across paths (rdma's NIC pairs) runs them at once, so
	// every byte there holds one of the two, and nothing else.
	first, second := local.data[:16*mib], local.data[16*mib:32*mib]
	if !e.owner.Concurrent {
		compare(t, "owner memory under the head WRITEs (the last one posted wins)", second, owner.data[:16*mib])
	} else {
		for i, b := range owner.data[:16*mib] {
			if b != first[i] && b != second[i] {
				t.Errorf("owner memory under the head WRITEs, byte %d: %#x, from neither WRITE (%#x, %#x)", i, b, first[i], second[i])
				break
			}
		}
	}
	compare(t, "guard bytes", ownerBefore[:GuardLen], owner.all[:GuardLen])
	compare(t, "guard bytes", ownerBefore[len(owner.all)-GuardLen:], owner.all[len(owner.all)-GuardLen:])
}
