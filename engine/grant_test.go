package engine_test

// Grants confine a request id to its initiator and ranges until revoked.

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
)

// A grant confines a request id to its initiator and ranges: an access
// inside works (with the grant's id or without), one outside or straddling
// its end is refused, another initiator is refused, a request id without
// grants stays open to all; after Revoke every access of it is refused.
// Bad grants and unknown revokes are ErrInvalidArg.
func TestGrantConfinesARequestToItsInitiatorAndRangesUntilRevoked(t *testing.T) {
	const size, g = 1 << 20, 64 << 10
	const rid = 606
	owner := newEngineWith(t, engine.Options{})
	a, b := newEngineWith(t, engine.Options{}), newEngineWith(t, engine.Options{})
	dst := alloc(t, owner, size)
	srcA, srcB := alloc(t, a, size), alloc(t, b, size)
	fillPattern(srcA, 61)
	fillPattern(srcB, 62)
	segA, segB := openSegment(t, a, owner.Name()), openSegment(t, b, owner.Name())
	base := engine.AddrOf(dst)

	gr, err := owner.Grant(a.Name(), rid, []engine.GrantRange{{Addr: base, Len: g}})
	if err != nil {
		t.Fatalf("grant: %v", err)
	}
	if gr.ID == 0 || gr.Initiator != a.Name() || gr.RequestID != rid || gr.Generation != 0 || owner.Stats().Grants != 1 {
		t.Fatalf("grant %+v, %d live", gr, owner.Stats().Grants)
	}
	inside := withRID(write(srcA, segA, base, g), rid, gr.Generation)
	inside.GrantID = gr.ID
	transfer(t, a, 30*time.Second, inside)
	requireEqual(t, "WRITE inside the grant", dst[:g], srcA[:g])
	back := alloc(t, a, g)
	transfer(t, a, 30*time.Second, withRID(read(back, segA, base, g), rid, gr.Generation)) // grant found by range
	requireEqual(t, "READ inside the grant", back, srcA[:g])

	want := bytes.Clone(dst)
	refused := func(what string, e *engine.Engine, r engine.Request) {
		t.Helper()
		res, err := e.Transfer(testCtx(t, 30*time.Second), []engine.Request{r})
		if !errors.Is(err, engine.ErrRefused) || res[0].Status == engine.Completed || res[0].Transferred != 0 {
			t.Fatalf("%s: %+v, %v; want refused", what, res, err)
		}
		requireEqual(t, "owner memory after "+what, dst, want)
	}
	refused("WRITE outside the grant", a, withRID(write(srcA, segA, base+g, 4096), rid, 0))
	refused("WRITE straddling the grant's end", a, withRID(write(srcA, segA, base+g-100, 4096), rid, 0))
	refused("READ outside the grant", a, withRID(read(back, segA, base+g, 4096), rid, 0))
	refused("WRITE by another initiator inside the grant", b, withRID(write(srcB, segB, base, g), rid, 0))

	// Request ids without grants keep the open model.
	transfer(t, b, 30*time.Second, withRID(write(srcB, segB, base+2*g, g), rid+1, 0))
	requireEqual(t, "WRITE of a request without grants", dst[2*g:3*g], srcB[:g])
	want = bytes.Clone(dst)

	if err := owner.Revoke(testCtx(t, 5*time.Second), gr.ID); err != nil {
		t.Fatalf("revoke: %v", err)
	}
	if n := owner.Stats().Grants; n != 0 {
		t.Errorf("%d grants live after the revoke", n)
	}
	refused("WRITE inside a revoked grant", a, inside)
	if err := owner.Revoke(testCtx(t, 5*time.Second), gr.ID); !errors.Is(err, engine.ErrInvalidArg) {
		t.Errorf("second revoke: %v, want ErrInvalidArg", err)
	}

	ok := []engine.GrantRange{{Addr: base, Len: g}}
	for _, c := range []struct {
		what      string
		initiator string
		rid       uint64
		ranges    []engine.GrantRange
	}{
		{"request id 0", a.Name(), 0, ok},
		{"initiator without a port", "nohost", rid, ok},
		{"empty initiator", "", rid, ok},
		{"no ranges", a.Name(), rid, nil},
		{"a zero-length range", a.Name(), rid, []engine.GrantRange{{Addr: base, Len: 0}}},
		{"a range wrapping the address space", a.Name(), rid, []engine.GrantRange{{Addr: ^uint64(0) - 10, Len: 100}}},
	} {
		if _, err := owner.Grant(c.initiator, c.rid, c.ranges); !errors.Is(err, engine.ErrInvalidArg) {
			t.Errorf("grant with %s: %v, want ErrInvalidArg", c.what, err)
		}
	}
	if n := owner.Stats().Grants; n != 0 {
		t.Errorf("%d grants live after refused grants", n)
	}
}
