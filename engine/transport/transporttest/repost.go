package transporttest

// Slices an aborted path failed may be posted again on another path, and
// then move their data.

import (
	"bytes"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
)

// testRepostAfterAbort does what the engine does with a slice that failed
// on a broken path: its Done resets it and posts it again on another path.
// The aborted path must never touch it again: it ends exactly once on each
// path, and its data arrives through the second.
func testRepostAfterAbort(t *testing.T, f Factory) {
	e := newEnv(t, f)
	second := f(t, e.owner)
	owner := e.alloc(e.ownerReg, 32*mib, 71)
	local := e.alloc(e.initReg, 48*mib, 72)
	tail := e.tail(owner, local, 16)
	// The tail is reposted from its first Done; the head is not.
	type outcome struct {
		first, second error
		calls         atomic.Int32
		done          chan struct{}
	}
	outcomes := make([]*outcome, len(tail))
	for i, s := range tail {
		o := &outcome{done: make(chan struct{})}
		outcomes[i] = o
		s.Done = func(ts *transport.Slice, err error) {
			switch o.calls.Add(1) {
			case 1:
				o.first = err
				ts.Reset()
				go second.Post([]*transport.Slice{ts})
			case 2:
				o.second = err
				close(o.done)
			}
		}
	}
	head, release := e.stalled(t, owner, local, tail)
	ownerWant := bytes.Clone(owner.all)
	e.abort(t, release)
	if !wait(t, head, doneTimeout) {
		e.leak.Store(true)
		t.FailNow()
	}
	for i, o := range outcomes {
		select {
		case <-o.done:
		case <-time.After(doneTimeout):
			e.leak.Store(true)
			t.Fatalf("slice %s did not end on the second endpoint (Done called %d times)", tail[i].name, o.calls.Load())
		}
	}
	e.barrierOn(second)
	e.checkAgainLater(func() {
		for i, o := range outcomes {
			if n := o.calls.Load(); n != 2 {
				t.Errorf("slice %s: Done called %d times over two endpoints, want 2", tail[i].name, n)
			}
		}
	})
	for i, o := range outcomes {
		s := tail[i]
		if !errors.Is(o.first, transport.ErrConnection) {
			t.Errorf("slice %s ended on the aborted endpoint with %v; want an error matching transport.ErrConnection", s.name, o.first)
		}
		if o.second != nil {
			t.Errorf("slice %s failed when posted again: %v", s.name, o.second)
		}
		lo := GuardLen + int(s.Remote-owner.reg.Addr)
		ll := GuardLen + int(memory.AddrOf(s.Local)-local.reg.Addr)
		if s.Op == transport.Write {
			copy(ownerWant[lo:lo+len(s.Local)], local.all[ll:ll+len(s.Local)])
		}
		compare(t, "data of reposted "+s.name, owner.all[lo:lo+len(s.Local)], local.all[ll:ll+len(s.Local)])
	}
	// The tail's owner range: only the reposted WRITEs changed it.
	compare(t, "owner memory under the tail", ownerWant[GuardLen+16*mib:], owner.all[GuardLen+16*mib:])
	if second.Dead() {
		t.Errorf("the second endpoint died")
	}
}
