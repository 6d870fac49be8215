package control_test

// Helpers of the control plane's tests: planes on loopback, raw ZMQ sockets
// that stand in for misbehaving peers, and requests awaited asynchronously.

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvferry/kvferry/engine/control"
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

func (l *logCounter) WithGroup(string) slog.Handler { return l }

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

// waitingCtx is a context that tells, by closing waiting, when a caller
// first asks for its Done channel: Plane.Request does so only once its
// request is queued and it waits for the reply, so a test can cancel or
// close while a Request is surely in flight.
type waitingCtx struct {
	context.Context
	once    sync.Once
	waiting chan struct{}
}

func newWaitingCtx(parent context.Context) *waitingCtx {
	return &waitingCtx{Context: parent, waiting: make(chan struct{})}
}

// Done implements context.Context.
func (c *waitingCtx) Done() <-chan struct{} {
	c.once.Do(func() { close(c.waiting) })
	return c.Context.Done()
}
