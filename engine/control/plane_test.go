package control_test

// Tests of the ZMQ control plane over loopback. Raw ZMQ sockets stand in for
// misbehaving peers: a DEALER that sends malformed requests to a plane's
// ROUTER, and a ROUTER that answers a plane's requests badly.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvferry/kvferry/engine/control"
	"github.com/kvferry/kvferry/internal/ratelog"
)

// logCounter is an slog handler that counts warnings, so tests can check
// that a dropped message was logged, not only counted.
type logCounter struct {
	warns atomic.Int64
	mu    sync.Mutex
	last  []string
}

func (l *logCounter) Enabled(context.Context, slog.Level) bool { return true }
func (l *logCounter) Handle(_ context.Context, r slog.Record) error {
	if r.Level >= slog.LevelWarn {
		l.warns.Add(1)
		l.mu.Lock()
		if len(l.last) < 64 {
			var sb strings.Builder
			sb.WriteString(r.Message)
			r.Attrs(func(a slog.Attr) bool { fmt.Fprintf(&sb, " %s=%v", a.Key, a.Value); return true })
			l.last = append(l.last, sb.String())
		}
		l.mu.Unlock()
	}
	return nil
}
func (l *logCounter) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logCounter) WithGroup(string) slog.Handler      { return l }

type testPlane struct {
	*control.Plane
	log   *logCounter
	calls atomic.Int64 // handler invocations
	from  atomic.Value // last requester name seen by a handler
}

// newPlane starts a plane on host with a PING handler that echoes the body
// in a PONG.
func newPlane(t *testing.T, host string) *testPlane {
	t.Helper()
	lc := &logCounter{}
	p, err := control.Listen(host, 0, slog.New(lc))
	if err != nil {
		t.Fatalf("Listen(%q): %v", host, err)
	}
	tp := &testPlane{Plane: p, log: lc}
	p.Handle(control.MsgPing, func(from string, body []byte) (control.MsgType, []byte) {
		tp.calls.Add(1)
		tp.from.Store(from)
		return control.MsgPong, body
	})
	p.Handle(control.MsgGetDescriptor, func(from string, _ []byte) (control.MsgType, []byte) {
		tp.calls.Add(1)
		d := sampleDescriptor()
		d.Name = p.Name()
		return control.MsgDescriptor, d.Encode()
	})
	p.Start()
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return tp
}

func ctxFor(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t *testing.T, what string, d time.Duration, cond func() bool) {
	t.Helper()
	end := time.Now().Add(d)
	for !cond() {
		if time.Now().After(end) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// zctx returns a ZMQ context for the test's raw sockets, terminated at
// cleanup after every socket made from it is closed.
func zctx(t *testing.T) *zmq.Context {
	t.Helper()
	c, err := zmq.NewContext()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Term() })
	return c
}

func rawSocket(t *testing.T, c *zmq.Context, typ zmq.Type) *zmq.Socket {
	t.Helper()
	s, err := c.NewSocket(typ)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	must(t, s.SetLinger(0))
	must(t, s.SetRcvtimeo(5*time.Second))
	must(t, s.SetSndtimeo(5*time.Second))
	return s
}

// rawDealer connects a DEALER to a plane's ROUTER.
func rawDealer(t *testing.T, c *zmq.Context, peer string) *zmq.Socket {
	t.Helper()
	d := rawSocket(t, c, zmq.DEALER)
	must(t, d.SetIpv6(strings.HasPrefix(peer, "[")))
	must(t, d.Connect("tcp://"+peer))
	return d
}

// rawRouter binds a ROUTER on loopback and returns it with its "host:port".
func rawRouter(t *testing.T, c *zmq.Context) (*zmq.Socket, string) {
	t.Helper()
	r := rawSocket(t, c, zmq.ROUTER)
	must(t, r.Bind("tcp://127.0.0.1:*"))
	ep, err := r.GetLastEndpoint()
	must(t, err)
	return r, strings.TrimPrefix(ep, "tcp://")
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func env(typ control.MsgType, flags uint8, corr uint64) []byte {
	return control.EncodeEnvelope(control.Envelope{Type: typ, Flags: flags, Corr: corr})
}

// pingOverDealer sends a valid PING on a raw DEALER and checks that the very
// next message it receives is the matching PONG: any reply to an earlier,
// malformed message would arrive first.
func pingOverDealer(t *testing.T, d *zmq.Socket, corr uint64) {
	t.Helper()
	if _, err := d.SendMessage(env(control.MsgPing, 0, corr), []byte("still alive")); err != nil {
		t.Fatalf("send ping: %v", err)
	}
	msg, err := d.RecvMessageBytes(0)
	if err != nil {
		t.Fatalf("no answer to a valid PING: %v", err)
	}
	if len(msg) != 2 {
		t.Fatalf("answer of %d frames: %q", len(msg), msg)
	}
	e, err := control.DecodeEnvelope(msg[0])
	if err != nil {
		t.Fatalf("answer envelope: %v", err)
	}
	if e.Type != control.MsgPong || e.Corr != corr || string(msg[1]) != "still alive" {
		t.Fatalf("answer %+v %q; want PONG corr %d (an earlier malformed message was answered?)", e, msg[1], corr)
	}
}

func TestPlaneRequestReply(t *testing.T) {
	a, b := newPlane(t, "127.0.0.1"), newPlane(t, "127.0.0.1")
	if _, _, err := net.SplitHostPort(a.Name()); err != nil || !strings.HasPrefix(a.Name(), "127.0.0.1:") {
		t.Fatalf("Name() = %q, want 127.0.0.1:port", a.Name())
	}
	ctx := ctxFor(t, 10*time.Second)

	t.Run("ping", func(t *testing.T) {
		typ, body, err := a.Request(ctx, b.Name(), control.MsgPing, []byte("hello"))
		if err != nil || typ != control.MsgPong || string(body) != "hello" {
			t.Fatalf("Request = %v, %q, %v; want PONG hello", typ, body, err)
		}
		if from, _ := b.from.Load().(string); from != a.Name() {
			t.Fatalf("handler saw the request from %q, want the requester's segment name %q", from, a.Name())
		}
	})
	t.Run("empty body", func(t *testing.T) {
		typ, body, err := a.Request(ctx, b.Name(), control.MsgPing, nil)
		if err != nil || typ != control.MsgPong || len(body) != 0 {
			t.Fatalf("Request = %v, %q, %v", typ, body, err)
		}
	})
	t.Run("descriptor", func(t *testing.T) {
		typ, body, err := a.Request(ctx, b.Name(), control.MsgGetDescriptor, nil)
		if err != nil || typ != control.MsgDescriptor {
			t.Fatalf("Request = %v, %v", typ, err)
		}
		d, err := control.DecodeDescriptor(body)
		if err != nil || d.Name != b.Name() {
			t.Fatalf("descriptor %+v, %v", d, err)
		}
	})
	t.Run("compressed both ways", func(t *testing.T) {
		big := bytes.Repeat([]byte("0123456789abcdef"), 1<<16) // 1 MiB, compresses
		typ, body, err := a.Request(ctx, b.Name(), control.MsgPing, big)
		if err != nil || typ != control.MsgPong || !bytes.Equal(body, big) {
			t.Fatalf("Request of %d compressible bytes = %v, %d bytes, %v", len(big), typ, len(body), err)
		}
		rnd := make([]byte, 1<<20) // does not compress
		r := rand.New(rand.NewPCG(1, 2))
		for i := range rnd {
			rnd[i] = byte(r.Uint32())
		}
		typ, body, err = a.Request(ctx, b.Name(), control.MsgPing, rnd)
		if err != nil || typ != control.MsgPong || !bytes.Equal(body, rnd) {
			t.Fatalf("Request of %d random bytes = %v, %d bytes, %v", len(rnd), typ, len(body), err)
		}
	})
	t.Run("body of exactly MaxBody", func(t *testing.T) {
		rnd := make([]byte, control.MaxBody)
		r := rand.New(rand.NewPCG(3, 4))
		for i := range rnd {
			rnd[i] = byte(r.Uint32())
		}
		typ, body, err := a.Request(ctx, b.Name(), control.MsgPing, rnd)
		if err != nil || typ != control.MsgPong || !bytes.Equal(body, rnd) {
			t.Fatalf("Request of MaxBody random bytes = %v, %d bytes, %v", typ, len(body), err)
		}
	})
	t.Run("no handler", func(t *testing.T) {
		_, _, err := a.Request(ctx, b.Name(), control.MsgPong, nil)
		if !errors.Is(err, control.ErrRemote) {
			t.Fatalf("Request of a type without handler: %v, want ErrRemote", err)
		}
	})
	t.Run("to itself", func(t *testing.T) {
		typ, body, err := a.Request(ctx, a.Name(), control.MsgPing, []byte("me"))
		if err != nil || typ != control.MsgPong || string(body) != "me" {
			t.Fatalf("Request to self = %v, %q, %v", typ, body, err)
		}
	})
	t.Run("concurrent", func(t *testing.T) {
		var wg sync.WaitGroup
		errs := make(chan error, 64)
		for g := range 32 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range 20 {
					want := fmt.Sprintf("g%d-i%d", g, i)
					typ, body, err := a.Request(ctx, b.Name(), control.MsgPing, []byte(want))
					if err != nil || typ != control.MsgPong || string(body) != want {
						errs <- fmt.Errorf("request %s: %v %q %v", want, typ, body, err)
						return
					}
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
	})
	for _, p := range []*testPlane{a, b} {
		if s := p.Stats(); s.Malformed != 0 || s.Unmatched != 0 || s.SendFails != 0 {
			t.Errorf("%s: stats %+v after clean traffic", p.Name(), s)
		}
	}
}

func TestPlaneRequestBadPeerName(t *testing.T) {
	a := newPlane(t, "127.0.0.1")
	start := time.Now()
	_, _, err := a.Request(ctxFor(t, 5*time.Second), "no-port-here", control.MsgPing, nil)
	if err == nil || time.Since(start) > time.Second {
		t.Fatalf("Request to a name without a port: %v after %v, want a prompt error", err, time.Since(start))
	}
}

// freePort returns a loopback port nobody listens on (the race with other
// processes taking it is harmless for the tests that use it).
func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	port := l.Addr().(*net.TCPAddr).Port
	must(t, l.Close())
	return port
}

func TestPlaneRequestNobodyListening(t *testing.T) {
	a := newPlane(t, "127.0.0.1")
	peer := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	const deadline = 300 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), deadline)
	defer cancel()
	start := time.Now()
	_, _, err := a.Request(ctx, peer, control.MsgPing, []byte("anyone?"))
	took := time.Since(start)
	if !errors.Is(err, control.ErrUnreachable) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Request to %s with nobody listening: %v, want ErrUnreachable and DeadlineExceeded", peer, err)
	}
	if took < deadline-10*time.Millisecond || took > deadline+2*time.Second {
		t.Fatalf("Request returned after %v, want about its deadline %v", took, deadline)
	}
	// The plane is still usable, for other peers and to return by a
	// cancelled context too.
	b := newPlane(t, "127.0.0.1")
	if _, _, err := a.Request(ctxFor(t, 5*time.Second), b.Name(), control.MsgPing, nil); err != nil {
		t.Fatalf("Request after a timed-out one: %v", err)
	}
	cctx, ccancel := context.WithCancel(context.Background())
	go func() { time.Sleep(50 * time.Millisecond); ccancel() }()
	if _, _, err := a.Request(cctx, peer, control.MsgPing, nil); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled Request: %v, want context.Canceled", err)
	}
}

func TestPlaneClose(t *testing.T) {
	lc := &logCounter{}
	a, err := control.Listen("127.0.0.1", 0, slog.New(lc))
	must(t, err)
	a.Start()
	peer := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	res := make(chan error, 1)
	go func() {
		_, _, err := a.Request(context.Background(), peer, control.MsgPing, nil) // no deadline: only Close ends it
		res <- err
	}()
	time.Sleep(50 * time.Millisecond)
	done := make(chan error, 1)
	go func() { done <- a.Close() }()
	select {
	case err := <-done:
		must(t, err)
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not return")
	}
	select {
	case err := <-res:
		if !errors.Is(err, control.ErrClosed) {
			t.Fatalf("Request in flight at Close: %v, want ErrClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Request in flight at Close did not return")
	}
	if _, _, err := a.Request(context.Background(), peer, control.MsgPing, nil); !errors.Is(err, control.ErrClosed) {
		t.Fatalf("Request after Close: %v, want ErrClosed", err)
	}
	if err := a.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

func TestPlaneIPv6Name(t *testing.T) {
	l, err := net.Listen("tcp6", "[::1]:0")
	if err != nil {
		t.Skipf("IPv6 loopback ::1 unavailable on this host (%v); cannot test \"[::1]:port\" names", err)
	}
	_ = l.Close()
	b := newPlane(t, "::1")
	host, port, err := net.SplitHostPort(b.Name())
	if err != nil || host != "::1" || port == "0" || !strings.HasPrefix(b.Name(), "[::1]:") {
		t.Fatalf("Name() = %q, want \"[::1]:port\"", b.Name())
	}
	ctx := ctxFor(t, 10*time.Second)
	a6 := newPlane(t, "::1")
	typ, body, err := a6.Request(ctx, b.Name(), control.MsgPing, []byte("v6"))
	if err != nil || typ != control.MsgPong || string(body) != "v6" {
		t.Fatalf("IPv6 to IPv6 Request = %v, %q, %v", typ, body, err)
	}
	if from, _ := b.from.Load().(string); from != a6.Name() {
		t.Fatalf("handler saw %q, want %q", from, a6.Name())
	}
	a4 := newPlane(t, "127.0.0.1")
	typ, body, err = a4.Request(ctx, b.Name(), control.MsgPing, []byte("v4->v6"))
	if err != nil || typ != control.MsgPong || string(body) != "v4->v6" {
		t.Fatalf("IPv4 plane to IPv6 peer Request = %v, %q, %v", typ, body, err)
	}
}

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

// requestAsync starts a Request and returns its outcome on a channel.
type result struct {
	typ  control.MsgType
	body []byte
	err  error
}

func requestAsync(ctx context.Context, p *testPlane, peer string, body []byte) <-chan result {
	ch := make(chan result, 1)
	go func() {
		typ, b, err := p.Request(ctx, peer, control.MsgPing, body)
		ch <- result{typ, b, err}
	}()
	return ch
}

// recvRequest reads one request on a raw ROUTER: the routing id and the
// decoded envelope.
func recvRequest(t *testing.T, r *zmq.Socket) (id []byte, e control.Envelope, body []byte) {
	t.Helper()
	msg, err := r.RecvMessageBytes(0)
	if err != nil {
		t.Fatalf("raw ROUTER: no request: %v", err)
	}
	if len(msg) < 2 || len(msg) > 3 {
		t.Fatalf("raw ROUTER: request of %d frames", len(msg))
	}
	e, err = control.DecodeEnvelope(msg[1])
	if err != nil {
		t.Fatalf("raw ROUTER: request envelope: %v", err)
	}
	if len(msg) == 3 {
		body = msg[2]
	}
	return msg[0], e, body
}

func sendRaw(t *testing.T, s *zmq.Socket, frames ...[]byte) {
	t.Helper()
	parts := make([]any, len(frames))
	for i, f := range frames {
		parts[i] = f
	}
	if _, err := s.SendMessage(parts...); err != nil {
		t.Fatalf("raw send: %v", err)
	}
}

func pending(t *testing.T, ch <-chan result, what string) {
	t.Helper()
	select {
	case r := <-ch:
		t.Fatalf("%s: Request completed early with %v %q %v", what, r.typ, r.body, r.err)
	default:
	}
}

func await(t *testing.T, ch <-chan result) result {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("Request did not return")
	}
	return result{}
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
