package control_test

// Misbehaving peers of the control plane, played by raw ZMQ sockets: a
// DEALER that sends malformed or oversized requests to a plane's ROUTER, and
// a ROUTER that answers a plane's requests badly, late, from another peer or
// oversized. The plane drops and counts them and goes on serving.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvferry/kvferry/engine/control"
	"github.com/kvferry/kvferry/internal/ratelog"
)

// TestPlaneSurvivesMalformedRequests sends every kind of malformed request
// to a plane's ROUTER from a raw DEALER, each of which must be logged,
// counted and dropped (never answered), and then checks that the loop still
// answers.
func TestPlaneSurvivesMalformedRequests(t *testing.T) {
	p := newPlane(t, "127.0.0.1")
	c := zctx(t)
	d := rawDealer(t, c, p.Name())

	ping := env(control.MsgPing, 0, 1)
	bomb := func(tb testing.TB) []byte { return zstdFrame(tb, make([]byte, 20<<20)) }
	half := zstdFrame(t, make([]byte, control.MaxBody/2+1))
	cases := []struct {
		name   string
		frames [][]byte
	}{
		{"1 frame, garbage", [][]byte{[]byte("x")}},
		{"1 frame, empty", [][]byte{{}}},
		{"4 frames", [][]byte{ping, []byte("a"), []byte("b"), []byte("c")}},
		{"5 frames", [][]byte{ping, []byte("a"), []byte("b"), []byte("c"), []byte("d")}},
		{"truncated envelope", [][]byte{ping[:control.EnvelopeSize-1]}},
		{"truncated envelope with body", [][]byte{ping[:8], []byte("body")}},
		{"long envelope", [][]byte{append(append([]byte(nil), ping...), 0)}},
		{"bad magic", [][]byte{envelope(0x4b43, control.ProtocolVersion, uint8(control.MsgPing), 0, 0, 0, 1)}},
		{"version 0", [][]byte{envelope(envMagic, 0, uint8(control.MsgPing), 0, 0, 0, 1)}},
		{"version 2", [][]byte{envelope(envMagic, 2, uint8(control.MsgPing), 0, 0, 0, 1)}},
		{"type 0", [][]byte{envelope(envMagic, control.ProtocolVersion, 0, 0, 0, 0, 1)}},
		{"type 15", [][]byte{envelope(envMagic, control.ProtocolVersion, 15, 0, 0, 0, 1)}},
		{"type 255", [][]byte{envelope(envMagic, control.ProtocolVersion, 255, 0, 0, 0, 1)}},
		{"flags 2", [][]byte{envelope(envMagic, control.ProtocolVersion, uint8(control.MsgPing), 2, 0, 0, 1)}},
		{"flags 0x81", [][]byte{envelope(envMagic, control.ProtocolVersion, uint8(control.MsgPing), 0x81, 0, 0, 1)}},
		{"zstd flag, body not zstd", [][]byte{env(control.MsgPing, control.FlagZstd, 1), []byte("plain text, not a zstd frame")}},
		{"zstd flag, truncated frame", [][]byte{env(control.MsgPing, control.FlagZstd, 1), zstdFrame(t, []byte(strings.Repeat("abc", 1000)))[:20]}},
		{"zstd bomb, declared 20 MiB", [][]byte{env(control.MsgPing, control.FlagZstd, 1), bomb(t)}},
		{"zstd bomb, streamed 20 MiB", [][]byte{env(control.MsgPing, control.FlagZstd, 1), zstdStream(t, 20<<20)}},
		{"zstd bomb, two frames of MaxBody/2+1", [][]byte{env(control.MsgPing, control.FlagZstd, 1), append(append([]byte(nil), half...), half...)}},
		{"plain body of MaxBody+1", [][]byte{ping, make([]byte, control.MaxBody+1)}},
		{"plain body of MaxBody+EnvelopeSize (the ZMQ cap)", [][]byte{ping, make([]byte, control.MaxBody+control.EnvelopeSize)}},
	}
	t.Logf("zstd bomb: 20 MiB of zeros in %d bytes", len(bomb(t)))

	before := p.Stats()
	for i, tc := range cases {
		parts := make([]any, len(tc.frames))
		for j, f := range tc.frames {
			parts[j] = f
		}
		if _, err := d.SendMessage(parts...); err != nil {
			t.Fatalf("%s: send: %v", tc.name, err)
		}
		want := before.Malformed + uint64(i) + 1
		waitFor(t, fmt.Sprintf("Malformed to reach %d after %q", want, tc.name), 10*time.Second,
			func() bool { return p.Stats().Malformed >= want })
		if got := p.Stats().Malformed; got != want {
			t.Fatalf("%s: Malformed = %d, want %d", tc.name, got, want)
		}
	}
	if p.calls.Load() != 0 {
		t.Fatalf("a handler ran %d times for malformed requests", p.calls.Load())
	}

	// The loop survives: the same DEALER is answered, and no malformed
	// message was answered before it.
	pingOverDealer(t, d, 4242)
	// And a plane is answered too.
	a := newPlane(t, "127.0.0.1")
	if typ, _, err := a.Request(ctxFor(t, 5*time.Second), p.Name(), control.MsgPing, []byte("x")); err != nil || typ != control.MsgPong {
		t.Fatalf("Request after malformed traffic: %v, %v", typ, err)
	}

	s := p.Stats()
	if s.Malformed-before.Malformed != uint64(len(cases)) {
		t.Errorf("Malformed grew by %d, want %d", s.Malformed-before.Malformed, len(cases))
	}
	if s.Received-before.Received != uint64(len(cases))+2 {
		t.Errorf("Received grew by %d, want %d", s.Received-before.Received, len(cases)+2)
	}
	if w := p.log.warns.Load(); w < int64(min(len(cases), ratelog.DefaultBurst)) {
		t.Errorf("%d warnings logged for %d malformed messages", w, len(cases))
	}
	p.log.mu.Lock()
	for _, l := range p.log.last[:min(3, len(p.log.last))] {
		t.Logf("logged: %s", l)
	}
	p.log.mu.Unlock()
}

// TestPlaneOversizedFrameDropsConnection sends a frame past ZMQ_MAXMSGSIZE
// (MaxBody+EnvelopeSize): ZMQ must cut that connection before the plane
// allocates the frame, and the plane must keep answering others.
func TestPlaneOversizedFrameDropsConnection(t *testing.T) {
	p := newPlane(t, "127.0.0.1")
	c := zctx(t)
	d := rawSocket(t, c, zmq.DEALER)
	mon := fmt.Sprintf("inproc://oversize-monitor-%p", d)
	must(t, d.Monitor(mon, zmq.EVENT_CONNECTED|zmq.EVENT_DISCONNECTED))
	events := rawSocket(t, c, zmq.PAIR)
	must(t, events.Connect(mon))
	must(t, d.Connect("tcp://"+p.Name()))
	// Connected first, so the disconnect below is the plane's doing.
	nextEvent := func(want zmq.Event) {
		t.Helper()
		for {
			ev, addr, _, err := events.RecvEvent(0)
			if err != nil {
				t.Fatalf("waiting for %v: %v", want, err)
			}
			if ev == want {
				t.Logf("dealer saw %v on %s", ev, addr)
				return
			}
		}
	}
	pingOverDealer(t, d, 1)
	nextEvent(zmq.EVENT_CONNECTED)

	before := p.Stats()
	big := make([]byte, control.MaxBody+control.EnvelopeSize+1)
	if _, err := d.SendMessage(env(control.MsgPing, 0, 2), big); err != nil {
		t.Fatalf("send oversized frame: %v", err)
	}
	nextEvent(zmq.EVENT_DISCONNECTED)

	d2 := rawDealer(t, c, p.Name())
	pingOverDealer(t, d2, 3)
	if p.calls.Load() != 2 {
		t.Fatalf("handler ran %d times, want 2 (the oversized request must never reach it)", p.calls.Load())
	}
	s := p.Stats()
	if s.Received-before.Received != 1 {
		t.Errorf("Received grew by %d, want 1: the oversized message must not be read", s.Received-before.Received)
	}
	t.Logf("stats after oversized frame: %+v (ZMQ drops it below the plane, so Malformed does not count it)", s)
}

// TestPlaneMalformedAndDuplicateReplies has a raw ROUTER answer a plane's
// request with malformed replies, a reply to an unknown id, the real reply
// and then a duplicate: malformed ones are counted as Malformed, the unknown
// and duplicate ones as Unmatched, and only the real one is delivered.
func TestPlaneMalformedAndDuplicateReplies(t *testing.T) {
	p := newPlane(t, "127.0.0.1")
	c := zctx(t)
	r, rname := rawRouter(t, c)

	ch := requestAsync(ctxFor(t, 20*time.Second), p, rname, []byte("q"))
	id, e, body := recvRequest(t, r)
	if string(id) != p.Name() {
		t.Fatalf("request's routing id %q, want the requester's segment name %q", id, p.Name())
	}
	if e.Type != control.MsgPing || string(body) != "q" {
		t.Fatalf("request %+v %q", e, body)
	}
	bad := [][][]byte{
		{[]byte("short")},
		{env(control.MsgPong, 0, e.Corr), []byte("a"), []byte("b")},              // 3 frames
		{env(control.MsgPong, 0, e.Corr), []byte("a"), []byte("b"), []byte("c")}, // 4 frames
		{envelope(0x4b43, control.ProtocolVersion, uint8(control.MsgPong), 0, 0, 0, e.Corr)},
		{envelope(envMagic, 9, uint8(control.MsgPong), 0, 0, 0, e.Corr)},
		{envelope(envMagic, control.ProtocolVersion, 77, 0, 0, 0, e.Corr)},
		{envelope(envMagic, control.ProtocolVersion, uint8(control.MsgPong), 4, 0, 0, e.Corr)},
		{env(control.MsgPong, control.FlagZstd, e.Corr), []byte("not zstd")},
		{env(control.MsgPong, control.FlagZstd, e.Corr), zstdFrame(t, make([]byte, 20<<20))},
		{env(control.MsgPong, 0, e.Corr), make([]byte, control.MaxBody+1)},
	}
	for i, frames := range bad {
		sendRaw(t, r, append([][]byte{id}, frames...)...)
		want := uint64(i + 1)
		waitFor(t, fmt.Sprintf("Malformed = %d", want), 10*time.Second, func() bool { return p.Stats().Malformed >= want })
		pending(t, ch, fmt.Sprintf("malformed reply %d", i))
	}

	sendRaw(t, r, id, env(control.MsgPong, 0, e.Corr+1000), []byte("unknown id"))
	waitFor(t, "Unmatched = 1", 10*time.Second, func() bool { return p.Stats().Unmatched >= 1 })
	pending(t, ch, "reply to an unknown id")

	sendRaw(t, r, id, env(control.MsgPong, 0, e.Corr), []byte("the answer"))
	if res := await(t, ch); res.err != nil || res.typ != control.MsgPong || string(res.body) != "the answer" {
		t.Fatalf("Request = %v %q %v, want PONG \"the answer\"", res.typ, res.body, res.err)
	}
	sendRaw(t, r, id, env(control.MsgPong, 0, e.Corr), []byte("duplicate"))
	waitFor(t, "Unmatched = 2", 10*time.Second, func() bool { return p.Stats().Unmatched >= 2 })

	// The next request is answered by its own reply, not the duplicate.
	ch = requestAsync(ctxFor(t, 10*time.Second), p, rname, []byte("q2"))
	id, e2, _ := recvRequest(t, r)
	if e2.Corr == e.Corr {
		t.Fatalf("correlation id %d reused", e.Corr)
	}
	sendRaw(t, r, id, env(control.MsgPong, 0, e2.Corr), []byte("second answer"))
	if res := await(t, ch); res.err != nil || string(res.body) != "second answer" {
		t.Fatalf("second Request = %v %q %v", res.typ, res.body, res.err)
	}
	// An ERROR reply surfaces as ErrRemote with its reason.
	ch = requestAsync(ctxFor(t, 10*time.Second), p, rname, nil)
	id, e3, _ := recvRequest(t, r)
	sendRaw(t, r, id, env(control.MsgError, 0, e3.Corr), []byte("no such thing"))
	if res := await(t, ch); !errors.Is(res.err, control.ErrRemote) || !strings.Contains(res.err.Error(), "no such thing") {
		t.Fatalf("ERROR reply: %v, want ErrRemote with the reason", res.err)
	}

	s := p.Stats()
	if s.Malformed != uint64(len(bad)) || s.Unmatched != 2 {
		t.Fatalf("stats %+v, want Malformed %d, Unmatched 2", s, len(bad))
	}
	if w := p.log.warns.Load(); w < int64(min(len(bad), ratelog.DefaultBurst)) {
		t.Errorf("%d warnings logged for %d malformed replies", w, len(bad))
	}
}

// TestPlaneLateReply: a reply that arrives after its Request gave up is
// dropped and counted, and never answers a later request.
func TestPlaneLateReply(t *testing.T) {
	p := newPlane(t, "127.0.0.1")
	c := zctx(t)
	r, rname := rawRouter(t, c)

	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	ch := requestAsync(ctx, p, rname, []byte("slow"))
	id, e, _ := recvRequest(t, r)
	if res := await(t, ch); !errors.Is(res.err, context.DeadlineExceeded) {
		t.Fatalf("unanswered Request: %v, want DeadlineExceeded", res.err)
	}
	sendRaw(t, r, id, env(control.MsgPong, 0, e.Corr), []byte("late"))
	waitFor(t, "Unmatched = 1", 10*time.Second, func() bool { return p.Stats().Unmatched == 1 })

	ch = requestAsync(ctxFor(t, 10*time.Second), p, rname, []byte("next"))
	id, e2, _ := recvRequest(t, r)
	sendRaw(t, r, id, env(control.MsgPong, 0, e2.Corr), []byte("on time"))
	if res := await(t, ch); res.err != nil || string(res.body) != "on time" {
		t.Fatalf("next Request = %v %q %v", res.typ, res.body, res.err)
	}
	if s := p.Stats(); s.Unmatched != 1 || s.Malformed != 0 {
		t.Fatalf("stats %+v", s)
	}
}

// TestPlaneReplyFromOtherPeerIsUnmatched: a reply is matched to the request
// it answers by correlation id, so it must also come from the peer that
// request went to. Here peer R2 answers with the id of a request that went
// to R1 (ids are sequential, so easy to guess or to reuse by mistake, e.g.
// by a peer still answering an earlier incarnation of this segment). The
// request to R1 must not complete with R2's answer.
func TestPlaneReplyFromOtherPeerIsUnmatched(t *testing.T) {
	p := newPlane(t, "127.0.0.1")
	c := zctx(t)
	r1, name1 := rawRouter(t, c)
	r2, name2 := rawRouter(t, c)

	ctx1, cancel1 := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel1()
	ch1 := requestAsync(ctx1, p, name1, []byte("to r1"))
	_, e1, _ := recvRequest(t, r1) // R1 never answers

	ch2 := requestAsync(ctxFor(t, 10*time.Second), p, name2, []byte("to r2"))
	id2, e2, _ := recvRequest(t, r2)
	sendRaw(t, r2, id2, env(control.MsgPong, 0, e1.Corr), []byte("forged by r2"))
	sendRaw(t, r2, id2, env(control.MsgPong, 0, e2.Corr), []byte("r2's own answer"))
	if res := await(t, ch2); res.err != nil || string(res.body) != "r2's own answer" {
		t.Fatalf("request to r2: %v %q %v", res.typ, res.body, res.err)
	}
	res := await(t, ch1)
	if res.err == nil {
		t.Errorf("BUG: the request to %s (corr %d) completed with %v %q, which %s sent: "+
			"replies are matched on correlation id alone, not on the peer they were sent to", name1, e1.Corr, res.typ, res.body, name2)
	} else if !errors.Is(res.err, context.DeadlineExceeded) {
		t.Errorf("request to r1: %v, want DeadlineExceeded", res.err)
	}
	if s := p.Stats(); s.Unmatched != 1 {
		t.Errorf("Unmatched = %d, want 1 (the reply from the wrong peer)", s.Unmatched)
	}
}

// TestPlaneOversizedReply: a handler whose reply inflates past MaxBody is
// answered with something the requester refuses; the requester counts it as
// malformed and its Request ends by its deadline, and both loops survive.
func TestPlaneOversizedReply(t *testing.T) {
	lc := &logCounter{}
	b, err := control.Listen("127.0.0.1", 0, slog.New(lc))
	must(t, err)
	b.Handle(control.MsgGetDescriptor, func(string, []byte) (control.MsgType, []byte) {
		return control.MsgDescriptor, make([]byte, control.MaxBody+1) // zeros: compresses to a small frame
	})
	b.Handle(control.MsgPing, func(string, []byte) (control.MsgType, []byte) { return control.MsgPong, nil })
	b.Start()
	t.Cleanup(func() { _ = b.Close() })
	a := newPlane(t, "127.0.0.1")

	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	_, _, err = a.Request(ctx, b.Name(), control.MsgGetDescriptor, nil)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Request answered with more than MaxBody: %v, want DeadlineExceeded", err)
	}
	if s := a.Stats(); s.Malformed != 1 {
		t.Fatalf("requester stats %+v, want Malformed 1", s)
	}
	if _, _, err := a.Request(ctxFor(t, 5*time.Second), b.Name(), control.MsgPing, nil); err != nil {
		t.Fatalf("Request after an oversized reply: %v", err)
	}
}
