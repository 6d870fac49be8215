package transporttest

// Bad accesses are refused without touching memory, alone and among good
// ones.

import (
	"bytes"
	"errors"
	"fmt"
	"testing"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
)

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
	asked := e.owner.Admits.Load() != admits // before the barrier's own admission
	e.barrier()
	checkOnce(t, []*slice{s})
	checkRefused(t, s)
	if !asked {
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
	e.endAll(t, all)
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

// Unregistration while a WRITE is in flight.
