package engine_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/engine/control"
)

// ---------------------------------------------------------------------------
// Helpers shared by integration_test.go and the process tests.

// newEngineWith starts an engine with opts (IgnoreEnv forced) and closes it
// when the test ends. Its transport is tcp unless opts names one: tests
// that state tcp's properties must hold on a machine with RDMA devices
// too, where "auto" would pick rdma.
func newEngineWith(t *testing.T, opts engine.Options) *engine.Engine {
	t.Helper()
	opts.IgnoreEnv = true
	if opts.Protocol == "" {
		opts.Protocol = "tcp"
	}
	e, err := engine.New(opts)
	if err != nil {
		t.Fatalf("new engine: %v", err)
	}
	t.Cleanup(func() { _ = e.Close() })
	return e
}

// testCtx returns a context that ends after d or when the test ends.
func testCtx(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// openSegment opens name on e, failing the test on error.
func openSegment(t *testing.T, e *engine.Engine, name string) *engine.Segment {
	t.Helper()
	seg, err := e.OpenSegment(testCtx(t, 10*time.Second), name)
	if err != nil {
		t.Fatalf("open segment %s: %v", name, err)
	}
	return seg
}

// fillPattern fills b with a deterministic xorshift64* stream derived from
// seed: fast enough for 1 GiB, and no two seeds (or offsets) look alike.
func fillPattern(b []byte, seed uint64) {
	x := seed*0x9E3779B97F4A7C15 ^ 0xD1B54A32D192ED03
	if x == 0 {
		x = 1
	}
	next := func() uint64 {
		x ^= x >> 12
		x ^= x << 25
		x ^= x >> 27
		return x * 0x2545F4914F6CDD1D
	}
	n := len(b) &^ 7
	for i := 0; i < n; i += 8 {
		binary.LittleEndian.PutUint64(b[i:i+8], next())
	}
	if n < len(b) {
		var tail [8]byte
		binary.LittleEndian.PutUint64(tail[:], next())
		copy(b[n:], tail[:])
	}
}

// pattern returns a fresh n-byte slice holding fillPattern(seed).
func pattern(n int, seed uint64) []byte {
	b := make([]byte, n)
	fillPattern(b, seed)
	return b
}

// requireEqual fails the test when got differs from want, naming the first
// differing offset.
func requireEqual(t *testing.T, what string, got, want []byte) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: length %d, want %d", what, len(got), len(want))
	}
	if bytes.Equal(got, want) {
		return
	}
	i := 0
	for i < len(got) && got[i] == want[i] {
		i++
	}
	end := min(i+16, len(got))
	t.Fatalf("%s: first difference at offset %d of %d: got % x, want % x", what, i, len(got), got[i:end], want[i:end])
}

// requireAll fails the test unless every byte of b is v.
func requireAll(t *testing.T, what string, b []byte, v byte) {
	t.Helper()
	want := make([]byte, min(len(b), 64<<10))
	fillByte(want, v)
	for off := 0; off < len(b); off += len(want) {
		chunk := b[off:min(off+len(want), len(b))]
		if bytes.Equal(chunk, want[:len(chunk)]) {
			continue
		}
		for i, c := range chunk {
			if c != v {
				t.Fatalf("%s: byte %d of %d is %#02x, want %#02x", what, off+i, len(b), c, v)
			}
		}
	}
}

// fillByte sets every byte of b to v (by doubling copies: fast under -race).
func fillByte(b []byte, v byte) {
	if len(b) == 0 {
		return
	}
	b[0] = v
	for n := 1; n < len(b); n *= 2 {
		copy(b[n:], b[:n])
	}
}

// within runs fn and panics with every goroutine's stack when it does not
// return within d: a hang is a bug, and letting the test go on would free
// memory the engine may still touch.
func within(t *testing.T, d time.Duration, what string, fn func()) time.Duration {
	t.Helper()
	start := time.Now()
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn()
	}()
	select {
	case <-done:
		return time.Since(start)
	case <-time.After(d):
		buf := make([]byte, 1<<20)
		buf = buf[:runtime.Stack(buf, true)]
		panic(fmt.Sprintf("%s: %s did not return within %v (hang)\n%s", t.Name(), what, d, buf))
	}
}

// write and read build one request.
func write(local []byte, seg *engine.Segment, remote uint64, n int) engine.Request {
	return engine.Request{Op: engine.Write, Local: engine.AddrOf(local), Segment: seg, Remote: remote, Length: uint64(n)}
}

func read(local []byte, seg *engine.Segment, remote uint64, n int) engine.Request {
	return engine.Request{Op: engine.Read, Local: engine.AddrOf(local), Segment: seg, Remote: remote, Length: uint64(n)}
}

// transfer runs reqs synchronously and requires every task COMPLETED.
func transfer(t *testing.T, e *engine.Engine, d time.Duration, reqs ...engine.Request) {
	t.Helper()
	res, err := e.Transfer(testCtx(t, d), reqs)
	if err != nil {
		t.Fatalf("transfer: %v", err)
	}
	for i, r := range res {
		if r.Status != engine.Completed || r.Err != nil || r.Transferred != reqs[i].Length {
			t.Fatalf("task %d: status %v, transferred %d of %d, err %v", i, r.Status, r.Transferred, reqs[i].Length, r.Err)
		}
	}
}

// bigSize is 1 GiB, or 64 MiB in -short mode.
func bigSize() int {
	if testing.Short() {
		return 64 << 20
	}
	return 1 << 30
}

// ---------------------------------------------------------------------------
// 1. Two engines in one process.

func TestTwoEnginesInOneProcessMoveOneGiBBothWays(t *testing.T) {
	size := bigSize()
	a, b := newEngine(t), newEngine(t)
	aSrc, aBack := alloc(t, a, size), alloc(t, a, size)
	bBuf := alloc(t, b, size)
	fillPattern(aSrc, 1)
	segB := openSegment(t, a, b.Name())
	segA := openSegment(t, b, a.Name())
	const d = 2 * time.Minute

	// a WRITEs into b.
	start := time.Now()
	transfer(t, a, d, write(aSrc, segB, engine.AddrOf(bBuf), size))
	t.Logf("a WRITE %d MiB into b: %v", size>>20, time.Since(start))
	requireEqual(t, "b's buffer after a's WRITE", bBuf, aSrc)

	// a READs it back from b.
	start = time.Now()
	transfer(t, a, d, read(aBack, segB, engine.AddrOf(bBuf), size))
	t.Logf("a READ %d MiB from b: %v", size>>20, time.Since(start))
	requireEqual(t, "a's buffer after a's READ", aBack, aSrc)

	// b WRITEs a new pattern into a.
	fillPattern(bBuf, 2)
	start = time.Now()
	transfer(t, b, d, write(bBuf, segA, engine.AddrOf(aBack), size))
	t.Logf("b WRITE %d MiB into a: %v", size>>20, time.Since(start))
	requireEqual(t, "a's buffer after b's WRITE", aBack, bBuf)

	// b READs a's first buffer.
	start = time.Now()
	transfer(t, b, d, read(bBuf, segA, engine.AddrOf(aSrc), size))
	t.Logf("b READ %d MiB from a: %v", size>>20, time.Since(start))
	requireEqual(t, "b's buffer after b's READ", bBuf, aSrc)

	if st := a.Stats(); st.BytesWritten != uint64(size) || st.BytesRead != uint64(size) || st.TasksInFlight != 0 {
		t.Errorf("a's stats: %+v", st)
	}
}

// ---------------------------------------------------------------------------
// 3. A batch of 10,000 requests.

func TestBatchOfTenThousandRequestsCompletesWithDataIntact(t *testing.T) {
	const n, blk = 10000, 4 << 10
	for _, tc := range []struct {
		name string
		self bool
	}{{"to a peer", false}, {"to the engine itself", true}} {
		t.Run(tc.name, func(t *testing.T) {
			a := newEngine(t)
			owner := a
			if !tc.self {
				owner = newEngine(t)
			}
			src, back := alloc(t, a, n*blk), alloc(t, a, n*blk)
			dst := alloc(t, owner, n*blk)
			fillPattern(src, 3)
			seg := openSegment(t, a, owner.Name())
			rng := rand.New(rand.NewPCG(1, 2))
			perm := rng.Perm(n) // local block i goes to remote block perm[i]

			run := func(op engine.Op, local []byte) {
				t.Helper()
				b, err := a.AllocateBatch(n)
				if err != nil {
					t.Fatal(err)
				}
				reqs := make([]engine.Request, n)
				for i := range reqs {
					reqs[i] = engine.Request{
						Op: op, Local: engine.AddrOf(local) + uint64(i*blk), Segment: seg,
						Remote: engine.AddrOf(dst) + uint64(perm[i]*blk), Length: blk, RequestID: uint64(i + 1),
					}
				}
				ctx := testCtx(t, time.Minute)
				if err := b.Submit(ctx, reqs); err != nil {
					t.Fatalf("submit %v: %v", op, err)
				}
				if err := b.Wait(ctx); err != nil {
					t.Fatalf("wait %v: %v", op, err)
				}
				if b.Len() != n {
					t.Fatalf("batch holds %d tasks, want %d", b.Len(), n)
				}
				res := b.Results()
				if len(res) != n {
					t.Fatalf("%d results, want %d", len(res), n)
				}
				for i, r := range res {
					if r.Status != engine.Completed || r.Err != nil || r.Transferred != blk {
						t.Fatalf("%v task %d: status %v, transferred %d, err %v", op, i, r.Status, r.Transferred, r.Err)
					}
				}
				if r, err := b.Status(n - 1); err != nil || r.Status != engine.Completed {
					t.Fatalf("Status(%d) = %+v, %v", n-1, r, err)
				}
				if _, err := b.Status(n); !errors.Is(err, engine.ErrInvalidArg) {
					t.Fatalf("Status(%d) past the end: %v, want ErrInvalidArg", n, err)
				}
				if err := b.Free(); err != nil {
					t.Fatalf("free: %v", err)
				}
			}

			run(engine.Write, src)
			for i := 0; i < n; i++ {
				requireEqual(t, fmt.Sprintf("remote block %d (from local block %d)", perm[i], i),
					dst[perm[i]*blk:(perm[i]+1)*blk], src[i*blk:(i+1)*blk])
			}
			run(engine.Read, back)
			requireEqual(t, "blocks read back", back, src)
			if st := a.Stats(); st.TasksCompleted != 2*n || st.TasksInFlight != 0 {
				t.Errorf("stats after two batches: completed %d, in flight %d", st.TasksCompleted, st.TasksInFlight)
			}
		})
	}
}

// ---------------------------------------------------------------------------
// 4. Error cases.

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

// ---------------------------------------------------------------------------
// 6. Close with transfers in flight.

func TestCloseWithBatchInFlightCancelsAndReturns(t *testing.T) {
	const total, blk = 256 << 20, 1 << 20
	a, b := newEngine(t), newEngine(t)
	src, dst := alloc(t, a, total), alloc(t, b, total)
	fillPattern(src, 4)
	seg := openSegment(t, a, b.Name())
	batch, err := a.AllocateBatch(total / blk)
	if err != nil {
		t.Fatal(err)
	}
	reqs := make([]engine.Request, total/blk)
	for i := range reqs {
		reqs[i] = write(src[i*blk:], seg, engine.AddrOf(dst)+uint64(i*blk), blk)
	}
	if err := batch.Submit(testCtx(t, time.Minute), reqs); err != nil {
		t.Fatal(err)
	}
	took := within(t, 10*time.Second, "Close with a batch in flight", func() {
		if err := a.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	})
	t.Logf("Close took %v", took)
	within(t, 5*time.Second, "Wait after Close", func() {
		if err := batch.Wait(testCtx(t, 5*time.Second)); err != nil {
			t.Errorf("wait after close: %v", err)
		}
	})
	counts := map[engine.TaskStatus]int{}
	for i, r := range batch.Results() {
		counts[r.Status]++
		switch r.Status {
		case engine.Completed:
			requireEqual(t, fmt.Sprintf("completed block %d", i), dst[i*blk:(i+1)*blk], src[i*blk:(i+1)*blk])
		case engine.Canceled:
			if !errors.Is(r.Err, engine.ErrCanceled) {
				t.Errorf("canceled task %d: err %v, want ErrCanceled", i, r.Err)
			}
		default:
			t.Errorf("task %d: status %v (%v), want CANCELED or COMPLETED", i, r.Status, r.Err)
		}
	}
	t.Logf("after Close: %v", counts)
	if st := a.Stats(); st.TasksInFlight != 0 {
		t.Errorf("%d tasks in flight after Close", st.TasksInFlight)
	}
	if err := batch.Free(); err != nil {
		t.Errorf("free after close: %v", err)
	}
	// The closed engine refuses new work clearly.
	if _, err := a.Transfer(testCtx(t, time.Second), reqs[:1]); !errors.Is(err, engine.ErrClosed) {
		t.Errorf("transfer after close: %v, want ErrClosed", err)
	}
	if _, err := a.AllocateBatch(1); !errors.Is(err, engine.ErrClosed) {
		t.Errorf("allocate batch after close: %v, want ErrClosed", err)
	}
	if _, err := a.OpenSegment(testCtx(t, time.Second), b.Name()); !errors.Is(err, engine.ErrClosed) {
		t.Errorf("open segment after close: %v, want ErrClosed", err)
	}
}

func TestCloseDuringSynchronousTransferEndsItCanceled(t *testing.T) {
	const total = 256 << 20
	a, b := newEngine(t), newEngine(t)
	src, dst := alloc(t, a, total), alloc(t, b, total)
	seg := openSegment(t, a, b.Name())
	type outcome struct {
		res []engine.TaskResult
		err error
	}
	done := make(chan outcome, 1)
	ctx := testCtx(t, time.Minute)
	go func() {
		res, err := a.Transfer(ctx, []engine.Request{write(src, seg, engine.AddrOf(dst), total)})
		done <- outcome{res, err}
	}()
	deadline := time.Now().Add(10 * time.Second)
	for a.Stats().TasksInFlight == 0 && a.Stats().TasksCompleted == 0 && time.Now().Before(deadline) {
		time.Sleep(100 * time.Microsecond)
	}
	within(t, 10*time.Second, "Close during a Transfer", func() { _ = a.Close() })
	var o outcome
	within(t, 5*time.Second, "Transfer after Close", func() { o = <-done })
	t.Logf("transfer: %v", o.err)
	if len(o.res) != 1 {
		t.Fatalf("results %+v, err %v", o.res, o.err)
	}
	switch o.res[0].Status {
	case engine.Completed:
		t.Log("transfer completed before Close")
	case engine.Canceled:
		if !errors.Is(o.err, engine.ErrCanceled) {
			t.Errorf("err %v, want ErrCanceled", o.err)
		}
	default:
		t.Errorf("status %v (%v), want CANCELED", o.res[0].Status, o.err)
	}
}

func TestClosingTheTargetMidTransferFailsInitiatorTasks(t *testing.T) {
	const total, blk = 256 << 20, 1 << 20
	for _, op := range []engine.Op{engine.Write, engine.Read} {
		t.Run(op.String(), func(t *testing.T) {
			a, b := newEngine(t), newEngine(t)
			local, remote := alloc(t, a, total), alloc(t, b, total)
			seg := openSegment(t, a, b.Name())
			batch, err := a.AllocateBatch(total / blk)
			if err != nil {
				t.Fatal(err)
			}
			reqs := make([]engine.Request, total/blk)
			for i := range reqs {
				reqs[i] = engine.Request{Op: op, Local: engine.AddrOf(local) + uint64(i*blk), Segment: seg,
					Remote: engine.AddrOf(remote) + uint64(i*blk), Length: blk}
			}
			if err := batch.Submit(testCtx(t, time.Minute), reqs); err != nil {
				t.Fatal(err)
			}
			closeTook := within(t, 10*time.Second, "target Close", func() { _ = b.Close() })
			t.Logf("target Close took %v", closeTook)
			took := within(t, 20*time.Second, "initiator Wait after the target closed", func() {
				if err := batch.Wait(testCtx(t, 20*time.Second)); err != nil {
					t.Errorf("wait: %v", err)
				}
			})
			counts := map[engine.TaskStatus]int{}
			for i, r := range batch.Results() {
				counts[r.Status]++
				switch r.Status {
				case engine.Completed:
				case engine.Failed:
					if !errors.Is(r.Err, engine.ErrTransferFailed) {
						t.Errorf("failed task %d: err %v, want ErrTransferFailed", i, r.Err)
					}
				default:
					t.Errorf("task %d: status %v (%v), want FAILED or COMPLETED", i, r.Status, r.Err)
				}
			}
			t.Logf("initiator tasks ended %v within %v of the target's Close", counts, took)
			// A new transfer to the closed target fails too, by its deadline.
			took = within(t, 10*time.Second, "transfer to a closed target", func() {
				res, err := a.Transfer(testCtx(t, 3*time.Second), reqs[:1])
				if err == nil {
					t.Errorf("transfer to a closed target succeeded: %+v", res)
				}
				t.Logf("transfer to the closed target: %v", err)
			})
			if took > 5*time.Second {
				t.Errorf("transfer to a closed target with a 3s deadline took %v", took)
			}
		})
	}
}

// ---------------------------------------------------------------------------
// 7. Leaks.

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

// ---------------------------------------------------------------------------
// Unregister and Close mid-transfer: once they return, no further byte of
// the transfer touches their memory (SAFETY.md promise 1 for UnregisterMemory
// and Close, promise 3 for the initiator's own memory).

func TestUnregisterOrCloseMidTransferStopsEveryLaterByte(t *testing.T) {
	const marker = 0x77
	size, progress := 128<<20, uint64(8<<20)
	if testing.Short() {
		size, progress = 32<<20, 2<<20
	}
	type actor int
	const (
		owner actor = iota
		initiator
	)
	cases := []struct {
		who   actor
		close bool // Close the engine instead of unregistering the buffer
		self  bool // transfer within one engine (local transport)
	}{
		{owner, false, false}, {owner, true, false}, {initiator, false, false}, {initiator, true, false},
		{owner, false, true}, {initiator, false, true},
	}
	for _, op := range []engine.Op{engine.Write, engine.Read} {
		for _, tc := range cases {
			name := map[actor]string{owner: "owner", initiator: "initiator"}[tc.who]
			name += map[bool]string{false: " unregisters", true: " closes"}[tc.close]
			name += map[bool]string{false: "", true: " (same engine)"}[tc.self]
			t.Run(op.String()+"/"+name, func(t *testing.T) {
				a := newEngine(t)
				b := a
				if !tc.self {
					b = newEngine(t)
				}
				local, remote := alloc(t, a, size), alloc(t, b, size)
				src, dst := local, remote // the data's source and destination
				if op == engine.Read {
					src, dst = remote, local
				}
				fillPattern(src, 30)
				seg := openSegment(t, a, b.Name())
				batch, err := a.AllocateBatch(1)
				if err != nil {
					t.Fatal(err)
				}
				if err := batch.Submit(testCtx(t, time.Minute), []engine.Request{
					{Op: op, Local: engine.AddrOf(local), Segment: seg, Remote: engine.AddrOf(remote), Length: uint64(size)}}); err != nil {
					t.Fatal(err)
				}
				for end := time.Now().Add(10 * time.Second); time.Now().Before(end); time.Sleep(50 * time.Microsecond) {
					if r, _ := batch.Status(0); r.Transferred >= progress || r.Status.Final() {
						break
					}
				}
				actedOn, actorEngine := remote, b
				if tc.who == initiator {
					actedOn, actorEngine = local, a
				}
				took := within(t, 10*time.Second, name, func() {
					var err error
					if tc.close {
						err = actorEngine.Close()
					} else {
						err = actorEngine.UnregisterMemory(engine.AddrOf(actedOn))
					}
					if err != nil {
						t.Errorf("%s: %v", name, err)
					}
				})
				// The range may be reused at once.
				fillByte(actedOn, marker)
				r, _ := batch.Status(0)
				t.Logf("%s took %v, with %d of %d bytes confirmed", name, took, r.Transferred, size)
				within(t, 30*time.Second, "Wait", func() {
					if err := batch.Wait(testCtx(t, 30*time.Second)); err != nil {
						t.Errorf("wait: %v", err)
					}
				})
				r, _ = batch.Status(0)
				t.Logf("task: %v, %d bytes, %v", r.Status, r.Transferred, r.Err)
				switch r.Status {
				case engine.Completed:
					t.Log("the transfer completed before the action")
				case engine.Failed, engine.Canceled:
				default:
					t.Errorf("task ended %v (%v)", r.Status, r.Err)
				}
				if &actedOn[0] == &dst[0] {
					// Nothing may land in the destination after the action.
					requireAll(t, "destination after "+name, dst, marker)
					return
				}
				// The source changed after the action: the destination holds
				// the old source or what it held before (zeros), never marker.
				want := pattern(size, 30)
				const chunk = 4 << 10
				for off := 0; off < size; off += chunk {
					d, w := dst[off:off+chunk], want[off:off+chunk]
					if bytes.Equal(d, w) {
						continue
					}
					if r.Status == engine.Completed {
						requireEqual(t, "destination of a completed transfer", dst, want)
					}
					for i, c := range d {
						if c != w[i] && c != 0 {
							t.Fatalf("destination byte %d is %#02x: neither the source's %#02x nor 0 (marker %#02x): the source was read after %s returned",
								off+i, c, w[i], marker, name)
						}
					}
				}
			})
		}
	}
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
	if g > g0 {
		buf := make([]byte, 1<<20)
		buf = buf[:runtime.Stack(buf, true)]
		t.Errorf("goroutines: %d before, %d after closing the engines\n%s", g0, g, buf)
	}
	if f > f0 {
		_, fdsAfter := countFDs(t)
		t.Errorf("open file descriptors: %d before, %d after\nbefore:\n%s\nafter:\n%s",
			f0, f, strings.Join(fdsBefore, "\n"), strings.Join(fdsAfter, "\n"))
	}
	t.Logf("goroutines %d -> %d, fds %d -> %d", g0, g, f0, f)
}
