package control_test

import (
	"crypto/rand"
	"errors"
	"log/slog"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvferry/kvferry/engine/auth"
	"github.com/kvferry/kvferry/engine/auth/authtest"
	"github.com/kvferry/kvferry/engine/control"
)

// newAuthPlane starts a plane like newPlane, with a (nil: NULL).
func newAuthPlane(t *testing.T, a *auth.Authority) *testPlane {
	t.Helper()
	lc := &logCounter{}
	p, err := control.ListenWith("127.0.0.1", 0, control.Options{Auth: a, HandshakeTimeout: 2 * time.Second}, slog.New(lc))
	if err != nil {
		t.Fatalf("ListenWith: %v", err)
	}
	tp := &testPlane{Plane: p, log: lc}
	p.Handle(control.MsgPing, func(from string, body []byte) (control.MsgType, []byte) {
		tp.calls.Add(1)
		tp.from.Store(from)
		return control.MsgPong, body
	})
	p.Start()
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return tp
}

func TestPlanesWithAllowedKeysTalkOverCurve(t *testing.T) {
	a, b := authtest.NewIdentity(t), authtest.NewIdentity(t)
	pa := newAuthPlane(t, authtest.Authority(t, a, b.Public))
	pb := newAuthPlane(t, authtest.Authority(t, b, a.Public))
	big := make([]byte, 3<<20) // several MESSAGE boxes, the long frame form
	_, _ = rand.Read(big)
	for _, body := range [][]byte{[]byte("hello"), big} {
		typ, got, err := pa.Request(ctxFor(t, 10*time.Second), pb.Name(), control.MsgPing, body)
		if err != nil || typ != control.MsgPong || string(got) != string(body) {
			t.Fatalf("PING over CURVE: %v %d bytes %v", typ, len(got), err)
		}
	}
	if from, _ := pb.from.Load().(string); from != pa.Name() {
		t.Fatalf("handler saw the request from %q, want %q", from, pa.Name())
	}
	// Both ways: b opens its own connection to a.
	if _, _, err := pb.Request(ctxFor(t, 10*time.Second), pa.Name(), control.MsgPing, []byte("back")); err != nil {
		t.Fatalf("PING the other way: %v", err)
	}
	if r := pa.Stats().AuthRefused + pb.Stats().AuthRefused; r != 0 {
		t.Fatalf("AuthRefused = %d between allowed peers", r)
	}
	if k, ok := pb.PeerKey(ctxFor(t, 5*time.Second), pa.Name()); !ok || k != a.Public {
		t.Fatalf("PeerKey(%s) = %v %v, want a's key", pa.Name(), k, ok)
	}
}

// Every way of not holding an allowed key ends in the handshake: the server's
// handler never runs, and the server counts the refusal. The same request
// between two planes without authentication is answered, which shows the
// requests themselves are fine.
func TestPeersWithoutAnAllowedKeyAreRefusedInTheHandshake(t *testing.T) {
	server, allowed, stranger := authtest.NewIdentity(t), authtest.NewIdentity(t), authtest.NewIdentity(t)
	srv := newAuthPlane(t, authtest.Authority(t, server, allowed.Public))
	open := newAuthPlane(t, nil)

	cases := []struct {
		name   string
		client *auth.Authority // nil: NULL
		// quick: the client learns it was refused (ErrUnauthenticated);
		// otherwise it only sees no answer.
		quick bool
	}{
		{"no key (NULL mechanism)", nil, false},
		{"a key the server does not allow", authtest.Authority(t, stranger, server.Public), true},
		{"an allowed key, but the server's key is not on the client's list", authtest.Authority(t, allowed), true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cl := newAuthPlane(t, tc.client)
			before := srv.calls.Load()
			refusedBefore := srv.Stats().AuthRefused + cl.Stats().AuthRefused
			wait := time.Second
			if tc.quick {
				wait = 5 * time.Second
			}
			_, _, err := cl.Request(ctxFor(t, wait), srv.Name(), control.MsgPing, []byte("let me in"))
			if err == nil {
				t.Fatal("request answered")
			}
			if tc.quick && !errors.Is(err, control.ErrUnauthenticated) {
				t.Fatalf("err = %v, want ErrUnauthenticated", err)
			}
			if n := srv.calls.Load(); n != before {
				t.Fatalf("the server's handler ran %d times", n-before)
			}
			waitFor(t, "a refusal counted", 5*time.Second, func() bool {
				return srv.Stats().AuthRefused+cl.Stats().AuthRefused > refusedBefore
			})
		})
	}
	t.Run("an authenticating client and a server that does not authenticate", func(t *testing.T) {
		cl := newAuthPlane(t, authtest.Authority(t, allowed, server.Public))
		_, _, err := cl.Request(ctxFor(t, 3*time.Second), open.Name(), control.MsgPing, []byte("secret"))
		if !errors.Is(err, control.ErrUnauthenticated) {
			t.Fatalf("err = %v, want ErrUnauthenticated", err)
		}
		if n := open.calls.Load(); n != 0 {
			t.Fatalf("the open server's handler ran %d times", n)
		}
	})
	t.Run("the same request without authentication on either side", func(t *testing.T) {
		cl := newAuthPlane(t, nil)
		if _, _, err := cl.Request(ctxFor(t, 5*time.Second), open.Name(), control.MsgPing, []byte("hi")); err != nil {
			t.Fatalf("NULL to NULL: %v", err)
		}
	})
}

// A peer whose key is removed from the allowlist at run time loses its
// connection at Revoke and is refused when it comes back.
func TestRevokeCutsAPeerWhoseKeyWasRemoved(t *testing.T) {
	server, a, b := authtest.NewIdentity(t), authtest.NewIdentity(t), authtest.NewIdentity(t)
	sa, allowlist := authtest.New(t, server, a.Public, b.Public)
	srv := newAuthPlane(t, sa)
	pa := newAuthPlane(t, authtest.Authority(t, a, server.Public))
	pb := newAuthPlane(t, authtest.Authority(t, b, server.Public))
	for _, p := range []*testPlane{pa, pb} {
		if _, _, err := p.Request(ctxFor(t, 5*time.Second), srv.Name(), control.MsgPing, nil); err != nil {
			t.Fatal(err)
		}
	}
	authtest.WriteAllowlist(t, allowlist, b.Public)
	removed, err := sa.Reload()
	if err != nil || len(removed) != 1 || removed[0] != a.Public {
		t.Fatalf("Reload = %v, %v", removed, err)
	}
	names, err := srv.Revoke(ctxFor(t, 5*time.Second))
	if err != nil || len(names) != 1 || names[0] != pa.Name() {
		t.Fatalf("Revoke = %v, %v; want [%s]", names, err, pa.Name())
	}
	calls := srv.calls.Load()
	_, _, err = pa.Request(ctxFor(t, 5*time.Second), srv.Name(), control.MsgPing, nil)
	if !errors.Is(err, control.ErrUnauthenticated) {
		t.Fatalf("the removed peer's next request: %v, want ErrUnauthenticated", err)
	}
	if srv.calls.Load() != calls {
		t.Fatal("the removed peer reached a handler")
	}
	if _, _, err := pb.Request(ctxFor(t, 5*time.Second), srv.Name(), control.MsgPing, nil); err != nil {
		t.Fatalf("the peer still allowed: %v", err)
	}
}

// libzmq's own CURVE client (a DEALER given the server's key) is a valid
// peer, so the mechanism is CurveZMQ as libzmq speaks it, not a look-alike.
func TestLibzmqCurveClientIsServed(t *testing.T) {
	if !zmq.HasCurve() {
		t.Skip("libzmq built without CURVE")
	}
	server := authtest.NewIdentity(t)
	pub, sec, err := zmq.NewCurveKeypair()
	must(t, err)
	clientKey, err := auth.ParseKey(pub)
	must(t, err)
	srv := newAuthPlane(t, authtest.Authority(t, server, clientKey))

	d := rawSocket(t, zctx(t), zmq.DEALER)
	must(t, d.SetCurveServerkey(server.Public.String()))
	must(t, d.SetCurvePublickey(pub))
	must(t, d.SetCurveSecretkey(sec))
	must(t, d.SetIdentity("libzmq-client"))
	must(t, d.Connect("tcp://"+srv.Name()))
	pingOverDealer(t, d, 7)
	pingOverDealer(t, d, 8)
	if from, _ := srv.from.Load().(string); from != "libzmq-client" {
		t.Fatalf("handler saw %q, want the DEALER's identity", from)
	}

	// The same client with a key the server does not allow gets nothing.
	pub2, sec2, err := zmq.NewCurveKeypair()
	must(t, err)
	d2 := rawSocket(t, zctx(t), zmq.DEALER)
	must(t, d2.SetCurveServerkey(server.Public.String()))
	must(t, d2.SetCurvePublickey(pub2))
	must(t, d2.SetCurveSecretkey(sec2))
	must(t, d2.SetRcvtimeo(500*time.Millisecond))
	must(t, d2.Connect("tcp://"+srv.Name()))
	calls := srv.calls.Load()
	refused := srv.Stats().AuthRefused
	_, _ = d2.SendMessage(env(control.MsgPing, 0, 9), []byte("x"))
	if msg, err := d2.RecvMessageBytes(0); err == nil {
		t.Fatalf("a client the allowlist lacks got an answer: %q", msg)
	}
	waitFor(t, "the refusal counted", 5*time.Second, func() bool { return srv.Stats().AuthRefused > refused })
	if srv.calls.Load() != calls {
		t.Fatal("a client the allowlist lacks reached a handler")
	}
}
