// Package transporttest is a conformance suite for transport.Endpoint
// implementations. Run connects fresh initiator endpoints to an owner whose
// memory is a memory.Registry (through Owner, an adaptor like the engine's
// Admit) and checks what every transport promises: data moved byte for byte,
// bad accesses refused without touching memory, unregistration and Abort
// that stop copies when they return, TryCancel that keeps a slice's memory
// untouched, and exactly one Done per slice.
package transporttest

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"runtime/pprof"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
)

// Factory connects a new initiator-side endpoint to owner, whose memory the
// endpoint's slices access. It registers the teardown of whatever it built
// (endpoint, transports, listeners) with t.Cleanup. The suite calls it once
// per subtest.
type Factory func(t *testing.T, owner transport.Owner) transport.Endpoint

// Sizes and timings of the suite.
const (
	// GuardLen bytes of GuardByte surround every buffer the suite registers;
	// no transport may touch them.
	GuardLen  = 4096
	GuardByte = 0xAA

	mib = 1 << 20

	// doneTimeout bounds the wait for slices that should end; a slice
	// still running then is reported as hung.
	doneTimeout = 20 * time.Second
)

// Run runs the suite against the endpoints f builds.
func Run(t *testing.T, f Factory) {
	before := transport.IllegalTransitions()
	t.Cleanup(func() {
		if n := transport.IllegalTransitions() - before; n > 0 {
			t.Errorf("%d slice state moves the state table refuses", n)
		}
	})
	t.Run("transfers", func(t *testing.T) { runTransfers(t, f) })
	t.Run("refusals", func(t *testing.T) { runRefusals(t, f) })
	t.Run("unregistering owner memory during a large WRITE stops it before Unregister returns", func(t *testing.T) {
		testUnregisterInFlight(t, f)
	})
	t.Run("unregistering initiator memory during a large READ stops it before Unregister returns", func(t *testing.T) {
		testUnregisterLocalInFlight(t, f)
	})
	t.Run("TryCancel of queued slices keeps them from ending and from touching memory", func(t *testing.T) {
		testTryCancelQueued(t, f)
	})
	t.Run("Abort with slices queued and in flight fails each of them exactly once", func(t *testing.T) {
		testAbortQueuedAndInFlight(t, f)
	})
	t.Run("slices failed by Abort can be reset and posted again on a fresh endpoint", func(t *testing.T) {
		testRepostAfterAbort(t, f)
	})
	t.Run("Abort from several goroutines during a busy stream ends every slice exactly once and stops touching memory", func(t *testing.T) {
		testAbortBusyStream(t, f)
	})
	t.Run("Abort returns promptly while the path is busy sending a long Post", func(t *testing.T) {
		testAbortLongPost(t, f)
	})
}

// ---------------------------------------------------------------------------
// Environment: registries, buffers with guard bytes, tracked slices.

// env is one subtest's world: an owner registry behind an Owner, a registry
// standing for the initiator engine, and the endpoint between them.
type env struct {
	t         *testing.T
	owner     *Owner
	ownerReg  *memory.Registry
	initReg   *memory.Registry
	ep        transport.Endpoint
	mu        sync.Mutex
	mappings  [][]byte
	leak      atomic.Bool // a copy may still be stuck: never unmap
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
	e.ep = f(t, e.owner)
	if e.ep == nil {
		t.Fatal("factory returned no endpoint")
	}
	return e
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
	all, _, err := memory.Alloc(n + 2*GuardLen)
	if err != nil {
		e.t.Fatalf("alloc %d bytes: %v", n, err)
	}
	e.mu.Lock()
	e.mappings = append(e.mappings, all)
	e.mu.Unlock()
	b := &buffer{all: all, data: all[GuardLen : GuardLen+n : GuardLen+n], registry: registry}
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

// ---------------------------------------------------------------------------
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
	if !wait(t, ss, doneTimeout) {
		e.leak.Store(true)
		t.FailNow()
	}
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
	time.Sleep(time.Millisecond) // a second Done would most likely come by now
	checkOnce(t, ss)
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

func runTransfers(t *testing.T, f Factory) {
	ops := []transport.Op{transport.Write, transport.Read}
	for _, op := range ops {
		for _, n := range []int{1, 4096, mib + 1, 16 * mib} {
			t.Run(fmt.Sprintf("a %v of %s arrives byte for byte", op, sizeName(n)), func(t *testing.T) {
				e := newEnv(t, f)
				size := n + 64<<10
				owner, local := e.alloc(e.ownerReg, size, 1), e.alloc(e.initReg, size, 2)
				// Odd offsets, so no transport gets by on alignment.
				e.transfer(t, owner, local, []spec{{op: op, ownerOff: 4097 + 3, localOff: 12345, n: n}}, 1, 1)
			})
		}
	}
	for _, op := range ops {
		t.Run(fmt.Sprintf("%v slices at the very start and the very end of a registered range move intact", op), func(t *testing.T) {
			e := newEnv(t, f)
			const regionLen = 3 * mib
			owner, local := e.alloc(e.ownerReg, regionLen, 3), e.alloc(e.initReg, regionLen, 4)
			for _, n := range []int{1, 4096, mib + 1} {
				e.transfer(t, owner, local, []spec{
					{op: op, ownerOff: 0, localOff: regionLen - n, n: n},
					{op: op, ownerOff: regionLen - n, localOff: 0, n: n},
				}, 1, 2)
				fill(owner.data, uint64(n))
				fill(local.data, uint64(n)+1)
			}
		})
	}
	t.Run("many slices of mixed sizes and directions posted in one Post all arrive intact", func(t *testing.T) {
		e := newEnv(t, f)
		owner, local := e.alloc(e.ownerReg, 16*mib, 5), e.alloc(e.initReg, 16*mib, 6)
		e.transfer(t, owner, local, mixedSpecs(1000, 7, 16*mib), 1, 1000)
	})
	t.Run("concurrent Posts from several goroutines all arrive intact", func(t *testing.T) {
		e := newEnv(t, f)
		owner, local := e.alloc(e.ownerReg, 16*mib, 8), e.alloc(e.initReg, 16*mib, 9)
		e.transfer(t, owner, local, mixedSpecs(1000, 10, 16*mib), 8, 5)
	})
}

// mixedSpecs lays out count slices of random sizes (mostly small, some up
// to 256 KiB) and random directions, at random gaps, within limit bytes on
// each side; the initiator side is laid out in a shuffled order so slices
// do not pair up offset for offset.
func mixedSpecs(count int, seed uint64, limit int) []spec {
	r := rand.New(rand.NewPCG(seed, 42))
	sizes := make([]int, count)
	total := 0
	for i := range sizes {
		switch r.IntN(16) {
		case 0:
			sizes[i] = 1 + r.IntN(256<<10)
		case 1, 2, 3, 4:
			sizes[i] = 1 + r.IntN(16)
		default:
			sizes[i] = 1 + r.IntN(8<<10)
		}
		total += sizes[i]
	}
	if total > limit {
		panic(fmt.Sprintf("transporttest: %d slices of %d bytes in all do not fit in %d", count, total, limit))
	}
	gap := max(0, (limit-total)/count-1)
	specs := make([]spec, count)
	off := 0
	for i := range specs {
		off += r.IntN(gap + 1)
		specs[i] = spec{op: transport.Write, ownerOff: off, n: sizes[i]}
		if r.IntN(2) == 0 {
			specs[i].op = transport.Read
		}
		off += sizes[i]
	}
	off = 0
	for _, i := range r.Perm(count) {
		off += r.IntN(gap + 1)
		specs[i].localOff = off
		off += sizes[i]
	}
	return specs
}

// ---------------------------------------------------------------------------
// Refusals.

// badCase builds an access the owner must refuse: the key, owner address and
// length of the slice, from a registered owner buffer (and, for cases about
// stale registrations, a buffer of their own).
type badCase struct {
	name string
	make func(e *env, owner *buffer) (key memory.Key, addr uint64, n int, extra *buffer)
}

var badCases = []badCase{
	{"an unknown buffer key", func(e *env, o *buffer) (memory.Key, uint64, int, *buffer) {
		// Another tag: no registry of this engine ever handed out that key.
		return o.reg.Key ^ memory.Key(0x5a5a<<40), o.reg.Addr, 4096, nil
	}},
	{"a range running past the region's end", func(e *env, o *buffer) (memory.Key, uint64, int, *buffer) {
		return o.reg.Key, o.reg.End() - 100, 4096, nil
	}},
	{"a range starting 1 byte past the region's end", func(e *env, o *buffer) (memory.Key, uint64, int, *buffer) {
		return o.reg.Key, o.reg.End(), 1, nil
	}},
	{"an address before the region", func(e *env, o *buffer) (memory.Key, uint64, int, *buffer) {
		return o.reg.Key, o.reg.Addr - 64, 4096, nil
	}},
	{"a range wrapping around the address space", func(e *env, o *buffer) (memory.Key, uint64, int, *buffer) {
		return o.reg.Key, ^uint64(0) - 100, 4096, nil
	}},
	{"the key of a range that was unregistered", func(e *env, o *buffer) (memory.Key, uint64, int, *buffer) {
		x := e.alloc(e.ownerReg, 64<<10, 77)
		key := x.reg.Key
		x.unregister(e.t)
		return key, x.reg.Addr, 4096, x
	}},
	{"the old key of a range unregistered and registered again", func(e *env, o *buffer) (memory.Key, uint64, int, *buffer) {
		x := e.alloc(e.ownerReg, 64<<10, 78)
		key := x.reg.Key
		x.unregister(e.t)
		x.register(e.t)
		return key, x.reg.Addr, 4096, x
	}},
}

func runRefusals(t *testing.T, f Factory) {
	for _, op := range []transport.Op{transport.Write, transport.Read} {
		for _, bc := range badCases {
			t.Run(fmt.Sprintf("a %v naming %s is refused and touches nothing", op, bc.name), func(t *testing.T) {
				testRefusal(t, f, op, bc)
			})
		}
	}
	t.Run("refused slices among good ones in one Post fail alone", func(t *testing.T) {
		testRefusalsAmongGood(t, f)
	})
}

func checkRefused(t *testing.T, s *slice) {
	t.Helper()
	switch {
	case s.err == nil:
		t.Errorf("slice %s succeeded; want a refusal", s.name)
	case !errors.Is(s.err, transport.ErrRefused):
		t.Errorf("slice %s failed with %q; want an error matching transport.ErrRefused", s.name, s.err)
	case transport.Retryable(s.err):
		t.Errorf("slice %s: refusal %q is retryable; a refusal is final", s.name, s.err)
	}
}

func testRefusal(t *testing.T, f Factory, op transport.Op, bc badCase) {
	e := newEnv(t, f)
	owner, local := e.alloc(e.ownerReg, 1*mib, 11), e.alloc(e.initReg, 1*mib, 12)
	key, addr, n, extra := bc.make(e, owner)
	ownerBefore, localBefore := bytes.Clone(owner.all), bytes.Clone(local.all)
	var extraBefore []byte
	if extra != nil {
		extraBefore = bytes.Clone(extra.all)
	}
	admits := e.owner.Admits.Load()

	s := newTracked(fmt.Sprintf("%v naming %s", op, bc.name))
	s.Op, s.Local, s.LocalReg = op, local.data[100:100+n], local.reg
	s.Key, s.Remote, s.RequestID = key, addr, e.nextReqID.Add(1)
	s.Reset()
	e.ep.Post([]*transport.Slice{&s.Slice})
	if !wait(t, []*slice{s}, doneTimeout) {
		e.leak.Store(true)
		t.FailNow()
	}
	time.Sleep(time.Millisecond)
	checkOnce(t, []*slice{s})
	checkRefused(t, s)
	if e.owner.Admits.Load() == admits {
		t.Errorf("the owner was never asked: the refusal did not come from the owner")
	}
	compare(t, "owner memory", ownerBefore, owner.all)
	compare(t, "initiator memory", localBefore, local.all)
	if extra != nil {
		compare(t, "the unregistered range", extraBefore, extra.all)
	}
	if e.ep.Dead() {
		t.Fatalf("the endpoint died of a refusal; a refusal ends one slice, not the path")
	}
	// The path still works.
	e.transfer(t, owner, local, []spec{{op: transport.Write, ownerOff: 0, localOff: 0, n: 4096}, {op: transport.Read, ownerOff: 8192, localOff: 8192, n: 4096}}, 1, 2)
}

func testRefusalsAmongGood(t *testing.T, f Factory) {
	e := newEnv(t, f)
	owner, local := e.alloc(e.ownerReg, 4*mib, 13), e.alloc(e.initReg, 4*mib, 14)
	ownerWant, localWant := bytes.Clone(owner.all), bytes.Clone(local.all)
	var good, bad []*slice
	var all []*slice
	for i := range 16 {
		op := transport.Write
		if i%4 >= 2 {
			op = transport.Read
		}
		off := i * (64 << 10)
		n := 64<<10 - 7*i
		if i%2 == 0 {
			s := e.newSlice(op, local, off, owner, off, n)
			if op == transport.Write {
				copy(ownerWant[GuardLen+off:][:n], local.data[off:off+n])
			} else {
				copy(localWant[GuardLen+off:][:n], owner.data[off:off+n])
			}
			good = append(good, s)
			all = append(all, s)
			continue
		}
		// Past the end of the region by a little.
		s := e.newSlice(op, local, off, owner, off, n)
		s.Remote = owner.reg.End() - uint64(n/2)
		bad = append(bad, s)
		all = append(all, s)
	}
	e.ep.Post(base(all))
	if !wait(t, all, doneTimeout) {
		e.leak.Store(true)
		t.FailNow()
	}
	time.Sleep(time.Millisecond)
	checkOnce(t, all)
	for _, s := range good {
		if s.err != nil {
			t.Errorf("good slice %s failed next to refused ones: %v", s.name, s.err)
		}
	}
	for _, s := range bad {
		checkRefused(t, s)
	}
	compare(t, "owner memory", ownerWant, owner.all)
	compare(t, "initiator memory", localWant, local.all)
	if e.ep.Dead() {
		t.Errorf("the endpoint died of refusals; a refusal ends one slice, not the path")
	}
}

// ---------------------------------------------------------------------------
// Unregistration while a WRITE is in flight.

func testUnregisterInFlight(t *testing.T, f Factory) {
	e := newEnv(t, f)
	const half = 16 * mib
	owner := e.alloc(e.ownerReg, 2*half, 21)
	local := e.alloc(e.initReg, 2*half, 0)
	for i := range local.data[:half] {
		local.data[i] = 0x11
	}
	for i := range local.data[half:] {
		local.data[half+i] = 0x22
	}
	// Eight 16 MiB WRITEs; each half of the owner range alternately gets
	// 0x11 and 0x22, so any byte landing after Unregister changes memory.
	var ss []*slice
	for i := range 8 {
		ss = append(ss, e.newSlice(transport.Write, local, ((i/2)%2)*half, owner, (i%2)*half, half))
	}
	e.ep.Post(base(ss))
	// Wait for the first chunks to land, so the unregistration strikes
	// while a WRITE is being copied.
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
		t.Fatalf("the WRITEs neither started nor ended within 5 s")
	}
	unregistered := make(chan error, 1)
	go func() {
		_, err := e.ownerReg.Unregister([]uint64{owner.reg.Addr})
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
		t.Fatalf("Unregister hangs for 10 s while a WRITE is in flight")
	}
	after := bytes.Clone(owner.all)
	if !wait(t, ss, doneTimeout) {
		e.leak.Store(true)
		t.FailNow()
	}
	time.Sleep(20 * time.Millisecond)
	checkOnce(t, ss)
	compare(t, "owner memory after Unregister returned", after, owner.all)
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
	e := newEnv(t, f)
	const half = 16 * mib
	owner := e.alloc(e.ownerReg, 2*half, 0)
	local := e.alloc(e.initReg, 2*half, 22)
	for i := range owner.data[:half] {
		owner.data[i] = 0x11
	}
	for i := range owner.data[half:] {
		owner.data[half+i] = 0x22
	}
	// Each half of the local range alternately gets 0x11 and 0x22.
	var ss []*slice
	for i := range 8 {
		ss = append(ss, e.newSlice(transport.Read, local, (i%2)*half, owner, ((i/2)%2)*half, half))
	}
	e.ep.Post(base(ss))
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
		t.Fatalf("the READs neither started nor ended within 5 s")
	}
	unregistered := make(chan error, 1)
	go func() {
		_, err := e.initReg.Unregister([]uint64{local.reg.Addr})
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
		t.Fatalf("Unregister hangs for 10 s while a READ is in flight")
	}
	after := bytes.Clone(local.all)
	if !wait(t, ss, doneTimeout) {
		e.leak.Store(true)
		t.FailNow()
	}
	time.Sleep(20 * time.Millisecond)
	checkOnce(t, ss)
	compare(t, "initiator memory after Unregister returned", after, local.all)
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

// ---------------------------------------------------------------------------
// TryCancel and Abort.

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
	time.Sleep(50 * time.Millisecond) // let a socket fill and its sender block
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
	if !wait(t, rest, doneTimeout) {
		e.leak.Store(true)
		t.FailNow()
	}
	time.Sleep(20 * time.Millisecond)
	checkOnce(t, rest)
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

// abortPromptly is how long Abort may take on a path whose owner keeps up:
// it stops copies "now", so anything near a socket timeout is a hang.
const abortPromptly = 3 * time.Second

// abort calls Abort on another goroutine, lets the owner go once the
// endpoint reports Dead (Abort may wait for a copy held at admission), and
// waits for Abort to return.
func (e *env) abort(t *testing.T, release func()) { e.abortN(t, release, 1) }

// abortN is abort with n callers of Abort at once (the engine may abort a
// path from several goroutines); every one of them must return.
func (e *env) abortN(t *testing.T, release func(), n int) {
	t.Helper()
	aborted := make(chan struct{})
	var callers sync.WaitGroup
	for i := range n {
		callers.Add(1)
		go func() {
			defer callers.Done()
			e.ep.Abort(fmt.Errorf("transporttest: abort %d", i))
		}()
	}
	go func() {
		callers.Wait()
		close(aborted)
	}()
	if !waitFor(5*time.Second, e.ep.Dead) {
		t.Errorf("Dead() is still false 5 s after Abort was called")
	}
	if release != nil {
		release()
	}
	select {
	case <-aborted:
	case <-time.After(10 * time.Second):
		e.leak.Store(true)
		dumpGoroutines(t)
		t.Fatalf("Abort hangs for 10 s")
	}
	if !e.ep.Dead() {
		t.Errorf("Dead() is false after Abort returned")
	}
}

// checkPostAfterAbort posts slices to the aborted endpoint: each must fail
// with a connection error before Post returns.
func (e *env) checkPostAfterAbort(t *testing.T, owner, local *buffer) {
	t.Helper()
	// Only the initiator's memory is checked: the owner may still be
	// applying bytes of an aborted WRITE that had reached its socket.
	localBefore := bytes.Clone(local.all)
	ss := []*slice{
		e.newSlice(transport.Write, local, 0, owner, 0, 4096),
		e.newSlice(transport.Read, local, 8192, owner, 8192, 4096),
		e.newSlice(transport.Write, local, mib, owner, mib, mib+1),
	}
	e.ep.Post(base(ss))
	for _, s := range ss {
		select {
		case <-s.done:
			if !errors.Is(s.err, transport.ErrConnection) {
				t.Errorf("slice %s posted after Abort ended with %v; want an error matching transport.ErrConnection", s.name, s.err)
			}
		default:
			t.Errorf("slice %s posted after Abort did not fail at once", s.name)
		}
	}
	wait(t, ss, doneTimeout)
	time.Sleep(5 * time.Millisecond)
	checkOnce(t, ss)
	compare(t, "initiator memory after a Post after Abort", localBefore, local.all)
}

func testAbortQueuedAndInFlight(t *testing.T, f Factory) {
	e := newEnv(t, f)
	owner := e.alloc(e.ownerReg, 32*mib, 41)
	local := e.alloc(e.initReg, 48*mib, 42)
	tail := e.tail(owner, local, 16)
	head, release := e.stalled(t, owner, local, tail)
	// Two are canceled first: Abort must then leave them alone.
	canceled := tail[:2]
	for _, s := range canceled {
		if !s.TryCancel() {
			t.Fatalf("TryCancel of queued slice %s failed", s.name)
		}
	}
	live := append(append([]*slice(nil), head...), tail[2:]...)

	e.abort(t, release)
	snapshot := bytes.Clone(local.all)
	for _, s := range live {
		select {
		case <-s.done:
		default:
			t.Errorf("slice %s had not ended when Abort returned (state %d)", s.name, s.State())
		}
	}
	if !wait(t, live, doneTimeout) {
		e.leak.Store(true)
		t.FailNow()
	}
	time.Sleep(50 * time.Millisecond)
	checkOnce(t, live)
	for _, s := range live {
		if !errors.Is(s.err, transport.ErrConnection) {
			t.Errorf("slice %s ended with %v; want an error matching transport.ErrConnection", s.name, s.err)
		} else if !transport.Retryable(s.err) {
			t.Errorf("slice %s: connection error %q is not retryable", s.name, s.err)
		}
	}
	for _, s := range canceled {
		if n := s.calls.Load(); n != 0 {
			t.Errorf("slice %s canceled before Abort: Done called %d times, want never", s.name, n)
		}
	}
	compare(t, "initiator memory after Abort returned", snapshot, local.all)
	e.checkPostAfterAbort(t, owner, local)
}

func testAbortBusyStream(t *testing.T, f Factory) {
	e := newEnv(t, f)
	owner := e.alloc(e.ownerReg, 8*mib, 51)
	local := e.alloc(e.initReg, 8*mib, 52)
	const (
		goroutines = 4
		posts      = 64
		window     = 2 * mib
		n          = 128 << 10
	)
	var mu sync.Mutex
	var all []*slice
	var wg sync.WaitGroup
	start := make(chan struct{})
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			for p := range posts {
				off := g*window + (p*2*n)%window
				ss := []*slice{
					e.newSlice(transport.Write, local, off, owner, off, n),
					e.newSlice(transport.Read, local, off+n, owner, off+n, n),
				}
				mu.Lock()
				all = append(all, ss...)
				mu.Unlock()
				e.ep.Post(base(ss))
			}
		}()
	}
	close(start)
	waitFor(time.Second, func() bool { return e.owner.Admits.Load() >= 8 })
	e.abortN(t, nil, 3)
	snapshot := bytes.Clone(local.all)
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	if !wait(t, all, doneTimeout) {
		e.leak.Store(true)
		t.FailNow()
	}
	time.Sleep(50 * time.Millisecond)
	checkOnce(t, all)
	ok, conn := 0, 0
	for _, s := range all {
		switch {
		case s.err == nil:
			ok++
		case errors.Is(s.err, transport.ErrConnection):
			conn++
		default:
			t.Errorf("slice %s ended with %v; want success or an error matching transport.ErrConnection", s.name, s.err)
		}
	}
	t.Logf("%d slices completed, %d failed by the abort", ok, conn)
	compare(t, "initiator memory after Abort returned", snapshot, local.all)
	e.checkPostAfterAbort(t, owner, local)
}

// testAbortLongPost aborts a path busy sending one long Post and, the
// moment it is dead, stops the owner reading (as a slow or paused peer
// would). The Post starts with tiny WRITEs alternating between two
// initiator regions (so a sender cannot gather them into one write) and
// tiny READs, which the owner answers as fast as they come, so the sender
// is busy writing rather than waiting when Abort strikes; big READs and
// WRITEs follow, so a sender that goes on after Abort fills every buffer.
// Abort must cut the path at once, whatever the owner does; the owner is
// let go after a moment, since a transport that copies in the caller's
// process (local) may rightly wait for an admission in progress.
func testAbortLongPost(t *testing.T, f Factory) {
	e := newEnv(t, f)
	owner := e.alloc(e.ownerReg, 4*mib, 61)
	localA := e.alloc(e.initReg, 4*mib, 62)
	localB := e.alloc(e.initReg, 64<<10, 63)
	const tinyGroups, bigReads, bigWrites = 10000, 500, 200
	ss := make([]*slice, 0, 4*tinyGroups+bigReads+bigWrites)
	for range tinyGroups {
		ss = append(ss,
			e.newSlice(transport.Write, localA, 0, owner, 0, 64),
			e.newSlice(transport.Read, localA, 4096, owner, 4096, 64),
			e.newSlice(transport.Write, localB, 0, owner, 64, 64),
			e.newSlice(transport.Read, localA, 8192, owner, 8192, 64),
		)
	}
	for range bigReads {
		ss = append(ss, e.newSlice(transport.Read, localA, mib, owner, mib, mib))
	}
	for range bigWrites {
		ss = append(ss, e.newSlice(transport.Write, localA, 2*mib, owner, 2*mib, mib))
	}
	e.ep.Post(base(ss))
	if !waitFor(5*time.Second, func() bool { return e.owner.Admits.Load() >= 2000 || e.owner.progress() >= 2000 }) {
		t.Fatalf("the owner admitted only %d slices in 5 s (progress %d)", e.owner.Admits.Load(), e.owner.progress())
	}
	start := time.Now()
	aborted := make(chan struct{})
	go func() {
		e.ep.Abort(errors.New("transporttest: abort"))
		close(aborted)
	}()
	for !e.ep.Dead() {
		if time.Since(start) > 5*time.Second {
			t.Fatalf("Dead() is still false 5 s after Abort was called")
		}
		runtime.Gosched()
	}
	release := e.owner.Hold()
	t.Cleanup(release)
	select {
	case <-aborted:
	case <-time.After(500 * time.Millisecond):
		release()
		select {
		case <-aborted:
		case <-time.After(abortPromptly):
			dumpGoroutines(t)
			// The factory's teardown cuts the path from the owner's side,
			// which ends this Abort; waiting here for a socket timeout
			// would only slow the suite down.
			e.leak.Store(true)
			t.Fatalf("Abort has not returned %v after it was called, nor %v after the owner was let go",
				time.Since(start).Round(time.Millisecond), abortPromptly)
		}
	}
	t.Logf("Abort returned after %v", time.Since(start).Round(time.Microsecond))
	release()
	if !wait(t, ss, doneTimeout) {
		e.leak.Store(true)
		t.FailNow()
	}
	checkOnce(t, ss)
	ok, conn := 0, 0
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
	t.Logf("%d slices completed, %d failed by the abort", ok, conn)
}

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
	time.Sleep(20 * time.Millisecond)
	for i, o := range outcomes {
		s := tail[i]
		if n := o.calls.Load(); n != 2 {
			t.Errorf("slice %s: Done called %d times over two endpoints, want 2", s.name, n)
		}
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
