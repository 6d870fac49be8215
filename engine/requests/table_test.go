package requests_test

// Tests of the owner's request table run against real registered memory;
// the helpers they share are here, with the tests of which states the
// table keeps for plain traffic. Abort, grants, tombstones and bounds have
// files of their own.

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/requests"
	"github.com/kvferry/kvferry/engine/transport"
)

// testRegion registers n bytes of Go memory in a fresh registry, so guards
// pin a real region and a test can check afterwards that none was left
// pinned (see requireUnpinned).
func testRegion(t *testing.T, n int) (*memory.Registry, *memory.Region) {
	t.Helper()
	reg := memory.NewRegistry()
	regs, err := reg.Register([]memory.Range{{Mem: make([]byte, n), Location: "cpu"}})
	if err != nil {
		t.Fatalf("Register: %v", err)
	}
	return reg, regs[0]
}

// requireUnpinned unregisters r, which returns only once no Enter of it is
// left without its Leave: a refused guard that kept its region pinned would
// hang here. It ends r's life, so call it last.
func requireUnpinned(t *testing.T, reg *memory.Registry, r *memory.Region) {
	t.Helper()
	var err error
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, err = reg.Unregister([]uint64{r.Addr})
	}()
	closesSoon(t, "Unregister did not return: a guard left the region pinned (Enter without Leave)", done)
	if err != nil {
		t.Fatalf("Unregister: %v", err)
	}
}

// acc builds a write access of n bytes at offset off of r, so each test
// states only the fields it is about.
func acc(r *memory.Region, initiator string, rid uint64, gen uint32, grant uint64, off, n uint64) *transport.Access {
	return &transport.Access{Op: transport.Write, Initiator: initiator, RequestID: rid, Generation: gen,
		GrantID: grant, Key: r.Key, Addr: r.Addr + off, Length: n}
}

// admit admits a and fails the test if the table refuses it.
func admit(t *testing.T, tbl *requests.Table, a *transport.Access, r *memory.Region) transport.Guard {
	t.Helper()
	g, err := tbl.Admit(a, r)
	if err != nil {
		t.Fatalf("Admit(rid %d gen %d %q grant %d [+%d, %d)): %v", a.RequestID, a.Generation, a.Initiator,
			a.GrantID, a.Addr-r.Addr, a.Length, err)
	}
	if g == nil {
		t.Fatal("Admit returned a nil guard without an error")
	}
	return g
}

// refused checks that err is a refusal of the wanted kind: every refusal of
// the table must also match transport.ErrRefused (the transports map it to
// a final status), and only aborts may match transport.ErrAborted (the
// initiator learns an abort from it).
func refused(t *testing.T, what string, err, want error) {
	t.Helper()
	if !errors.Is(err, want) {
		t.Fatalf("%s: %v, want %v", what, err, want)
	}
	if !errors.Is(err, transport.ErrRefused) {
		t.Fatalf("%s: %v does not match transport.ErrRefused", what, err)
	}
	if aborted := errors.Is(err, transport.ErrAborted); aborted != (want == requests.ErrAborted) {
		t.Fatalf("%s: %v matches transport.ErrAborted = %v, want %v", what, err, aborted, want == requests.ErrAborted)
	}
}

// admitRefused checks that Admit refuses a with want and returns no guard.
func admitRefused(t *testing.T, tbl *requests.Table, a *transport.Access, r *memory.Region, want error) {
	t.Helper()
	g, err := tbl.Admit(a, r)
	if g != nil {
		t.Fatalf("Admit(rid %d gen %d %q grant %d) returned a guard with error %v", a.RequestID, a.Generation, a.Initiator, a.GrantID, err)
	}
	refused(t, fmt.Sprintf("Admit(rid %d gen %d %q grant %d [+%d, %d))", a.RequestID, a.Generation, a.Initiator,
		a.GrantID, a.Addr-r.Addr, a.Length), err, want)
}

// isClosed reports whether ch is closed, without waiting.
func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// closesSoon waits for ch to close; the generous bound only keeps a broken
// table from hanging the test run, it measures nothing.
func closesSoon(t *testing.T, what string, ch <-chan struct{}) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(10 * time.Second):
		t.Fatalf("%s: channel not closed", what)
	}
}

func TestRequestIDZeroBypassesTable(t *testing.T) {
	reg, r := testRegion(t, 4096)
	tbl := requests.New(requests.Options{})
	if _, _, err := tbl.Abort(1, true); err != nil { // a tombstone elsewhere changes nothing
		t.Fatal(err)
	}
	// Any generation and grant id: request id 0 is checked against the
	// region alone, and the guard is the region itself.
	g, err := tbl.Admit(acc(r, "", 0, 1<<32-1, 99, 0, 64), r)
	if err != nil {
		t.Fatalf("Admit of request id 0: %v", err)
	}
	if reg, ok := g.(*memory.Region); !ok || reg != r {
		t.Fatalf("guard of request id 0 is %T, want the region itself", g)
	}
	if err := g.Enter(); err != nil {
		t.Fatal(err)
	}
	if n := tbl.Len(); n != 1 {
		t.Fatalf("Len = %d with a chunk of request 0 in progress, want 1 (the tombstone only)", n)
	}
	g.Leave()
	if _, err := tbl.Grant("p:1", 0, []requests.Range{{Addr: r.Addr, Len: 1}}); !errors.Is(err, memory.ErrInvalidArg) {
		t.Fatalf("Grant of request id 0: %v", err)
	}
	requireUnpinned(t, reg, r)
}

// TestCountingStatesAreDeleted: a request id that was never aborted or
// granted gets state only while chunks of it are in progress.
func TestCountingStatesAreDeleted(t *testing.T) {
	reg, r := testRegion(t, 1<<16)
	tbl := requests.New(requests.Options{})
	g1 := admit(t, tbl, acc(r, "p:1", 3, 0, 0, 0, 64), r)
	g2 := admit(t, tbl, acc(r, "p:1", 3, 0, 0, 64, 64), r)
	if n := tbl.Len(); n != 0 {
		t.Fatalf("Len = %d after Admit alone, want 0", n)
	}
	must(t, g1.Enter())
	must(t, g2.Enter())
	if n := tbl.Len(); n != 1 {
		t.Fatalf("Len = %d with two chunks of one request in progress, want 1", n)
	}
	g1.Leave()
	if n := tbl.Len(); n != 1 {
		t.Fatalf("Len = %d with one chunk still in progress, want 1", n)
	}
	g2.Leave()
	if n := tbl.Len(); n != 0 {
		t.Fatalf("Len = %d after the last chunk left, want 0", n)
	}

	// Many request ids over every shard, entered and left in another order.
	var gs []transport.Guard
	for rid := uint64(1); rid <= 500; rid++ {
		g := admit(t, tbl, acc(r, "p:1", rid*0x1_0000_0001, 0, 0, rid, 8), r)
		must(t, g.Enter())
		gs = append(gs, g)
	}
	if n := tbl.Len(); n != 500 {
		t.Fatalf("Len = %d with 500 requests in progress", n)
	}
	for i := len(gs) - 1; i >= 0; i-- {
		gs[i].Leave()
	}
	if n := tbl.Len(); n != 0 {
		t.Fatalf("Len = %d after every chunk left, want 0", n)
	}
	if s := tbl.Stats(); s != (requests.Stats{}) {
		t.Fatalf("stats %+v after plain traffic, want zero", s)
	}
	requireUnpinned(t, reg, r)
}

// must fails the test on err; for calls whose failure is not the point.
func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
