package control_test

// Tests of one-way messages (ABORT, ABORT_ACK, CANCELED) and NOTIFY on the
// control plane: Send's two routes, and bad, duplicate and late bodies from
// raw ZMQ peers, none of which may stop the loop or be answered when they
// are one-way.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvferry/kvferry/engine/control"
	"github.com/kvferry/kvferry/internal/ratelog"
)

// call is one handler invocation seen by a recorder.
type call struct {
	typ  control.MsgType
	from string
	body []byte
	ok   bool // the body decoded
}

// recorder stands in for the engine's handlers of ABORT, ABORT_ACK,
// CANCELED and NOTIFY: it decodes each body with the decoder the engine
// uses and counts the verdicts, so a test can tell a message the plane
// dropped (Stats.Malformed) from one it handed over with a bad body.
type recorder struct {
	ok, bad atomic.Int64
	mu      sync.Mutex
	calls   []call
}

// handler returns the handler of typ: it decodes the body as the engine
// would, records the call, and answers NOTIFY like the engine (NOTIFY_ACK,
// or ERROR for a bad body); one-way types get no answer.
func (r *recorder) handler(typ control.MsgType) control.Handler {
	return func(from string, body []byte) (control.MsgType, []byte) {
		var err error
		switch typ {
		case control.MsgAbort, control.MsgCanceled:
			_, err = control.DecodeAbortMsg(body)
		case control.MsgAbortAck:
			_, err = control.DecodeAbortAck(body)
		case control.MsgNotify:
			_, err = control.DecodeNotification(body)
		}
		if err != nil {
			r.bad.Add(1)
		} else {
			r.ok.Add(1)
		}
		r.mu.Lock()
		r.calls = append(r.calls, call{typ: typ, from: from, body: append([]byte(nil), body...), ok: err == nil})
		r.mu.Unlock()
		if typ == control.MsgNotify {
			if err != nil {
				return control.MsgError, []byte(err.Error())
			}
			return control.MsgNotifyAck, []byte{0}
		}
		return 0, nil
	}
}

// waitCalls waits until the handlers ran at least n times and returns
// their calls in order.
func (r *recorder) waitCalls(t *testing.T, n int) []call {
	t.Helper()
	waitFor(t, fmt.Sprintf("%d handler calls", n), 10*time.Second, func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return len(r.calls) >= n
	})
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]call(nil), r.calls...)
}

// newRecordingPlane starts a plane like newPlane (PING answered with PONG)
// whose one-way and NOTIFY handlers are a recorder's; newPlane cannot be
// reused because handlers must be set before Start.
func newRecordingPlane(t *testing.T) (*testPlane, *recorder) {
	t.Helper()
	lc := &logCounter{}
	p, err := control.Listen("127.0.0.1", 0, slog.New(lc))
	if err != nil {
		t.Fatal(err)
	}
	tp := &testPlane{Plane: p, log: lc}
	p.Handle(control.MsgPing, func(from string, body []byte) (control.MsgType, []byte) {
		tp.calls.Add(1)
		tp.from.Store(from)
		return control.MsgPong, body
	})
	rec := &recorder{}
	for _, typ := range []control.MsgType{control.MsgAbort, control.MsgAbortAck, control.MsgCanceled, control.MsgNotify} {
		p.Handle(typ, rec.handler(typ))
	}
	p.Start()
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return tp, rec
}

// rawDealerAs connects a DEALER whose routing id is id (a segment name, as a
// plane's DEALER has) to peer, so that peer's ROUTER can route to it.
func rawDealerAs(t *testing.T, c *zmq.Context, peer, id string) *zmq.Socket {
	t.Helper()
	d := rawSocket(t, c, zmq.DEALER)
	must(t, d.SetIdentity(id))
	must(t, d.Connect("tcp://"+peer))
	return d
}

func TestPlaneSendOneWay(t *testing.T) {
	abort := control.AbortMsg{RequestID: 77, Generation: 3}.Encode()
	ack := control.AbortAck{RequestID: 77, Generation: 3, Outcome: control.AckDrained, Landed: 4096}.Encode()

	t.Run("DEALER fallback between planes", func(t *testing.T) {
		a, _ := newRecordingPlane(t)
		b, rec := newRecordingPlane(t)
		must(t, a.Send(b.Name(), control.MsgAbort, abort))
		must(t, a.Send(b.Name(), control.MsgAbortAck, ack))
		must(t, a.Send(b.Name(), control.MsgCanceled, abort))
		calls := rec.waitCalls(t, 3)
		for i, want := range []struct {
			typ  control.MsgType
			body []byte
		}{{control.MsgAbort, abort}, {control.MsgAbortAck, ack}, {control.MsgCanceled, abort}} {
			c := calls[i]
			if c.typ != want.typ || c.from != a.Name() || !bytes.Equal(c.body, want.body) || !c.ok {
				t.Errorf("call %d: %v from %q body %x ok %v; want %v from %q body %x", i, c.typ, c.from, c.body, c.ok,
					want.typ, a.Name(), want.body)
			}
		}
		if s := a.Stats(); s.SendFails != 0 || s.Malformed != 0 {
			t.Errorf("sender stats %+v", s)
		}
	})
	t.Run("ROUTER path between planes", func(t *testing.T) {
		a, _ := newRecordingPlane(t)
		b, rec := newRecordingPlane(t)
		// b asks a first, so b has a DEALER connected to a's ROUTER.
		if _, _, err := b.Request(ctxFor(t, 5*time.Second), a.Name(), control.MsgPing, nil); err != nil {
			t.Fatal(err)
		}
		must(t, a.Send(b.Name(), control.MsgAbort, abort))
		c := rec.waitCalls(t, 1)[0]
		if c.typ != control.MsgAbort || c.from != a.Name() || !bytes.Equal(c.body, abort) {
			t.Fatalf("got %v from %q body %x; want ABORT from %q", c.typ, c.from, c.body, a.Name())
		}
	})
	t.Run("ROUTER path reaches a peer that cannot be dialed", func(t *testing.T) {
		// The peer's name is a port nobody listens on, so only a's ROUTER,
		// through the DEALER the peer connected, can deliver.
		a, _ := newRecordingPlane(t)
		c := zctx(t)
		name := fmt.Sprintf("127.0.0.1:%d", freePort(t))
		d := rawDealerAs(t, c, a.Name(), name)
		pingOverDealer(t, d, 1) // the connection is up and a knows its routing id
		if from, _ := a.from.Load().(string); from != name {
			t.Fatalf("a saw the DEALER as %q, want %q", from, name)
		}
		must(t, a.Send(name, control.MsgAbort, abort))
		msg, err := d.RecvMessageBytes(0)
		if err != nil {
			t.Fatalf("no ABORT on the peer's DEALER: %v", err)
		}
		if len(msg) != 2 || !bytes.Equal(msg[1], abort) {
			t.Fatalf("peer got %d frames %x", len(msg), msg)
		}
		e, err := control.DecodeEnvelope(msg[0])
		if err != nil || e.Type != control.MsgAbort || e.Flags != 0 {
			t.Fatalf("envelope %+v, %v", e, err)
		}
		if s := a.Stats(); s.SendFails != 0 {
			t.Errorf("stats %+v", s)
		}
	})
	t.Run("DEALER fallback reaches a peer with no DEALER to us", func(t *testing.T) {
		a, _ := newRecordingPlane(t)
		c := zctx(t)
		r, name := rawRouter(t, c)
		must(t, a.Send(name, control.MsgAbortAck, ack))
		msg, err := r.RecvMessageBytes(0)
		if err != nil {
			t.Fatalf("no ABORT_ACK on the peer's ROUTER: %v", err)
		}
		if len(msg) != 3 || string(msg[0]) != a.Name() || !bytes.Equal(msg[2], ack) {
			t.Fatalf("peer got %q; want [%q, envelope, ack]", msg, a.Name())
		}
		if e, err := control.DecodeEnvelope(msg[1]); err != nil || e.Type != control.MsgAbortAck {
			t.Fatalf("envelope %+v, %v", e, err)
		}
	})
	t.Run("no body", func(t *testing.T) {
		a, _ := newRecordingPlane(t)
		b, rec := newRecordingPlane(t)
		must(t, a.Send(b.Name(), control.MsgAbort, nil))
		c := rec.waitCalls(t, 1)[0]
		if c.from != a.Name() || len(c.body) != 0 || c.ok {
			t.Fatalf("call %+v; want an empty body the decoder refuses", c)
		}
		if s := b.Stats(); s.Malformed != 0 {
			t.Fatalf("an empty one-way body is the handler's to refuse, not the plane's: %+v", s)
		}
	})
	t.Run("refusals", func(t *testing.T) {
		a, _ := newRecordingPlane(t)
		b, rec := newRecordingPlane(t)
		for _, typ := range []control.MsgType{0, control.MsgGetDescriptor, control.MsgDescriptor, control.MsgPing,
			control.MsgPong, control.MsgError, control.MsgNotify, control.MsgNotifyAck, 15, 255} {
			if err := a.Send(b.Name(), typ, abort); !errors.Is(err, control.ErrMalformed) {
				t.Errorf("Send of %v: %v, want ErrMalformed", typ, err)
			}
		}
		for _, peer := range []string{"", "no-port", "127.0.0.1"} {
			if err := a.Send(peer, control.MsgAbort, abort); err == nil {
				t.Errorf("Send to %q: no error", peer)
			}
		}
		// Nothing of the above went out: a valid Send that follows is the
		// first message b hears.
		must(t, a.Send(b.Name(), control.MsgCanceled, abort))
		if calls := rec.waitCalls(t, 1); calls[0].typ != control.MsgCanceled {
			t.Fatalf("first call %v, want CANCELED", calls[0].typ)
		}
		// A PING behind it on the same connection: b reads one connection in
		// order, so once the PONG is back anything sent by mistake before
		// has arrived.
		if _, _, err := a.Request(ctxFor(t, 5*time.Second), b.Name(), control.MsgPing, nil); err != nil {
			t.Fatalf("PING after the Sends: %v", err)
		}
		if s := b.Stats(); s.Received != 2 || len(rec.waitCalls(t, 1)) != 1 {
			t.Fatalf("b heard %d messages, want 2 (the CANCELED and the PING)", s.Received)
		}
		must(t, a.Close())
		if err := a.Send(b.Name(), control.MsgAbort, abort); !errors.Is(err, control.ErrClosed) {
			t.Fatalf("Send after Close: %v, want ErrClosed", err)
		}
	})
}

// TestPlaneSurvivesBadOneWayBodies sends ABORT, ABORT_ACK, CANCELED and
// NOTIFY messages from a raw DEALER to a plane's ROUTER: valid, duplicate,
// empty, truncated, oversized, with reserved bits, request id 0, bad zstd,
// too many frames. Each is dropped by the plane (Malformed), or handed to
// the handler, which refuses or takes its body; only NOTIFY is answered.
// Then a PING is still answered, and first.
func TestPlaneSurvivesBadOneWayBodies(t *testing.T) {
	p, rec := newRecordingPlane(t)
	c := zctx(t)
	const id = "10.9.8.7:6"
	d := rawDealerAs(t, c, p.Name(), id)

	abortB := control.AbortMsg{RequestID: 5, Generation: 1}.Encode()
	ackB := control.AbortAck{RequestID: 5, Generation: 1, Outcome: control.AckCut, Landed: 1}.Encode()
	notifyB := control.Notification{RequestID: 5, Data: bytes.Repeat([]byte("n"), control.MaxNotifyData)}.Encode()
	ab := env(control.MsgAbort, 0, 1)
	ak := env(control.MsgAbortAck, 0, 2)
	cn := env(control.MsgCanceled, 0, 3)

	// What each message should come to.
	const (
		handledOK  = "ok"        // the handler took the body
		handledBad = "bad"       // the handler refused the body
		dropped    = "malformed" // the plane dropped the message
	)
	cases := []struct {
		name   string
		frames [][]byte
		want   string
		reply  control.MsgType // NOTIFY only: the answer
	}{
		{"ABORT", [][]byte{ab, abortB}, handledOK, 0},
		{"ABORT duplicate", [][]byte{ab, abortB}, handledOK, 0},
		{"ABORT duplicate, same correlation id", [][]byte{ab, abortB}, handledOK, 0},
		{"ABORT without body", [][]byte{ab}, handledBad, 0},
		{"ABORT with an empty body frame", [][]byte{ab, {}}, handledBad, 0},
		{"ABORT truncated", [][]byte{ab, abortB[:control.AbortMsgSize-1]}, handledBad, 0},
		{"ABORT one byte long", [][]byte{ab, append(append([]byte(nil), abortB...), 0)}, handledBad, 0},
		{"ABORT of 1 MiB", [][]byte{ab, make([]byte, 1<<20)}, handledBad, 0},
		{"ABORT reserved set", [][]byte{ab, patch(abortB, 15, 1)}, handledBad, 0},
		{"ABORT of request id 0", [][]byte{ab, control.AbortMsg{Generation: 1}.Encode()}, handledBad, 0},
		{"ABORT compressed", [][]byte{env(control.MsgAbort, control.FlagZstd, 1), zstdFrame(t, abortB)}, handledOK, 0},
		{"ABORT zstd flag, not zstd", [][]byte{env(control.MsgAbort, control.FlagZstd, 1), abortB}, dropped, 0},
		{"ABORT zstd bomb", [][]byte{env(control.MsgAbort, control.FlagZstd, 1), zstdFrame(t, make([]byte, 20<<20))}, dropped, 0},
		{"ABORT body of MaxBody+1", [][]byte{ab, make([]byte, control.MaxBody+1)}, dropped, 0},
		{"ABORT of 3 frames", [][]byte{ab, abortB, abortB}, dropped, 0},
		{"ABORT envelope truncated", [][]byte{ab[:control.EnvelopeSize-1], abortB}, dropped, 0},
		{"ABORT_ACK", [][]byte{ak, ackB}, handledOK, 0},
		{"ABORT_ACK duplicate", [][]byte{ak, ackB}, handledOK, 0},
		{"ABORT_ACK truncated", [][]byte{ak, ackB[:control.AbortAckSize-1]}, handledBad, 0},
		{"ABORT_ACK one byte long", [][]byte{ak, append(append([]byte(nil), ackB...), 0)}, handledBad, 0},
		{"ABORT_ACK outcome 0", [][]byte{ak, patch(ackB, 12, 0)}, handledBad, 0},
		{"ABORT_ACK outcome 4", [][]byte{ak, patch(ackB, 12, 4)}, handledBad, 0},
		{"ABORT_ACK reserved set", [][]byte{ak, patch(ackB, 14, 1)}, handledBad, 0},
		{"ABORT_ACK of request id 0", [][]byte{ak, control.AbortAck{Outcome: control.AckDrained}.Encode()}, handledBad, 0},
		{"ABORT_ACK an ABORT body", [][]byte{ak, abortB}, handledBad, 0},
		{"ABORT_ACK without body", [][]byte{ak}, handledBad, 0},
		{"CANCELED", [][]byte{cn, abortB}, handledOK, 0},
		{"CANCELED truncated", [][]byte{cn, abortB[:3]}, handledBad, 0},
		{"NOTIFY", [][]byte{env(control.MsgNotify, 0, 10), notifyB}, handledOK, control.MsgNotifyAck},
		{"NOTIFY duplicate", [][]byte{env(control.MsgNotify, 0, 10), notifyB}, handledOK, control.MsgNotifyAck},
		{"NOTIFY without data", [][]byte{env(control.MsgNotify, 0, 11), notifyB[:8]}, handledOK, control.MsgNotifyAck},
		{"NOTIFY without body", [][]byte{env(control.MsgNotify, 0, 12)}, handledBad, control.MsgError},
		{"NOTIFY truncated id", [][]byte{env(control.MsgNotify, 0, 13), notifyB[:7]}, handledBad, control.MsgError},
		{"NOTIFY data of MaxNotifyData+1", [][]byte{env(control.MsgNotify, 0, 14), append(append([]byte(nil), notifyB...), 0)}, handledBad, control.MsgError},
		{"NOTIFY of 1 MiB", [][]byte{env(control.MsgNotify, 0, 15), make([]byte, 1<<20)}, handledBad, control.MsgError},
		{"NOTIFY zstd flag, not zstd", [][]byte{env(control.MsgNotify, control.FlagZstd, 16), notifyB}, dropped, 0},
		// A stray reply sent as a request is answered with an ERROR, like
		// any type without a handler.
		{"NOTIFY_ACK to a ROUTER", [][]byte{env(control.MsgNotifyAck, 0, 17), {0}}, "", control.MsgError},
	}

	var wantOK, wantBad, wantDropped int64
	for _, tc := range cases {
		parts := make([]any, len(tc.frames))
		for j, f := range tc.frames {
			parts[j] = f
		}
		if _, err := d.SendMessage(parts...); err != nil {
			t.Fatalf("%s: send: %v", tc.name, err)
		}
		switch tc.want {
		case handledOK:
			wantOK++
		case handledBad:
			wantBad++
		case dropped:
			wantDropped++
		}
		if tc.reply != 0 {
			msg, err := d.RecvMessageBytes(0)
			if err != nil {
				t.Fatalf("%s: no answer: %v", tc.name, err)
			}
			req, _ := control.DecodeEnvelope(tc.frames[0])
			e, err := control.DecodeEnvelope(msg[0])
			if err != nil || e.Type != tc.reply || e.Corr != req.Corr {
				t.Fatalf("%s: answered %+v (%v), want %v with the request's correlation id", tc.name, e, err, tc.reply)
			}
		}
		waitFor(t, tc.name, 10*time.Second, func() bool {
			return rec.ok.Load() == wantOK && rec.bad.Load() == wantBad && p.Stats().Malformed == uint64(wantDropped)
		})
	}
	// No one-way message was answered: the PING's answer comes next.
	pingOverDealer(t, d, 4242)

	s := p.Stats()
	if s.Received != uint64(len(cases))+1 || s.Malformed != uint64(wantDropped) || s.SendFails != 0 {
		t.Errorf("stats %+v; want Received %d, Malformed %d", s, len(cases)+1, wantDropped)
	}
	if w := p.log.warns.Load(); w < min(wantDropped, ratelog.DefaultBurst) {
		t.Errorf("%d warnings logged for %d dropped messages", w, wantDropped)
	}
	for i, c := range rec.waitCalls(t, int(wantOK+wantBad)) {
		if c.from != id {
			t.Errorf("call %d (%v) from %q, want the DEALER's routing id %q", i, c.typ, c.from, id)
		}
	}
	// And a plane is answered too.
	a := newPlane(t, "127.0.0.1")
	if typ, _, err := a.Request(ctxFor(t, 5*time.Second), p.Name(), control.MsgPing, nil); err != nil || typ != control.MsgPong {
		t.Fatalf("Request after bad one-way traffic: %v, %v", typ, err)
	}
}

// TestPlaneDealerOneWayAndLateReplies has a raw ROUTER answer on the
// connection a plane's DEALER opened to it: one-way messages (good and bad
// bodies) are handed to the handlers with the ROUTER's name as sender;
// requests, extra frames and bad zstd are dropped as malformed; a NOTIFY_ACK
// that comes after its NOTIFY gave up, and its duplicate, are unmatched and
// answer no later NOTIFY.
func TestPlaneDealerOneWayAndLateReplies(t *testing.T) {
	p, rec := newRecordingPlane(t)
	c := zctx(t)
	r, rname := rawRouter(t, c)
	notifyB := control.Notification{RequestID: 8, Data: []byte("kv ready")}.Encode()

	// notify sends a NOTIFY to the raw ROUTER and returns its outcome on a
	// channel, so the test can play the ROUTER meanwhile.
	notify := func(ctx context.Context) <-chan result {
		ch := make(chan result, 1)
		go func() {
			typ, b, err := p.Request(ctx, rname, control.MsgNotify, notifyB)
			ch <- result{typ, b, err}
		}()
		return ch
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	ch := notify(ctx)
	id, e, body := recvRequest(t, r)
	if e.Type != control.MsgNotify || !bytes.Equal(body, notifyB) || string(id) != p.Name() {
		t.Fatalf("raw ROUTER got %v %x from %q", e.Type, body, id)
	}
	if res := await(t, ch); !errors.Is(res.err, context.DeadlineExceeded) {
		t.Fatalf("unanswered NOTIFY: %v, want DeadlineExceeded", res.err)
	}

	abortB := control.AbortMsg{RequestID: 8, Generation: 2}.Encode()
	ackB := control.AbortAck{RequestID: 8, Generation: 2, Outcome: control.AckDrained}.Encode()
	steps := []struct {
		name              string
		frames            [][]byte
		ok, bad           int64
		malformed, unmatc uint64
	}{
		{"ABORT", [][]byte{env(control.MsgAbort, 0, 1), abortB}, 1, 0, 0, 0},
		{"ABORT duplicate", [][]byte{env(control.MsgAbort, 0, 1), abortB}, 2, 0, 0, 0},
		{"ABORT truncated", [][]byte{env(control.MsgAbort, 0, 2), abortB[:9]}, 2, 1, 0, 0},
		{"ABORT of request id 0", [][]byte{env(control.MsgAbort, 0, 3), make([]byte, control.AbortMsgSize)}, 2, 2, 0, 0},
		{"ABORT without body", [][]byte{env(control.MsgAbort, 0, 3)}, 2, 3, 0, 0},
		{"ABORT_ACK", [][]byte{env(control.MsgAbortAck, 0, 4), ackB}, 3, 3, 0, 0},
		{"ABORT_ACK outcome 9", [][]byte{env(control.MsgAbortAck, 0, 4), patch(ackB, 12, 9)}, 3, 4, 0, 0},
		{"CANCELED", [][]byte{env(control.MsgCanceled, 0, 5), abortB}, 4, 4, 0, 0},
		{"ABORT with an extra frame", [][]byte{env(control.MsgAbort, 0, 6), abortB, abortB}, 4, 4, 1, 0},
		{"ABORT zstd flag, not zstd", [][]byte{env(control.MsgAbort, control.FlagZstd, 7), abortB}, 4, 4, 2, 0},
		{"ABORT body of MaxBody+1", [][]byte{env(control.MsgAbort, 0, 7), make([]byte, control.MaxBody+1)}, 4, 4, 3, 0},
		{"NOTIFY sent to a DEALER", [][]byte{env(control.MsgNotify, 0, 8), notifyB}, 4, 4, 4, 0},
		{"PING sent to a DEALER", [][]byte{env(control.MsgPing, 0, 9)}, 4, 4, 5, 0},
		{"late NOTIFY_ACK", [][]byte{env(control.MsgNotifyAck, 0, e.Corr), {0}}, 4, 4, 5, 1},
		{"late NOTIFY_ACK duplicate", [][]byte{env(control.MsgNotifyAck, 0, e.Corr), {0}}, 4, 4, 5, 2},
		{"NOTIFY_ACK to an id never used", [][]byte{env(control.MsgNotifyAck, 0, e.Corr+1000), {0}}, 4, 4, 5, 3},
	}
	for _, st := range steps {
		sendRaw(t, r, append([][]byte{id}, st.frames...)...)
		waitFor(t, st.name, 10*time.Second, func() bool {
			s := p.Stats()
			return rec.ok.Load() == st.ok && rec.bad.Load() == st.bad && s.Malformed == st.malformed && s.Unmatched == st.unmatc
		})
	}
	for i, c := range rec.waitCalls(t, 8) {
		if c.from != rname {
			t.Errorf("call %d (%v) from %q, want the ROUTER's name %q", i, c.typ, c.from, rname)
		}
	}

	// The next NOTIFY gets its own answer, not a late one.
	ch = notify(ctxFor(t, 10*time.Second))
	id, e2, _ := recvRequest(t, r)
	if e2.Corr == e.Corr {
		t.Fatalf("correlation id %d reused", e.Corr)
	}
	sendRaw(t, r, id, env(control.MsgNotifyAck, 0, e2.Corr), []byte{1})
	if res := await(t, ch); res.err != nil || res.typ != control.MsgNotifyAck || !bytes.Equal(res.body, []byte{1}) {
		t.Fatalf("second NOTIFY = %v %x %v, want NOTIFY_ACK 01", res.typ, res.body, res.err)
	}
	s := p.Stats()
	if s.Received != uint64(len(steps))+1 || s.Malformed != 5 || s.Unmatched != 3 {
		t.Errorf("stats %+v; want Received %d, Malformed 5, Unmatched 3", s, len(steps)+1)
	}
	if w := p.log.warns.Load(); w < min(5, ratelog.DefaultBurst) {
		t.Errorf("%d warnings logged for 5 dropped messages", w)
	}
	// The loop still answers other peers.
	a := newPlane(t, "127.0.0.1")
	if _, _, err := a.Request(ctxFor(t, 5*time.Second), p.Name(), control.MsgPing, nil); err != nil {
		t.Fatalf("Request after bad one-way traffic: %v", err)
	}
}

// TestPlaneOneWayWithoutHandler: a one-way message of a type with no
// handler is read and dropped, never answered (the sender expects no
// answer, and an ERROR would reach it as an unmatched reply).
func TestPlaneOneWayWithoutHandler(t *testing.T) {
	p := newPlane(t, "127.0.0.1") // PING and GET_DESCRIPTOR only
	c := zctx(t)
	d := rawDealer(t, c, p.Name())
	body := control.AbortMsg{RequestID: 1, Generation: 1}.Encode()
	for _, typ := range []control.MsgType{control.MsgAbort, control.MsgAbortAck, control.MsgCanceled} {
		sendRaw(t, d, env(typ, 0, 1), body)
	}
	pingOverDealer(t, d, 2)
	if s := p.Stats(); s.Received != 4 || s.Malformed != 0 || s.SendFails != 0 {
		t.Fatalf("stats %+v; want 4 received, nothing dropped as malformed", s)
	}
}
