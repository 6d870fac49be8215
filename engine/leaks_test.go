package engine_test

// Engines leak no goroutines or file descriptors.

import (
	"context"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
)

func countFDs(t *testing.T) (int, []string) {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatalf("read /proc/self/fd: %v", err)
	}
	var names []string
	for _, e := range ents {
		l, _ := os.Readlink(filepath.Join("/proc/self/fd", e.Name()))
		names = append(names, e.Name()+" -> "+l)
	}
	sort.Strings(names)
	// One entry is the directory ReadDir itself had open.
	return len(ents) - 1, names
}

func TestEnginesLeakNoGoroutinesOrFileDescriptors(t *testing.T) {
	cycle := func() {
		t.Helper()
		a, err := engine.New(engine.Options{IgnoreEnv: true, Protocol: "tcp"})
		if err != nil {
			t.Fatal(err)
		}
		defer a.Close()
		b, err := engine.New(engine.Options{IgnoreEnv: true, Protocol: "tcp"})
		if err != nil {
			t.Fatal(err)
		}
		defer b.Close()
		const n = 8 << 20
		bufs := make([][]byte, 0, 4)
		for _, e := range []*engine.Engine{a, a, b, b} {
			m, err := e.AllocBuffer(n, "cpu")
			if err != nil {
				t.Fatal(err)
			}
			bufs = append(bufs, m)
		}
		fillPattern(bufs[0], 5)
		fillPattern(bufs[2], 6)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		segB, err := a.OpenSegment(ctx, b.Name())
		if err != nil {
			t.Fatal(err)
		}
		segA, err := b.OpenSegment(ctx, a.Name())
		if err != nil {
			t.Fatal(err)
		}
		self, err := a.OpenSegment(ctx, a.Name())
		if err != nil {
			t.Fatal(err)
		}
		transfer(t, a, 30*time.Second, write(bufs[0], segB, engine.AddrOf(bufs[3]), n))
		transfer(t, b, 30*time.Second, read(bufs[2], segA, engine.AddrOf(bufs[0]), n))
		transfer(t, a, 30*time.Second, write(bufs[0], self, engine.AddrOf(bufs[1]), n))
		// A refused transfer leaves nothing behind either.
		if _, err := a.Transfer(ctx, []engine.Request{write(bufs[0], segB, engine.AddrOf(bufs[3])+1, n)}); err == nil {
			t.Fatal("out-of-range transfer succeeded")
		}
		if err := a.CloseSegment(segB); err != nil {
			t.Fatal(err)
		}
		if _, err := a.OpenSegment(ctx, b.Name()); err != nil {
			t.Fatal(err)
		}
		requireEqual(t, "a's copy", bufs[1], bufs[0])
		if err := a.Close(); err != nil {
			t.Errorf("close a: %v", err)
		}
		if err := b.Close(); err != nil {
			t.Errorf("close b: %v", err)
		}
		for i, e := range []*engine.Engine{a, a, b, b} {
			if err := e.FreeBuffer(engine.AddrOf(bufs[i])); err != nil {
				t.Errorf("free buffer %d: %v", i, err)
			}
		}
	}
	requireNoLeaks(t, cycle)
}

// requireNoLeaks runs cycle once to warm up the runtime's and libzmq's
// one-time state, then three times more, and fails the test when
// goroutines or open file descriptors (counted by the process, not by the
// engine) outnumber those before, after a settling time.
func requireNoLeaks(t *testing.T, cycle func()) {
	t.Helper()
	cycle() // warm up the runtime's and libzmq's one-time state
	settle := func(g0, f0 int) (int, int) {
		var g, f int
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			g = runtime.NumGoroutine()
			f, _ = countFDs(t)
			if (g <= g0 && f <= f0) || time.Now().After(deadline) {
				return g, f
			}
		}
	}
	g0, f0 := settle(runtime.NumGoroutine(), 1<<30)
	_, fdsBefore := countFDs(t)
	for range 3 {
		cycle()
	}
	g, f := settle(g0, f0)
	reportLeaks(t, "closing the engines", g0, g, f0, f, fdsBefore)
	t.Logf("goroutines %d -> %d, fds %d -> %d", g0, g, f0, f)
}

// reportLeaks fails the test when more goroutines (g against g0) or file
// descriptors (f against f0) are left after what than before, with the
// goroutines' stacks and both descriptor lists.
func reportLeaks(t *testing.T, after string, g0, g, f0, f int, fdsBefore []string) {
	t.Helper()
	if g > g0 {
		buf := make([]byte, 1<<20)
		buf = buf[:runtime.Stack(buf, true)]
		t.Errorf("goroutines: %d before, %d after %s\n%s", g0, g, after, buf)
	}
	if f > f0 {
		_, fdsAfter := countFDs(t)
		t.Errorf("open file descriptors: %d before, %d after %s\nbefore:\n%s\nafter:\n%s",
			f0, f, after, strings.Join(fdsBefore, "\n"), strings.Join(fdsAfter, "\n"))
	}
}

// Aborts with several initiators and a fake one, grants, revokes,
// notifications and the event fd leave, once the engines are closed, no
// goroutine and no file descriptor beyond the baseline; before the close,
// registries hold only what is documented to stay (one tombstone per
// aborted request id).
func TestAbortScenariosLeakNoGoroutinesOrFileDescriptors(t *testing.T) {
	cycle := func() {
		t.Helper()
		const blk, n = 256 << 10, 8
		mk := func(opts engine.Options) *engine.Engine {
			opts.IgnoreEnv, opts.Protocol = true, "tcp"
			e, err := engine.New(opts)
			if err != nil {
				t.Fatal(err)
			}
			return e
		}
		owner := mk(engine.Options{Testing: engine.Testing{ApplyDelay: 5 * time.Millisecond}})
		inits := []*engine.Engine{mk(engine.Options{}), mk(engine.Options{})}
		all := append([]*engine.Engine{owner}, inits...)
		defer func() {
			for _, e := range all {
				_ = e.Close()
			}
		}()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		bufs := make([][]byte, len(all))
		for i, e := range all {
			m, err := e.AllocBuffer(2*n*blk, "cpu")
			if err != nil {
				t.Fatal(err)
			}
			bufs[i] = m
		}
		fake := newFakeInitiator(t, owner.Name(), "127.0.0.1:5")
		if _, err := owner.EventFD(); err != nil {
			t.Fatal(err)
		}
		const rid = 1
		var batches []*engine.Batch
		for i, in := range inits {
			seg, err := in.OpenSegment(ctx, owner.Name())
			if err != nil {
				t.Fatal(err)
			}
			reqs := make([]engine.Request, n)
			for j := range reqs {
				reqs[j] = withRID(write(bufs[i+1][j*blk:], seg, engine.AddrOf(bufs[0])+uint64((i*n+j)*blk), blk), rid, 0)
			}
			b, err := in.AllocateBatch(n)
			if err != nil {
				t.Fatal(err)
			}
			if err := b.Submit(ctx, reqs); err != nil {
				t.Fatal(err)
			}
			batches = append(batches, b)
			if err := in.Notify(ctx, seg, rid, []byte("hi")); err != nil {
				t.Fatal(err)
			}
		}
		acks := owner.Stats().AbortAcks
		res, err := owner.Abort(ctx, rid, []string{inits[0].Name(), inits[1].Name(), fake.name})
		if err != nil || !res.Safe {
			t.Fatalf("abort = %+v, %v", res, err)
		}
		fake.expectAbort(t, rid, res.Generation)
		fake.ack(t, rid, res.Generation)
		for _, b := range batches {
			if err := b.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			if err := b.Free(); err != nil {
				t.Fatal(err)
			}
		}
		waitFor(t, 10*time.Second, "three ACKs", func() bool { return owner.Stats().AbortAcks-acks == 3 })
		var evs [8]engine.Event
		if k, err := owner.TakeEvents(ctx, evs[:]); k == 0 || err != nil {
			t.Fatalf("TakeEvents = %d, %v", k, err)
		}
		gr, err := owner.Grant(inits[0].Name(), rid+1, []engine.GrantRange{{Addr: engine.AddrOf(bufs[0]), Len: blk}})
		if err != nil {
			t.Fatal(err)
		}
		if err := owner.Revoke(ctx, gr.ID); err != nil {
			t.Fatal(err)
		}
		fake.close()
		for i, e := range all {
			if err := e.FreeBuffer(engine.AddrOf(bufs[i])); err != nil {
				t.Errorf("free buffer %d: %v", i, err)
			}
		}
		// Registries: no grant, registration or task left; the aborted
		// request's tombstone stays (documented, bounded), and the revoked
		// request id's entry until it ages out.
		if st := owner.Stats(); st.Grants != 0 || st.Registrations != 0 || st.Tombstones != 1 || st.RequestStates > 2 {
			t.Errorf("owner registries before Close: %d grants, %d registrations, %d tombstones, %d request states",
				st.Grants, st.Registrations, st.Tombstones, st.RequestStates)
		}
		for i, in := range inits {
			if st := in.Stats(); st.TasksInFlight != 0 || st.Registrations != 0 || st.InitiatorTombstones != 1 {
				t.Errorf("initiator %d before Close: %d tasks in flight, %d registrations, %d tombstones",
					i, st.TasksInFlight, st.Registrations, st.InitiatorTombstones)
			}
		}
		for _, e := range all {
			if err := e.Close(); err != nil {
				t.Errorf("close: %v", err)
			}
		}
	}
	requireNoLeaks(t, cycle)
}
