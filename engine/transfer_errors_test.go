package engine_test

// Error cases: every failure is matchable with errors.Is and writes nothing
// outside registered memory; stale keys and descriptors are cured by a
// refresh.

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/engine/control"
)

// peerResolver resolves in-process engines directly and counts lookups, so a
// test can see descriptor refreshes.
type peerResolver struct {
	mu    sync.Mutex
	peers map[string]*engine.Engine
	calls map[string]int
}

func (r *peerResolver) Resolve(ctx context.Context, name string) (*control.Descriptor, error) {
	r.mu.Lock()
	e := r.peers[name]
	r.calls[name]++
	r.mu.Unlock()
	if e == nil {
		return nil, fmt.Errorf("no engine named %q", name)
	}
	return e.Descriptor(), nil
}

func (r *peerResolver) count(name string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.calls[name]
}

// guarded is a registered range in the middle of a larger allocation whose
// two unregistered guard regions hold 0xAA.
type guarded struct {
	whole []byte
	mid   []byte // the registered part
	guard int
}

const guardByte = 0xAA

// newGuarded allocates guard+size+guard bytes (the odd guard puts the
// registered range at an unaligned address) and registers the middle.
func newGuarded(t *testing.T, e *engine.Engine, size int, seed uint64) *guarded {
	t.Helper()
	const guard = 64<<10 + 13
	g := &guarded{whole: make([]byte, guard+size+guard), guard: guard}
	g.mid = g.whole[guard : guard+size]
	fillByte(g.whole, guardByte)
	fillPattern(g.mid, seed)
	if _, err := e.RegisterMemory(g.mid, "cpu"); err != nil {
		t.Fatalf("register guarded buffer: %v", err)
	}
	t.Cleanup(func() { _ = e.UnregisterMemory(engine.AddrOf(g.mid)) })
	return g
}

// check fails the test when a guard byte changed or the registered part
// differs from want.
func (g *guarded) check(t *testing.T, what string, want []byte) {
	t.Helper()
	requireAll(t, what+": guard before", g.whole[:g.guard], guardByte)
	requireAll(t, what+": guard after", g.whole[g.guard+len(g.mid):], guardByte)
	requireEqual(t, what+": registered range", g.mid, want)
}

// errFixture is two engines with guarded buffers and a segment from a to b.
type errFixture struct {
	a, b       *engine.Engine
	res        *peerResolver
	local, rem *guarded
	seg        *engine.Segment
}

const errSize = 1 << 20

func newErrFixture(t *testing.T) *errFixture {
	t.Helper()
	r := &peerResolver{peers: map[string]*engine.Engine{}, calls: map[string]int{}}
	f := &errFixture{res: r}
	f.a = newEngineWith(t, engine.Options{Resolver: r})
	f.b = newEngineWith(t, engine.Options{Resolver: r})
	r.mu.Lock()
	r.peers[f.a.Name()], r.peers[f.b.Name()] = f.a, f.b
	r.mu.Unlock()
	f.local = newGuarded(t, f.a, errSize, 11)
	f.rem = newGuarded(t, f.b, errSize, 12)
	f.seg = openSegment(t, f.a, f.b.Name())
	return f
}

func TestErrorsAreMatchableAndWriteNothingOutsideRegisteredMemory(t *testing.T) {
	type outcome struct {
		res []engine.TaskResult
		err error
	}
	cases := []struct {
		name string
		do   func(t *testing.T, f *errFixture) outcome
		want []error
		// status of task 0 when the transfer started (0: it must be
		// rejected before starting, with no results).
		status engine.TaskStatus
		// descriptor fetches expected during the call (-1: not checked).
		refreshes int
	}{
		{
			name: "overlapping registration",
			do: func(t *testing.T, f *errFixture) outcome {
				// Straddling the start of the registered range.
				if _, err := f.b.RegisterMemory(f.rem.whole[f.rem.guard-10:f.rem.guard+10], "cpu"); !errors.Is(err, engine.ErrOverlap) {
					return outcome{err: fmt.Errorf("straddling: %w", err)}
				}
				// Exactly the registered range again.
				if _, err := f.b.RegisterMemory(f.rem.mid, "cpu"); !errors.Is(err, engine.ErrOverlap) {
					return outcome{err: fmt.Errorf("same range: %w", err)}
				}
				// Two overlapping ranges in one call, outside anything
				// registered: all or none, so the first must not stay.
				_, err := f.b.RegisterMemoryBatch([]engine.MemoryRange{
					{Mem: f.rem.whole[:100]}, {Mem: f.rem.whole[50:150]},
				})
				if !errors.Is(err, engine.ErrOverlap) {
					return outcome{err: fmt.Errorf("overlap within one call: %w", err)}
				}
				if n := f.b.Stats().Registrations; n != 1 {
					return outcome{err: fmt.Errorf("%d registrations after refused ones, want 1", n)}
				}
				return outcome{err: err}
			},
			want: []error{engine.ErrOverlap}, refreshes: 0,
		},
		{
			name: "WRITE from unregistered local memory",
			do: func(t *testing.T, f *errFixture) outcome {
				res, err := f.a.Transfer(testCtx(t, 5*time.Second), []engine.Request{
					write(f.local.whole, f.seg, engine.AddrOf(f.rem.mid), 4096)})
				return outcome{res, err}
			},
			want: []error{engine.ErrNotRegistered}, refreshes: 0,
		},
		{
			name: "READ into unregistered local memory",
			do: func(t *testing.T, f *errFixture) outcome {
				res, err := f.a.Transfer(testCtx(t, 5*time.Second), []engine.Request{
					read(f.local.whole, f.seg, engine.AddrOf(f.rem.mid), 4096)})
				return outcome{res, err}
			},
			want: []error{engine.ErrNotRegistered}, refreshes: 0,
		},
		{
			name: "local range running past its registration",
			do: func(t *testing.T, f *errFixture) outcome {
				res, err := f.a.Transfer(testCtx(t, 5*time.Second), []engine.Request{
					read(f.local.mid[errSize-100:], f.seg, engine.AddrOf(f.rem.mid), 4096)})
				return outcome{res, err}
			},
			want: []error{engine.ErrOutOfBounds}, refreshes: 0,
		},
		{
			name: "remote range not registered at the peer",
			do: func(t *testing.T, f *errFixture) outcome {
				res, err := f.a.Transfer(testCtx(t, 5*time.Second), []engine.Request{
					write(f.local.mid, f.seg, engine.AddrOf(f.rem.whole), 4096)})
				return outcome{res, err}
			},
			want: []error{engine.ErrRemoteRange}, refreshes: 1,
		},
		{
			name: "remote range starting inside a buffer and running past it",
			do: func(t *testing.T, f *errFixture) outcome {
				res, err := f.a.Transfer(testCtx(t, 5*time.Second), []engine.Request{
					write(f.local.mid, f.seg, engine.AddrOf(f.rem.mid)+errSize-100, 4096)})
				return outcome{res, err}
			},
			want: []error{engine.ErrRemoteRange}, refreshes: 1,
		},
		{
			name: "READ of a remote range running past a buffer",
			do: func(t *testing.T, f *errFixture) outcome {
				res, err := f.a.Transfer(testCtx(t, 5*time.Second), []engine.Request{
					read(f.local.mid, f.seg, engine.AddrOf(f.rem.mid)-1, 4096)})
				return outcome{res, err}
			},
			want: []error{engine.ErrRemoteRange}, refreshes: 1,
		},
		{
			name: "WRITE with a stale key (peer registered the range again)",
			do: func(t *testing.T, f *errFixture) outcome {
				reregister(t, f.b, f.rem.mid)
				res, err := f.a.Transfer(testCtx(t, 5*time.Second), []engine.Request{
					write(f.local.mid, f.seg, engine.AddrOf(f.rem.mid), errSize)})
				return outcome{res, err}
			},
			want: []error{engine.ErrStaleKey, engine.ErrRefused, engine.ErrTransferFailed}, status: engine.Failed, refreshes: -1,
		},
		{
			name: "READ with a stale key (peer registered the range again)",
			do: func(t *testing.T, f *errFixture) outcome {
				reregister(t, f.b, f.rem.mid)
				res, err := f.a.Transfer(testCtx(t, 5*time.Second), []engine.Request{
					read(f.local.mid, f.seg, engine.AddrOf(f.rem.mid), errSize)})
				return outcome{res, err}
			},
			want: []error{engine.ErrStaleKey, engine.ErrRefused, engine.ErrTransferFailed}, status: engine.Failed, refreshes: -1,
		},
		{
			name: "zero length",
			do: func(t *testing.T, f *errFixture) outcome {
				res, err := f.a.Transfer(testCtx(t, 5*time.Second), []engine.Request{
					write(f.local.mid, f.seg, engine.AddrOf(f.rem.mid), 0)})
				return outcome{res, err}
			},
			want: []error{engine.ErrInvalidArg}, refreshes: 0,
		},
		{
			name: "length wrapping the address space",
			do: func(t *testing.T, f *errFixture) outcome {
				r := write(f.local.mid, f.seg, engine.AddrOf(f.rem.mid), 1)
				r.Length = ^uint64(0) - 10
				res, err := f.a.Transfer(testCtx(t, 5*time.Second), []engine.Request{r})
				return outcome{res, err}
			},
			want: []error{engine.ErrInvalidArg}, refreshes: 0,
		},
		{
			name: "bad op 0",
			do: func(t *testing.T, f *errFixture) outcome {
				r := write(f.local.mid, f.seg, engine.AddrOf(f.rem.mid), 4096)
				r.Op = 0
				res, err := f.a.Transfer(testCtx(t, 5*time.Second), []engine.Request{r})
				return outcome{res, err}
			},
			want: []error{engine.ErrInvalidArg}, refreshes: 0,
		},
		{
			name: "bad op 3",
			do: func(t *testing.T, f *errFixture) outcome {
				r := write(f.local.mid, f.seg, engine.AddrOf(f.rem.mid), 4096)
				r.Op = 3
				res, err := f.a.Transfer(testCtx(t, 5*time.Second), []engine.Request{r})
				return outcome{res, err}
			},
			want: []error{engine.ErrInvalidArg}, refreshes: 0,
		},
		{
			name: "no segment",
			do: func(t *testing.T, f *errFixture) outcome {
				r := write(f.local.mid, nil, engine.AddrOf(f.rem.mid), 4096)
				res, err := f.a.Transfer(testCtx(t, 5*time.Second), []engine.Request{r})
				return outcome{res, err}
			},
			want: []error{engine.ErrInvalidArg}, refreshes: 0,
		},
		{
			name: "one bad request in a batch starts none",
			do: func(t *testing.T, f *errFixture) outcome {
				res, err := f.a.Transfer(testCtx(t, 5*time.Second), []engine.Request{
					write(f.local.mid, f.seg, engine.AddrOf(f.rem.mid), 4096),
					write(f.local.mid[4096:], f.seg, engine.AddrOf(f.rem.mid)+4096, 0),
				})
				return outcome{res, err}
			},
			want: []error{engine.ErrInvalidArg}, refreshes: 0,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := newErrFixture(t)
			localWant := append([]byte(nil), f.local.mid...)
			remWant := append([]byte(nil), f.rem.mid...)
			before := f.res.count(f.b.Name())
			refusedBefore := f.b.Stats().OwnerRefused
			o := tc.do(t, f)
			t.Logf("error: %v", o.err)
			if o.err == nil {
				t.Fatal("no error")
			}
			for _, w := range tc.want {
				if !errors.Is(o.err, w) {
					t.Errorf("errors.Is(err, %q) = false; err: %v", w, o.err)
				}
			}
			if tc.status == 0 {
				if o.res != nil {
					t.Errorf("rejected call returned results %+v", o.res)
				}
			} else {
				if len(o.res) != 1 {
					t.Fatalf("%d results, want 1", len(o.res))
				}
				r := o.res[0]
				if r.Status != tc.status || r.Transferred != 0 {
					t.Errorf("task 0: status %v, transferred %d; want %v, 0", r.Status, r.Transferred, tc.status)
				}
				for _, w := range tc.want {
					if !errors.Is(r.Err, w) {
						t.Errorf("errors.Is(task.Err, %q) = false; err: %v", w, r.Err)
					}
				}
				if got := f.b.Stats().OwnerRefused - refusedBefore; got == 0 {
					t.Errorf("the peer counted no refusal")
				}
			}
			if tc.refreshes >= 0 {
				if got := f.res.count(f.b.Name()) - before; got != tc.refreshes {
					t.Errorf("%d descriptor fetches, want %d", got, tc.refreshes)
				}
			}
			if st := f.a.Stats(); st.TasksInFlight != 0 {
				t.Errorf("%d tasks in flight after the call", st.TasksInFlight)
			}
			f.local.check(t, "initiator memory", localWant)
			f.rem.check(t, "peer memory", remWant)
		})
	}
}

// reregister unregisters mem at e and registers it again, so its key
// changes under any initiator that cached it.
func reregister(t *testing.T, e *engine.Engine, mem []byte) {
	t.Helper()
	if err := e.UnregisterMemory(engine.AddrOf(mem)); err != nil {
		t.Fatalf("unregister: %v", err)
	}
	if _, err := e.RegisterMemory(mem, "cpu"); err != nil {
		t.Fatalf("register again: %v", err)
	}
}

// A range registered after the segment was opened is found by one descriptor
// refresh; a transfer refused for a stale key fails (it never moves to the
// new key), and the next transfer on the same segment refreshes first and
// lands; opening the segment again works too.
func TestDescriptorRefreshFindsNewRangesAndReopenCuresStaleKeys(t *testing.T) {
	f := newErrFixture(t)
	late := alloc(t, f.b, 1<<20)
	before := f.res.count(f.b.Name())
	fillPattern(f.local.mid, 21)
	transfer(t, f.a, 10*time.Second, write(f.local.mid, f.seg, engine.AddrOf(late), 1<<20))
	requireEqual(t, "range registered after open", late, f.local.mid)
	if got := f.res.count(f.b.Name()) - before; got != 1 {
		t.Errorf("%d descriptor fetches for a new range, want 1", got)
	}

	reregister(t, f.b, f.rem.mid)
	if _, err := f.a.Transfer(testCtx(t, 5*time.Second), []engine.Request{
		write(f.local.mid, f.seg, engine.AddrOf(f.rem.mid), 4096)}); !errors.Is(err, engine.ErrStaleKey) {
		t.Fatalf("transfer under a stale key: %v, want ErrStaleKey", err)
	}
	before = f.res.count(f.b.Name())
	transfer(t, f.a, 10*time.Second, write(f.local.mid, f.seg, engine.AddrOf(f.rem.mid), errSize))
	f.rem.check(t, "next transfer after a stale key", f.local.mid)
	if got := f.res.count(f.b.Name()) - before; got != 1 {
		t.Errorf("%d descriptor fetches after a stale key, want 1", got)
	}
	reregister(t, f.b, f.rem.mid)
	if err := f.a.CloseSegment(f.seg); err != nil {
		t.Fatal(err)
	}
	seg := openSegment(t, f.a, f.b.Name())
	transfer(t, f.a, 10*time.Second, write(f.local.mid, seg, engine.AddrOf(f.rem.mid), errSize))
	f.rem.check(t, "after reopening", f.local.mid)
}

// Invalid arguments outside transfers are refused with matchable errors too.
func TestInvalidArgumentsGiveMatchableErrors(t *testing.T) {
	e := newEngine(t)
	buf := alloc(t, e, 1<<20)
	seg := openSegment(t, e, e.Name())
	heap := make([]byte, 4096)
	cases := []struct {
		name string
		do   func(t *testing.T) error
		want error
	}{
		{"registering empty memory", func(*testing.T) error { _, err := e.RegisterMemory(nil, "cpu"); return err }, engine.ErrInvalidArg},
		{"registering no ranges", func(*testing.T) error { _, err := e.RegisterMemoryBatch(nil); return err }, engine.ErrInvalidArg},
		{"registering at a bad location", func(*testing.T) error { _, err := e.RegisterMemory(heap, "gpu"); return err }, engine.ErrInvalidArg},
		{"registering GPU memory without the cuda layer", func(*testing.T) error { _, err := e.RegisterMemory(heap, "cuda:0"); return err }, engine.ErrUnsupported},
		{"allocating zero bytes", func(*testing.T) error { _, err := e.AllocBuffer(0, "cpu"); return err }, engine.ErrInvalidArg},
		{"unregistering an unregistered address", func(*testing.T) error { return e.UnregisterMemory(engine.AddrOf(heap)) }, engine.ErrNotRegistered},
		{"unregistering from inside a registration", func(*testing.T) error { return e.UnregisterMemory(engine.AddrOf(buf) + 1) }, engine.ErrNotRegistered},
		{"unregistering nothing", func(*testing.T) error { return e.UnregisterMemoryBatch(nil) }, engine.ErrInvalidArg},
		{"unregistering one address twice", func(*testing.T) error {
			return e.UnregisterMemoryBatch([]uint64{engine.AddrOf(buf), engine.AddrOf(buf)})
		}, engine.ErrInvalidArg},
		{"freeing memory not from AllocBuffer", func(*testing.T) error { return e.FreeBuffer(engine.AddrOf(heap)) }, engine.ErrInvalidArg},
		{"a batch of capacity 0", func(*testing.T) error { _, err := e.AllocateBatch(0); return err }, engine.ErrInvalidArg},
		{"submitting nothing", func(t *testing.T) error {
			b, err := e.AllocateBatch(1)
			if err != nil {
				t.Fatal(err)
			}
			return b.Submit(testCtx(t, time.Second), nil)
		}, engine.ErrInvalidArg},
		{"submitting past capacity", func(t *testing.T) error {
			b, err := e.AllocateBatch(1)
			if err != nil {
				t.Fatal(err)
			}
			r := write(buf, seg, engine.AddrOf(buf)+4096, 4096)
			return b.Submit(testCtx(t, time.Second), []engine.Request{r, r})
		}, engine.ErrBatchFull},
		{"submitting to a freed batch", func(t *testing.T) error {
			b, err := e.AllocateBatch(1)
			if err != nil {
				t.Fatal(err)
			}
			if err := b.Free(); err != nil {
				t.Fatal(err)
			}
			return b.Submit(testCtx(t, time.Second), []engine.Request{write(buf, seg, engine.AddrOf(buf)+4096, 4096)})
		}, engine.ErrBatchFreed},
		{"opening a segment by a name without a port", func(t *testing.T) error {
			_, err := e.OpenSegment(testCtx(t, time.Second), "localhost")
			return err
		}, engine.ErrInvalidArg},
		{"a segment of another engine", func(t *testing.T) error {
			other := newEngine(t)
			oseg := openSegment(t, other, other.Name())
			_, err := e.Transfer(testCtx(t, time.Second), []engine.Request{write(buf, oseg, engine.AddrOf(buf)+4096, 4096)})
			return err
		}, engine.ErrInvalidArg},
		{"closing a segment of another engine", func(t *testing.T) error {
			other := newEngine(t)
			return e.CloseSegment(openSegment(t, other, other.Name()))
		}, engine.ErrInvalidArg},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.do(t)
			t.Logf("error: %v", err)
			if !errors.Is(err, tc.want) {
				t.Errorf("errors.Is(err, %q) = false; err: %v", tc.want, err)
			}
			if n := e.Stats().Registrations; n != 1 {
				t.Errorf("%d registrations, want 1", n)
			}
		})
	}
}

// An absurd length is refused before anything is allocated for it: a
// request of 2^50 bytes (or 1 TiB) outside any registration is an error
// value, not slice records for every MiB of it (which would end the
// process with "out of memory", which no recover catches).
func TestAbsurdLengthsAreRefusedBeforeAllocating(t *testing.T) {
	owner := newEngineWith(t, engine.Options{})
	init := newEngineWith(t, engine.Options{})
	dst, src := alloc(t, owner, 1<<20), alloc(t, init, 1<<20)
	seg := openSegment(t, init, owner.Name())
	for _, n := range []uint64{1 << 40, 1 << 50} {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		_, err := init.Transfer(testCtx(t, 10*time.Second), []engine.Request{{Op: engine.Write, Local: engine.AddrOf(src), Segment: seg, Remote: engine.AddrOf(dst), Length: n}})
		runtime.ReadMemStats(&after)
		if !errors.Is(err, engine.ErrNotRegistered) && !errors.Is(err, engine.ErrInvalidArg) && !errors.Is(err, engine.ErrOutOfBounds) {
			t.Errorf("a WRITE of %d bytes from a 1 MiB registration: %v; want it refused as not registered", n, err)
		}
		// The old code allocated 168 MiB for 2^40 bytes (and died for 2^50);
		// 16 MiB leaves room for what the engines' own goroutines allocate.
		if grew := after.TotalAlloc - before.TotalAlloc; grew > 16<<20 {
			t.Errorf("refusing a WRITE of %d bytes allocated %d bytes first", n, grew)
		}
	}
}
