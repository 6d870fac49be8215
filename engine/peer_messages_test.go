package engine_test

// What a peer's control messages can make an engine do that it did not ask
// for: tell the application (CANCELED), and write to the host's logs
// (malformed messages); ABORT_ACKs that match nothing or are malformed,
// and oversized messages, are dropped and counted while the owner's control
// loop goes on.

import (
	"bytes"
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

// ACKs that match no pending abort (unknown request, old generation,
// duplicate, late) are dropped and counted; malformed ones are dropped and
// counted as such; none stops the owner's control loop, which afterwards
// still answers PINGs, opens and transfers. The owner resends ABORT to a
// silent initiator until the deadline, and no longer.
func TestUnmatchedAndMalformedAbortAcksAreDroppedAndCounted(t *testing.T) {
	owner := newEngineWith(t, engine.Options{})
	dst := alloc(t, owner, 1<<20)
	f1 := newFakeInitiator(t, owner.Name(), "127.0.0.1:1")
	f2 := newFakeInitiator(t, owner.Name(), "127.0.0.1:2")

	// countsOf reads the three counters the ACKs move.
	type counts struct{ acks, unmatched, dropped uint64 }
	countsOf := func() counts {
		st := owner.Stats()
		return counts{st.AbortAcks, st.AcksUnmatched, st.ControlDropped}
	}
	want := countsOf()
	// step has from send one message and waits until the counters are
	// want. Then a PING from the same sender: the owner's control loop
	// handles one peer's messages in order, so once the PONG is back the
	// message has had all its effects, and a counter moving twice shows.
	pings := uint64(1000)
	step := func(what string, from *fakeInitiator, send func()) {
		t.Helper()
		send()
		waitFor(t, 10*time.Second, what, func() bool { return countsOf() == want })
		pings++
		from.ping(t, pings)
		if got := countsOf(); got != want {
			t.Fatalf("%s: counters %+v, want %+v", what, got, want)
		}
	}

	const rid = 5
	res, err := owner.Abort(testCtx(t, 30*time.Second), rid, []string{f1.name, f2.name})
	if err != nil || !res.Safe {
		t.Fatalf("abort = %+v, %v", res, err)
	}
	gen := res.Generation
	f1.expectAbort(t, rid, gen)
	f2.expectAbort(t, rid, gen)

	want.unmatched++
	step("ACK of a request never aborted", f1, func() { f1.ack(t, 999, 1) })
	want.unmatched++
	step("ACK of a generation never issued", f1, func() { f1.ack(t, rid, gen+6) })
	want.unmatched++
	step("ACK of an older generation", f1, func() { f1.ack(t, rid, gen-1) })
	want.acks++
	step("first ACK from f1", f1, func() { f1.ack(t, rid, gen) })
	want.unmatched++
	step("duplicate ACK from f1 while f2 is awaited", f1, func() { f1.ack(t, rid, gen) })
	want.acks++
	step("ACK from f2, the last awaited", f2, func() { f2.ack(t, rid, gen) })
	want.unmatched++
	step("duplicate ACK after every initiator acknowledged", f2, func() { f2.ack(t, rid, gen) })

	// Malformed: counted as dropped, never as an ACK.
	good := control.AbortAck{RequestID: rid, Generation: gen, Outcome: control.AckDrained}.Encode()
	env := control.EncodeEnvelope(control.Envelope{Type: control.MsgAbortAck})
	badOutcome := bytes.Clone(good)
	badOutcome[12] = 9
	reserved := bytes.Clone(good)
	reserved[14] = 1
	zeroRID := control.AbortAck{Generation: gen, Outcome: control.AckDrained}.Encode()
	badMagic := bytes.Clone(env)
	badMagic[0] ^= 0xff
	for _, m := range []struct {
		what   string
		frames [][]byte
	}{
		{"truncated ABORT_ACK body", [][]byte{env, good[:control.AbortAckSize-1]}},
		{"oversized ABORT_ACK body", [][]byte{env, append(bytes.Clone(good), 0)}},
		{"ABORT_ACK without a body", [][]byte{env}},
		{"ABORT_ACK with an unknown outcome", [][]byte{env, badOutcome}},
		{"ABORT_ACK with reserved bytes set", [][]byte{env, reserved}},
		{"ABORT_ACK of request id 0", [][]byte{env, zeroRID}},
		{"envelope with a bad magic", [][]byte{badMagic, good}},
		{"truncated envelope", [][]byte{env[:control.EnvelopeSize-1], good}},
		{"four frames", [][]byte{env, good, good}},
	} {
		want.dropped++
		step(m.what, f1, func() { f1.sendFrames(t, m.frames...) })
	}

	// A silent initiator gets the ABORT again until the deadline, then no
	// more, and its ACK after the deadline is late.
	const late = 6
	resendsBefore := owner.Stats().AbortResends
	const deadline = 300 * time.Millisecond
	start := time.Now()
	res, err = owner.Abort(testCtx(t, deadline), late, []string{f1.name})
	if err != nil || !res.Safe {
		t.Fatalf("abort with a silent initiator = %+v, %v; want Safe (refusal fences on tcp)", res, err)
	}
	// ABORTs sent before the deadline may still be on their way for a while.
	got := f1.aborts(t, late, deadline+500*time.Millisecond-time.Since(start))
	if len(got) < 2 {
		t.Errorf("%d ABORTs of %d reached the silent initiator before its deadline; want resends", len(got), late)
	}
	if n := owner.Stats().AbortResends - resendsBefore; n == 0 || n+1 < uint64(len(got)) {
		t.Errorf("owner counted %d resends, initiator got %d ABORTs", n, len(got))
	}
	if more := f1.aborts(t, late, 300*time.Millisecond); len(more) > 0 {
		t.Errorf("%d ABORTs resent after the deadline", len(more))
	}
	want = countsOf()
	want.unmatched++
	step("ACK after the abort's deadline", f1, func() { f1.ack(t, late, res.Generation) })

	// The owner still answers: the fake's PING, and a new engine's open and
	// transfer.
	f1.ping(t, 77)
	in := newEngineWith(t, engine.Options{})
	src := alloc(t, in, 1<<20)
	fillPattern(src, 31)
	transfer(t, in, 30*time.Second, write(src, openSegment(t, in, owner.Name()), engine.AddrOf(dst), 1<<20))
	requireEqual(t, "transfer after the bad ACKs", dst, src)
}

// A message past ZMQ_MAXMSGSIZE cuts its sender's connection before anything
// is allocated for it; the owner's loop goes on serving everyone else.
func TestOversizedControlMessageDoesNotStopTheOwner(t *testing.T) {
	owner := newEngineWith(t, engine.Options{})
	big := newFakeInitiator(t, owner.Name(), "127.0.0.1:3")
	env := control.EncodeEnvelope(control.Envelope{Type: control.MsgAbortAck})
	big.sendFrames(t, env, make([]byte, control.MaxBody+control.EnvelopeSize+1))
	// The owner answers another peer, and a new PING from the same one
	// (ZMQ reconnects the DEALER).
	newFakeInitiator(t, owner.Name(), "127.0.0.1:4").ping(t, 9)
	big.ping(t, 10)
	if st := owner.Stats(); st.AbortAcks != 0 || st.AcksUnmatched != 0 {
		t.Errorf("an oversized message was taken as an ACK: %+v", st)
	}
}
