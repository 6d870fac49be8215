package engine_test

// What a peer's control messages can make an engine do that it did not ask
// for: tell the application (CANCELED), and write to the host's logs
// (malformed messages).

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/engine/control"
	"github.com/kvferry/kvferry/internal/ratelog"
)

// A CANCELED becomes an event only from a peer that could have been
// touching the request here: one admitted for it or granted it, and for a
// generation the owner issued. Any peer used to be able to make the owner
// tell its application that an initiator gave up on any request, and fill
// the event queue doing so.
func TestCanceledOnlyFromAPeerThatCouldTouchTheRequestIsTold(t *testing.T) {
	owner := newEngineWith(t, engine.Options{})
	f := newFakeInitiator(t, owner.Name(), "10.9.9.9:9")
	canceled := func(rid uint64, gen uint32) {
		f.send(t, control.MsgCanceled, 0, control.AbortMsg{RequestID: rid, Generation: gen}.Encode())
	}
	for rid := uint64(1); rid <= 100; rid++ {
		canceled(rid, 0) // never granted nor admitted here
	}
	if _, err := owner.Grant(f.name, 500, []engine.GrantRange{{Addr: 4096, Len: 4096}}); err != nil {
		t.Fatal(err)
	}
	canceled(500, 3) // a generation the owner never issued
	canceled(500, 0) // granted: told
	f.ping(t, 2)     // the owner's loop handled everything before
	if s := owner.Stats(); s.CanceledDropped != 101 {
		t.Errorf("CanceledDropped = %d, want 101", s.CanceledDropped)
	}
	ev := nextEvent(t, owner, 5*time.Second)
	if ev.Kind != engine.EventCanceled || ev.RequestID != 500 || ev.Peer != f.name {
		t.Errorf("event %+v, want CANCELED of the granted request 500 from %s", ev, f.name)
	}
	select {
	case ev := <-owner.Events():
		t.Errorf("a second event %+v: the owner told CANCELED of a request the peer never touched", ev)
	default:
	}
}

// lineCounter is a slog.Handler that counts the records of each message.
type lineCounter struct {
	mu    sync.Mutex
	lines map[string]int
}

func (c *lineCounter) Enabled(context.Context, slog.Level) bool { return true }
func (c *lineCounter) WithAttrs([]slog.Attr) slog.Handler       { return c }
func (c *lineCounter) WithGroup(string) slog.Handler            { return c }
func (c *lineCounter) Handle(_ context.Context, r slog.Record) error {
	c.mu.Lock()
	c.lines[r.Message]++
	c.mu.Unlock()
	return nil
}

// count returns the records whose message contains part.
func (c *lineCounter) count(part string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for msg, k := range c.lines {
		if strings.Contains(msg, part) {
			n += k
		}
	}
	return n
}

// Malformed ABORT, ABORT_ACK, CANCELED and NOTIFY bodies from a peer, and
// CANCELED of requests it never touched, are each logged at most a burst of
// lines per interval, though every one is counted. They used to be logged
// one line each: a peer could fill the host's logs (21,095 lines in one
// attack).
func TestWarningsAPeerCausesAreRateLimited(t *testing.T) {
	lc := &lineCounter{lines: map[string]int{}}
	owner := newEngineWith(t, engine.Options{Logger: slog.New(lc)})
	f := newFakeInitiator(t, owner.Name(), "10.9.9.8:9")
	const n = 500
	bad := []byte{1, 2, 3}
	for i := 0; i < n; i++ {
		f.send(t, control.MsgAbort, 0, bad)
		f.send(t, control.MsgAbortAck, 0, bad)
		f.send(t, control.MsgCanceled, 0, bad)
		f.send(t, control.MsgCanceled, 0, control.AbortMsg{RequestID: uint64(i + 1)}.Encode())
	}
	for i := 0; i < 50; i++ { // requests: each is answered, keep below the fake's queue
		f.send(t, control.MsgNotify, uint64(100+i), bad)
	}
	waitFor(t, 10*time.Second, "every malformed message counted", func() bool {
		s := owner.Stats()
		return s.ControlDropped >= 3*n+50 && s.CanceledDropped >= n
	})
	for _, what := range []string{"malformed ABORT", "malformed ABORT_ACK", "malformed CANCELED", "malformed NOTIFY", "dropped CANCELED"} {
		// "malformed ABORT" also matches ABORT_ACK's lines.
		limit := ratelog.DefaultBurst
		if what == "malformed ABORT" {
			limit *= 2
		}
		if got := lc.count(what); got == 0 || got > limit {
			t.Errorf("%q: %d lines logged, want 1 to %d", what, got, limit)
		}
	}
}
