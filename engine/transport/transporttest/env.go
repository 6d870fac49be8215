package transporttest

// The suite's fixture: an owner registry and initiator endpoints, guarded
// buffers, slices tracked to their one Done, and checks of their bytes.

import (
	"bytes"
	"errors"
	"fmt"
	"hash/crc32"
	"math/rand/v2"
	"runtime/pprof"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
)

// env is one subtest's world: an owner registry behind an Owner, a registry
// standing for the initiator engine, and the endpoint between them.
type env struct {
	t        *testing.T
	owner    *Owner
	ownerReg *memory.Registry
	initReg  *memory.Registry
	ep       transport.Endpoint
	mu       sync.Mutex
	mappings [][]byte
	leak     atomic.Bool // a copy may still be stuck: never unmap

	// What the last checkpoint (a barrier's Done, or the window after an
	// Abort) saw, for the check after the factory's teardown: a checksum
	// of each buffer it vouches for, and the slices ended so far.
	buffers   []*buffer
	settled   map[*buffer]uint32
	ended     []*slice
	later     []func() // more checks to run again (see checkAgainLater)
	nextReqID atomic.Uint64
}

func newEnv(t *testing.T, f Factory) *env {
	t.Helper()
	e := &env{t: t, ownerReg: memory.NewRegistry(), initReg: memory.NewRegistry()}
	e.owner = NewOwner(e.ownerReg)
	e.owner.Initiator = e.initReg
	// Registered first, so it runs last: after the factory's teardown
	// stopped every copy.
	t.Cleanup(func() {
		if e.leak.Load() {
			return
		}
		e.mu.Lock()
		defer e.mu.Unlock()
		for _, m := range e.mappings {
			_ = memory.Free(m)
		}
	})
	// Registered before the factory's, so it runs after its teardown.
	t.Cleanup(e.recheckAfterTeardown)
	e.ep = f(t, e.owner)
	if e.ep == nil {
		t.Fatal("factory returned no endpoint")
	}
	return e
}

// checkpoint records the state the test's checks are about to look at:
// a checksum of every buffer whose bytes no copy may change any more, and
// the slices that ended (ss). It runs once a barrier's Done came back, or
// after the window of an aborted endpoint. The owner's buffers count only
// while no path was aborted: an aborted path's WRITEs the owner had
// already received may still land there (only its guard refuses them, and
// the tests of Abort look at the initiator's memory alone).
func (e *env) checkpoint(ss []*slice) {
	aborted := e.ep.Dead()
	e.mu.Lock()
	defer e.mu.Unlock()
	e.settled = make(map[*buffer]uint32, len(e.buffers))
	for _, b := range e.buffers {
		if aborted && b.registry == e.ownerReg {
			continue
		}
		e.settled[b] = crc32.Checksum(b.all, castagnoli)
	}
	e.ended = append(e.ended, ss...)
}

// castagnoli is the checksum table of checkpoints (hardware CRC on amd64
// and arm64, so a checkpoint of every buffer stays cheap).
var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// recheckAfterTeardown looks again, once the factory closed every path
// and the owner's side, at what the last checkpoint saw. A barrier proves
// that a path worked past the slices posted before it only where that
// path runs them in order: rdma stripes slices across NIC pairs and the
// local transport copies each large Post in a goroutine of its own, so a
// late byte or a second Done from another pair or goroutine may come
// after the barrier and after the test's checks. Closing returns only
// once nothing touches the memory any more (transport.Endpoint and
// transport.Transport say so), so whatever was still to come has come: a
// buffer changed since the checkpoint, or a Done run again, fails here.
func (e *env) recheckAfterTeardown() {
	t := e.t
	if e.leak.Load() || e.settled == nil {
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, b := range e.buffers {
		if sum, ok := e.settled[b]; ok && crc32.Checksum(b.all, castagnoli) != sum {
			side := "an initiator"
			if b.registry == e.ownerReg {
				side = "an owner"
			}
			t.Errorf("%s buffer of %d bytes changed after the last checkpoint, by the time the paths were closed: a late byte", side, len(b.data))
		}
	}
	checkOnce(t, e.ended)
	for _, check := range e.later {
		check()
	}
}

// checkAgainLater runs check now, and again after the factory's teardown
// (see recheckAfterTeardown): for counts a test keeps of its own.
func (e *env) checkAgainLater(check func()) {
	check()
	e.mu.Lock()
	e.later = append(e.later, check)
	e.mu.Unlock()
}

// buffer is mapped memory with GuardLen guard bytes on each side and the
// middle registered.
type buffer struct {
	all      []byte // the mapping, guards included
	data     []byte // the registered part: all[GuardLen : GuardLen+n]
	reg      *memory.Region
	registry *memory.Registry
}

// alloc maps n bytes plus guards, fills the guards with GuardByte and the
// data with a pattern from seed, and registers the data in registry.
func (e *env) alloc(registry *memory.Registry, n int, seed uint64) *buffer {
	e.t.Helper()
	var all []byte
	var err error
	if allocShared.Load() {
		all, err = memory.AllocShared(n + 2*GuardLen)
	} else {
		all, _, err = memory.Alloc(n + 2*GuardLen)
	}
	if err != nil {
		e.t.Fatalf("alloc %d bytes: %v", n, err)
	}
	e.mu.Lock()
	e.mappings = append(e.mappings, all)
	e.mu.Unlock()
	b := &buffer{all: all, data: all[GuardLen : GuardLen+n : GuardLen+n], registry: registry}
	e.mu.Lock()
	e.buffers = append(e.buffers, b)
	e.mu.Unlock()
	for i := range GuardLen {
		all[i] = GuardByte
		all[len(all)-1-i] = GuardByte
	}
	fill(b.data, seed)
	b.register(e.t)
	return b
}

func (b *buffer) register(t *testing.T) {
	t.Helper()
	regs, err := b.registry.Register([]memory.Range{{Mem: b.data, Location: "cpu"}})
	if err != nil {
		t.Fatalf("register: %v", err)
	}
	b.reg = regs[0]
}

func (b *buffer) unregister(t *testing.T) {
	t.Helper()
	if _, err := b.registry.Unregister([]uint64{b.reg.Addr}); err != nil {
		t.Fatalf("unregister: %v", err)
	}
}

// fill writes a pseudo-random pattern derived from seed.
func fill(b []byte, seed uint64) {
	var s [32]byte
	for i := range 4 {
		for j := range 8 {
			s[i*8+j] = byte((seed + uint64(i)*0x9e3779b97f4a7c15) >> (8 * j))
		}
	}
	_, _ = rand.NewChaCha8(s).Read(b)
}

// slice is a transport.Slice that counts its Done calls.
type slice struct {
	transport.Slice
	calls atomic.Int32
	err   error         // the first Done's error; read after done is closed
	done  chan struct{} // closed by the first Done
	name  string
}

func newTracked(name string) *slice {
	s := &slice{done: make(chan struct{}), name: name}
	s.Done = func(_ *transport.Slice, err error) {
		if s.calls.Add(1) == 1 {
			s.err = err
			close(s.done)
		}
	}
	return s
}

// newSlice makes a slice moving n bytes between local.data[localOff:] and
// owner.data[ownerOff:] under owner's current key.
func (e *env) newSlice(op transport.Op, local *buffer, localOff int, owner *buffer, ownerOff, n int) *slice {
	s := newTracked(fmt.Sprintf("%v of %d bytes at owner offset %d, local offset %d", op, n, ownerOff, localOff))
	s.Op = op
	s.Local = local.data[localOff : localOff+n : localOff+n]
	s.LocalReg = local.reg
	s.Key = owner.reg.Key
	s.Remote = owner.reg.Addr + uint64(ownerOff)
	s.RequestID = e.nextReqID.Add(1)
	s.Reset()
	return s
}

// barrier posts one small WRITE between buffers of its own on the suite's
// endpoint after everything posted so far, and waits for its Done (see
// barrierOn).
func (e *env) barrier() {
	e.t.Helper()
	e.barrierOn(e.ep)
}

// barrierOn posts one small WRITE between buffers of its own on ep after
// everything posted there so far, and waits for its Done. A path that runs
// its slices in the order of Post has then worked past every earlier slice:
// a late byte or a second Done of one of them would have come before it,
// so the checks that look for none are not vacuous on a slow machine. On a
// dead endpoint it ends at once, failed; nothing looks at its outcome.
func (e *env) barrierOn(ep transport.Endpoint) {
	e.t.Helper()
	owner, local := e.alloc(e.ownerReg, 4096, 91), e.alloc(e.initReg, 4096, 92)
	s := e.newSlice(transport.Write, local, 0, owner, 0, 4096)
	ep.Post(base([]*slice{s}))
	if !wait(e.t, []*slice{s}, doneTimeout) {
		e.leak.Store(true)
		e.t.FailNow()
	}
	e.checkpoint([]*slice{s})
}

func base(ss []*slice) []*transport.Slice {
	out := make([]*transport.Slice, len(ss))
	for i, s := range ss {
		out[i] = &s.Slice
	}
	return out
}

// wait waits until every slice ended once or the timeout passed, and
// reports the slices still running.
func wait(t *testing.T, ss []*slice, timeout time.Duration) bool {
	t.Helper()
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for i, s := range ss {
		select {
		case <-s.done:
		case <-deadline.C:
			hung := 0
			for _, s := range ss[i:] {
				select {
				case <-s.done:
				default:
					if hung < 5 {
						t.Errorf("slice %s hangs: no Done after %v (state %d)", s.name, timeout, s.State())
					}
					hung++
				}
			}
			t.Errorf("%d of %d slices hang", hung, len(ss))
			return false
		}
	}
	return true
}

// endAll waits for every slice of ss to end, failing the test at once when
// one hangs; then it posts a barrier and checks that each Done ran once.
func (e *env) endAll(t *testing.T, ss []*slice) {
	t.Helper()
	if !wait(t, ss, doneTimeout) {
		e.leak.Store(true)
		t.FailNow()
	}
	e.mu.Lock()
	e.ended = append(e.ended, ss...) // for the barrier's checkpoint
	e.mu.Unlock()
	e.barrier()
	checkOnce(t, ss)
}

// endAborted is endAll for the slices of an aborted endpoint, which has no
// path left to post a barrier on. Abort's return is the barrier there (the
// path no longer touches any slice's memory, transport.Endpoint says): the
// window is no synchronization, it only gives a late Done or byte, which
// would break that promise, time to show before the checks.
func (e *env) endAborted(t *testing.T, ss []*slice, window time.Duration) {
	t.Helper()
	if !wait(t, ss, doneTimeout) {
		e.leak.Store(true)
		t.FailNow()
	}
	time.Sleep(window)
	e.checkpoint(ss)
	checkOnce(t, ss)
}

// tally counts the slices of ss that completed and those an abort failed
// with a connection error; any other outcome fails the test.
func tally(t *testing.T, ss []*slice) (ok, conn int) {
	t.Helper()
	for _, s := range ss {
		switch {
		case s.err == nil:
			ok++
		case errors.Is(s.err, transport.ErrConnection):
			conn++
		default:
			t.Errorf("slice %s ended with %v; want success or an error matching transport.ErrConnection", s.name, s.err)
		}
	}
	return ok, conn
}

// checkOnce reports slices whose Done did not run exactly once.
func checkOnce(t *testing.T, ss []*slice) {
	t.Helper()
	for _, s := range ss {
		if n := s.calls.Load(); n != 1 {
			t.Errorf("slice %s: Done called %d times, want exactly 1", s.name, n)
		}
	}
}

// compare reports where got differs from want; what names the memory.
func compare(t *testing.T, what string, want, got []byte) bool {
	t.Helper()
	if bytes.Equal(want, got) {
		return true
	}
	first, n := -1, 0
	for i := range want {
		if want[i] != got[i] {
			if first < 0 {
				first = i
			}
			n++
		}
	}
	where := "registered data"
	if first < GuardLen || first >= len(want)-GuardLen {
		where = "guard bytes"
	}
	t.Errorf("%s: %d bytes differ; first at mapping offset %d (%s): got %#02x, want %#02x",
		what, n, first, where, got[first], want[first])
	return false
}

// dumpGoroutines logs every goroutine's stack, to show where a hang is.
func dumpGoroutines(t *testing.T) {
	t.Helper()
	var b strings.Builder
	_ = pprof.Lookup("goroutine").WriteTo(&b, 1)
	t.Logf("goroutines:\n%s", b.String())
}

// WaitFor polls cond until it holds or timeout passes, and reports whether
// it held: for transports' own tests that wait on a condition.
func WaitFor(timeout time.Duration, cond func() bool) bool { return waitFor(timeout, cond) }

// waitFor polls cond until it holds or timeout passes.
func waitFor(timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(100 * time.Microsecond)
	}
	return true
}

// Transfers.

// spec is one slice of a data test: n bytes between the initiator buffer at
// localOff and the owner buffer at ownerOff. Specs of one batch never
// overlap on either side.
type spec struct {
	op                 transport.Op
	ownerOff, localOff int
	n                  int
}

// transfer moves specs, posting perPost slices at a time from goroutines
// goroutines, and checks both buffers byte for byte, guards included.
func (e *env) transfer(t *testing.T, owner, local *buffer, specs []spec, goroutines, perPost int) {
	t.Helper()
	ownerWant, localWant := bytes.Clone(owner.all), bytes.Clone(local.all)
	for _, sp := range specs {
		o, l := GuardLen+sp.ownerOff, GuardLen+sp.localOff
		if sp.op == transport.Write {
			copy(ownerWant[o:o+sp.n], local.all[l:l+sp.n])
		} else {
			copy(localWant[l:l+sp.n], owner.all[o:o+sp.n])
		}
	}
	ss := make([]*slice, len(specs))
	for i, sp := range specs {
		ss[i] = e.newSlice(sp.op, local, sp.localOff, owner, sp.ownerOff, sp.n)
	}
	var wg sync.WaitGroup
	for g := range goroutines {
		var mine []*slice
		for i := g; i < len(ss); i += goroutines {
			mine = append(mine, ss[i])
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for len(mine) > 0 {
				k := min(perPost, len(mine))
				e.ep.Post(base(mine[:k]))
				mine = mine[k:]
			}
		}()
	}
	wg.Wait()
	e.endAll(t, ss)
	failed := 0
	for _, s := range ss {
		if s.err != nil {
			if failed < 5 {
				t.Errorf("slice %s failed: %v", s.name, s.err)
			}
			failed++
		}
	}
	if failed > 0 {
		t.Errorf("%d of %d slices failed", failed, len(ss))
	}
	compare(t, "owner memory", ownerWant, owner.all)
	compare(t, "initiator memory", localWant, local.all)
	if e.ep.Dead() {
		t.Errorf("endpoint is dead after transfers that all should succeed")
	}
}

func sizeName(n int) string {
	switch {
	case n == 1:
		return "1 byte"
	case n%mib == 0:
		return fmt.Sprintf("%d MiB", n/mib)
	case n > mib:
		return fmt.Sprintf("%d MiB + %d", n/mib, n%mib)
	case n%1024 == 0:
		return fmt.Sprintf("%d KiB", n/1024)
	}
	return fmt.Sprintf("%d bytes", n)
}
