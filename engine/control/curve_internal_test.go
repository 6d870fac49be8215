package control

import (
	"bytes"
	"errors"
	"testing"

	"github.com/kvferry/kvferry/engine/auth"
	"github.com/kvferry/kvferry/engine/auth/authtest"
)

// sessionPair is a client and a server session wired to each other in
// memory.
type sessionPair struct {
	cl, srv            *curveSession
	toSrv, toCl        []byte // bytes in flight
	plainSrv, plainCl  []byte // plain frames each has opened
	errCl, errSrv      error
	clientID, serverID auth.Identity
}

func newSessionPair(t testing.TB, clientAllows, serverAllows func(cl, srv auth.Identity) []auth.Key) *sessionPair {
	t.Helper()
	p := &sessionPair{clientID: authtest.NewIdentity(t), serverID: authtest.NewIdentity(t)}
	var err error
	if p.cl, err = newCurveSession(authtest.Authority(t, p.clientID, clientAllows(p.clientID, p.serverID)...), false); err != nil {
		t.Fatal(err)
	}
	p.cl.identity = "client:1"
	if p.srv, err = newCurveSession(authtest.Authority(t, p.serverID, serverAllows(p.clientID, p.serverID)...), true); err != nil {
		t.Fatal(err)
	}
	p.toSrv = p.cl.greeting()
	p.toCl = p.srv.greeting()
	return p
}

func (p *sessionPair) pump() {
	for i := 0; i < 8 && (len(p.toSrv) > 0 || len(p.toCl) > 0); i++ {
		in := p.toSrv
		p.toSrv = nil
		if p.errSrv == nil {
			p.errSrv = p.srv.feed(in, func(b []byte) { p.toCl = append(p.toCl, b...) },
				func(f []byte) error { p.plainSrv = append(p.plainSrv, f...); return nil })
		}
		in = p.toCl
		p.toCl = nil
		if p.errCl == nil {
			p.errCl = p.cl.feed(in, func(b []byte) { p.toSrv = append(p.toSrv, b...) },
				func(f []byte) error { p.plainCl = append(p.plainCl, f...); return nil })
		}
	}
}

func both(cl, srv auth.Identity) []auth.Key { return []auth.Key{cl.Public, srv.Public} }

func TestCurveSessionsAgreeAndCarryFramesBothWays(t *testing.T) {
	p := newSessionPair(t, both, both)
	p.pump()
	if p.errCl != nil || p.errSrv != nil || p.cl.stage != curveOpen || p.srv.stage != curveOpen {
		t.Fatalf("handshake: client %v (stage %d), server %v (stage %d)", p.errCl, p.cl.stage, p.errSrv, p.srv.stage)
	}
	if p.srv.peerKey != p.clientID.Public || p.cl.peerKey != p.serverID.Public {
		t.Fatal("a side did not learn the other's permanent key")
	}
	if p.srv.identity != "client:1" || p.srv.socketType != "DEALER" || p.cl.socketType != "ROUTER" {
		t.Fatalf("metadata: server saw %q/%q, client saw %q", p.srv.socketType, p.srv.identity, p.cl.socketType)
	}
	msg := encodeMessage([][]byte{[]byte("envelope"), bytes.Repeat([]byte{7}, 1000)})
	p.toSrv = p.cl.seal(msg)
	p.pump()
	if !bytes.Equal(p.plainSrv, msg) {
		t.Fatalf("server opened %q, want %q", p.plainSrv, msg)
	}
	p.toCl = p.srv.seal(msg)
	p.pump()
	if !bytes.Equal(p.plainCl, msg) {
		t.Fatal("client did not open the server's frames")
	}
}

func TestCurveMessagesCannotBeChangedOrReplayed(t *testing.T) {
	p := newSessionPair(t, both, both)
	p.pump()
	sealed := p.cl.seal(encodeMessage([][]byte{[]byte("abort request 42")}))
	changed := append([]byte(nil), sealed...)
	changed[len(changed)-1] ^= 1
	if err := p.srv.feed(changed, func([]byte) {}, func([]byte) error { t.Fatal("a changed MESSAGE opened"); return nil }); err == nil {
		t.Fatal("a changed MESSAGE was not an error")
	}

	p = newSessionPair(t, both, both)
	p.pump()
	sealed = p.cl.seal(encodeMessage([][]byte{[]byte("abort request 42")}))
	n := 0
	feed := func() error {
		return p.srv.feed(sealed, func([]byte) {}, func([]byte) error { n++; return nil })
	}
	if err := feed(); err != nil || n != 1 {
		t.Fatalf("first delivery: %v, %d frames", err, n)
	}
	if err := feed(); err == nil || n != 1 {
		t.Fatalf("a replayed MESSAGE: %v, %d frames", err, n)
	}
}

func TestCurveRefusesWhatTheAllowlistsDoNotHold(t *testing.T) {
	onlySelf := func(cl, srv auth.Identity) []auth.Key { return nil }
	for _, tc := range []struct {
		name          string
		clAll, srvAll func(cl, srv auth.Identity) []auth.Key
	}{
		{"server does not allow the client", both, onlySelf},
		{"client does not know the server", onlySelf, both},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newSessionPair(t, tc.clAll, tc.srvAll)
			p.pump()
			var r *curveRefusal
			if !errors.As(p.errCl, &r) && !errors.As(p.errSrv, &r) {
				t.Fatalf("no refusal: client %v, server %v", p.errCl, p.errSrv)
			}
			if !errors.Is(r, ErrUnauthenticated) || p.srv.stage == curveOpen {
				t.Fatalf("refusal %v, server stage %d", r, p.srv.stage)
			}
		})
	}
}

// An impostor that announces the real server's key in its greeting, but
// does not hold its secret, cannot answer HELLO with a WELCOME the client
// opens.
func TestCurveClientRefusesAServerWithoutTheSecretOfTheKeyItAnnounces(t *testing.T) {
	real, impostor, client := authtest.NewIdentity(t), authtest.NewIdentity(t), authtest.NewIdentity(t)
	cl, err := newCurveSession(authtest.Authority(t, client, real.Public), false)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := newCurveSession(authtest.Authority(t, impostor, client.Public), true)
	if err != nil {
		t.Fatal(err)
	}
	toSrv := cl.greeting()
	toCl := curveGreeting(true, real.Public) // the real server's key in the greeting
	var clErr, srvErr error
	for i := 0; i < 4; i++ {
		if clErr == nil {
			clErr = cl.feed(toCl, func(b []byte) { toSrv = append(toSrv, b...) }, func([]byte) error { return nil })
		}
		toCl = nil
		if srvErr == nil {
			srvErr = srv.feed(toSrv, func(b []byte) { toCl = append(toCl, b...) }, func([]byte) error { return nil })
		}
		toSrv = nil
	}
	if !errors.Is(clErr, ErrUnauthenticated) && !errors.Is(srvErr, ErrUnauthenticated) {
		t.Fatalf("impostor not refused: client %v, server %v", clErr, srvErr)
	}
	if cl.stage == curveOpen {
		t.Fatal("client opened a session with an impostor")
	}
}

// Arbitrary bytes after a client's greeting never open a server session,
// never panic, and fail with an error value.
func FuzzCurveServerHandshake(f *testing.F) {
	p := newSessionPair(f, both, both)
	hello := p.cl.greeting()
	p.cl.feed(p.srv.greeting(), func(b []byte) { hello = append(hello, b...) }, nil)
	f.Add(hello[zmtpGreetingSize:])
	f.Add([]byte{4, 5, 5, 'E', 'R', 'R', 'O', 'R'})
	f.Add(command("INITIATE", make([]byte, 300))[:])
	id, allowed := authtest.NewIdentity(f), authtest.NewIdentity(f)
	a := authtest.Authority(f, id, allowed.Public)
	f.Fuzz(func(t *testing.T, data []byte) {
		s, err := newCurveSession(a, true)
		if err != nil {
			t.Fatal(err)
		}
		in := append(curveGreeting(false, auth.Key{}), data...)
		_ = s.feed(in, func([]byte) {}, func([]byte) error {
			t.Fatal("a plain frame came out of an unauthenticated session")
			return nil
		})
		if s.stage == curveOpen {
			t.Fatal("arbitrary bytes opened a session")
		}
	})
}

// Arbitrary answers to a client's HELLO never open its session.
func FuzzCurveClientHandshake(f *testing.F) {
	f.Add(command("WELCOME", make([]byte, 160)))
	f.Add(command("READY", make([]byte, 30)))
	f.Add(errorCommand("no"))
	srv, client := authtest.NewIdentity(f), authtest.NewIdentity(f)
	a := authtest.Authority(f, client, srv.Public)
	f.Fuzz(func(t *testing.T, data []byte) {
		s, err := newCurveSession(a, false)
		if err != nil {
			t.Fatal(err)
		}
		in := append(curveGreeting(true, srv.Public), data...)
		_ = s.feed(in, func([]byte) {}, func([]byte) error {
			t.Fatal("a plain frame came out of an unauthenticated session")
			return nil
		})
		if s.stage == curveOpen {
			t.Fatal("arbitrary bytes opened a session")
		}
	})
}

// Arbitrary frames on an open session never open as plain frames (only the
// peer's transient key seals them) and never panic.
func FuzzCurveMessages(f *testing.F) {
	p := newSessionPair(f, both, both)
	p.pump()
	f.Add(p.cl.seal(encodeMessage([][]byte{[]byte("x")})))
	f.Add([]byte{0, 33, 7, 'M', 'E', 'S', 'S', 'A', 'G', 'E'})
	f.Fuzz(func(t *testing.T, data []byte) {
		s := *p.srv // a fresh copy of the open session for each input
		s.out = outerFramer{limit: p.srv.out.limit}
		_ = s.feed(data, func([]byte) {}, func([]byte) error {
			t.Fatal("bytes not sealed by the peer opened")
			return nil
		})
	})
}
