package local_test

import (
	"context"
	"runtime/pprof"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/engine/transport/local"
	"github.com/kvferry/kvferry/engine/transport/transporttest"
)

// TestConformance runs the transport suite over the local transport.
func TestConformance(t *testing.T) {
	transporttest.Run(t, func(t *testing.T, owner transport.Owner) transport.Endpoint {
		tr := local.New(owner, "self")
		t.Cleanup(func() { _ = tr.Close() })
		ep, err := tr.Dial(context.Background(), "", "self")
		if err != nil {
			t.Fatalf("dial: %v", err)
		}
		t.Cleanup(func() { _ = ep.Close() })
		return ep
	})
}

// TestUnregisterDuringCopiesWithinOneEngine covers what the suite cannot,
// since it keeps the initiator's memory in a registry of its own: the local
// transport's initiator and owner are one engine, so both ranges of a copy
// live in one registry, and can be one range. Each chunk pins the owner
// range and then the initiator range; the copy is paused (through the
// owner's Enter hook) right after the first pin, as the scheduler may pause
// it, while the ranges are unregistered. Unregister must return and the
// slices must end.
func TestUnregisterDuringCopiesWithinOneEngine(t *testing.T) {
	const half = 2 << 20 // above the inline limit, so Post copies on a goroutine of its own
	cases := []struct {
		name string
		// ranges returns the registered ranges and the slices' (local,
		// remote) range indexes.
		ranges int
		pairs  [][2]int
	}{
		{"a copy between two halves of one registered range", 1, [][2]int{{0, 0}}},
		{"copies in opposite directions between two ranges unregistered at once", 2, [][2]int{{0, 1}, {1, 0}}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			reg := memory.NewRegistry()
			owner := transporttest.NewOwner(reg)
			tr := local.New(owner, "self")
			ep, err := tr.Dial(context.Background(), "", "self")
			if err != nil {
				t.Fatalf("dial: %v", err)
			}
			stuck := false
			var mems [][]byte
			t.Cleanup(func() {
				if stuck {
					return // the copies hang on the pins: nothing may be closed or unmapped
				}
				_ = ep.Close()
				_ = tr.Close()
				for _, m := range mems {
					_ = memory.Free(m)
				}
			})
			var regions []*memory.Region
			for range tc.ranges {
				mem, _, err := memory.Alloc(2 * half)
				if err != nil {
					t.Fatalf("alloc: %v", err)
				}
				mems = append(mems, mem)
				rs, err := reg.Register([]memory.Range{{Mem: mem, Location: "cpu"}})
				if err != nil {
					t.Fatalf("register: %v", err)
				}
				regions = append(regions, rs[0])
			}

			// Pause each copy in its first chunk, right after it pinned
			// the owner's range.
			var pinned sync.WaitGroup
			pinned.Add(len(tc.pairs))
			proceed := make(chan struct{})
			var paused atomic.Int32
			owner.OnEnter(func() {
				if paused.Add(1) <= int32(len(tc.pairs)) {
					pinned.Done()
					<-proceed
				}
			})
			var done sync.WaitGroup
			var calls atomic.Int32
			for _, p := range tc.pairs {
				l, r := regions[p[0]], regions[p[1]]
				s := &transport.Slice{
					Op: transport.Write, Local: mems[p[0]][:half], LocalReg: l,
					Key: r.Key, Remote: r.Addr + half,
					Done: func(*transport.Slice, error) { calls.Add(1); done.Done() },
				}
				s.Reset()
				done.Add(1)
				go ep.Post([]*transport.Slice{s})
			}
			if !within(5*time.Second, pinned.Wait) {
				t.Fatalf("the copies never started")
			}

			// Each range is unregistered by a caller of its own; each
			// Unregister now waits for the pin a paused copy holds.
			var unregistered sync.WaitGroup
			for _, r := range regions {
				unregistered.Add(1)
				go func() {
					defer unregistered.Done()
					if _, err := reg.Unregister([]uint64{r.Addr}); err != nil {
						t.Errorf("unregister: %v", err)
					}
				}()
			}
			// Each Unregister marks its region dead before it waits for the
			// pins: once every region is dead, every Unregister is pending.
			for deadline := time.Now().Add(5 * time.Second); !allDead(regions); time.Sleep(100 * time.Microsecond) {
				if time.Now().After(deadline) {
					t.Fatalf("the Unregisters never began")
				}
			}
			close(proceed)
			if !within(2*time.Second, unregistered.Wait) {
				stuck = true
				var b strings.Builder
				_ = pprof.Lookup("goroutine").WriteTo(&b, 1)
				t.Logf("goroutines:\n%s", b.String())
				t.Fatalf("Unregister hangs: a copy holding one range's pin waits for another pin behind a pending Unregister (local.go pins the owner's range, then the initiator's, around each chunk)")
			}
			if !within(5*time.Second, done.Wait) {
				stuck = true
				t.Fatalf("the slices never ended")
			}
			if n := calls.Load(); n != int32(len(tc.pairs)) {
				t.Errorf("Done called %d times for %d slices", n, len(tc.pairs))
			}
		})
	}
}

// within runs wait and reports whether it returned before timeout.
func within(timeout time.Duration, wait func()) bool {
	c := make(chan struct{})
	go func() {
		wait()
		close(c)
	}()
	select {
	case <-c:
		return true
	case <-time.After(timeout):
		return false
	}
}

// allDead reports whether every region's Unregister has begun.
func allDead(regions []*memory.Region) bool {
	for _, r := range regions {
		if !r.Dead() {
			return false
		}
	}
	return true
}
