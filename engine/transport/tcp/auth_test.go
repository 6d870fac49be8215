package tcp_test

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/auth"
	"github.com/kvferry/kvferry/engine/auth/authtest"
	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/engine/transport/tcp"
	"github.com/kvferry/kvferry/engine/transport/transporttest"
)

// TestConformanceWithAuthentication runs the transport suite with both ends
// authenticating: authentication changes nothing a transfer sees.
func TestConformanceWithAuthentication(t *testing.T) {
	o, i := authtest.NewIdentity(t), authtest.NewIdentity(t)
	oa, _ := authtest.New(t, o, i.Public)
	ia, _ := authtest.New(t, i, o.Public)
	transporttest.Run(t, conformancePair(tcp.Options{Auth: oa}, tcp.Options{Auth: ia}))
}

// guarded is owner memory with a known pattern and its registration.
type guarded struct {
	mem []byte
	reg *memory.Region
}

func newGuarded(t *testing.T, reg *memory.Registry) *guarded {
	t.Helper()
	g := &guarded{mem: bytes.Repeat([]byte{0x5a}, 4096)}
	regs, err := reg.Register([]memory.Range{{Mem: g.mem}})
	if err != nil {
		t.Fatal(err)
	}
	g.reg = regs[0]
	return g
}

func (g *guarded) untouched(t *testing.T, what string) {
	t.Helper()
	if !bytes.Equal(g.mem, bytes.Repeat([]byte{0x5a}, len(g.mem))) {
		t.Fatalf("%s: owner memory changed", what)
	}
}

// writeOne posts one WRITE of data to g's first bytes on ep and returns its
// outcome.
func writeOne(t *testing.T, ep transport.Endpoint, g *guarded, data []byte) error {
	t.Helper()
	regs, err := memory.NewRegistry().Register([]memory.Range{{Mem: data}})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	ep.Post([]*transport.Slice{{Op: transport.Write, Local: data, LocalReg: regs[0], Key: g.reg.Key, Remote: g.reg.Addr,
		Done: func(_ *transport.Slice, err error) { done <- err }}})
	select {
	case err := <-done:
		return err
	case <-time.After(10 * time.Second):
		t.Fatal("slice never ended")
	}
	return nil
}

// Every way of not proving an allowed key is refused before a byte moves,
// and the owner counts it; both ends with allowed keys write.
func TestDataConnectionsWithoutAnAllowedKeyAreRefused(t *testing.T) {
	o, i, stranger := authtest.NewIdentity(t), authtest.NewIdentity(t), authtest.NewIdentity(t)
	oa, _ := authtest.New(t, o, i.Public)
	reg := memory.NewRegistry()
	owner, addr := ownerWith(t, tcp.Options{Auth: oa}, transporttest.NewOwner(reg))
	g := newGuarded(t, reg)

	openOwner, openAddr := ownerWith(t, tcp.Options{}, nil)
	_ = openOwner

	ia, _ := authtest.New(t, i, o.Public)
	sa, _ := authtest.New(t, stranger, o.Public)
	blind, _ := authtest.New(t, i) // i's key, but o's key is not on its list
	for _, tc := range []struct {
		name string
		auth *auth.Authority
		addr string
		err  error
	}{
		{"no authentication", nil, addr, tcp.ErrUnauthenticated},
		{"a key the owner does not allow", sa, addr, tcp.ErrUnauthenticated},
		{"an owner whose key the initiator does not allow", blind, addr, tcp.ErrUnauthenticated},
		{"an owner that does not authenticate", ia, openAddr, tcp.ErrUnauthenticated},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr := tcp.New(tcp.Options{Auth: tc.auth})
			t.Cleanup(func() { _ = tr.Close() })
			_, err := tr.Dial(context.Background(), tc.addr, "me:1")
			if !errors.Is(err, tc.err) {
				t.Fatalf("Dial = %v, want %v", err, tc.err)
			}
			g.untouched(t, tc.name)
		})
	}
	if n := owner.Stats().AuthRefused; n < 2 {
		t.Fatalf("owner counted %d refusals, want at least 2", n)
	}

	tr := tcp.New(tcp.Options{Auth: ia})
	t.Cleanup(func() { _ = tr.Close() })
	ep, err := tr.Dial(context.Background(), addr, "me:1")
	if err != nil {
		t.Fatalf("an allowed initiator: %v", err)
	}
	if err := writeOne(t, ep, g, []byte("allowed")); err != nil {
		t.Fatalf("an allowed initiator's WRITE: %v", err)
	}
	if string(g.mem[:7]) != "allowed" {
		t.Fatal("the allowed WRITE did not land")
	}
}

// A raw attacker that pipelines a WRITE right behind a HELLO, as if the
// owner did not authenticate, writes nothing.
func TestAWriteBehindAnUnauthenticatedHelloNeverLands(t *testing.T) {
	o := authtest.NewIdentity(t)
	oa, _ := authtest.New(t, o)
	reg := memory.NewRegistry()
	owner, addr := ownerWith(t, tcp.Options{Auth: oa}, transporttest.NewOwner(reg))
	g := newGuarded(t, reg)
	c := dialFrom(t, addr, "")
	payload := bytes.Repeat([]byte{0xee}, 64)
	msg := append(helloFrame("attacker:1"), rawFrame(3, 1, uint32(len(payload)), g.reg.Key, g.reg.Addr)...)
	if _, err := c.Write(append(msg, payload...)); err != nil {
		t.Fatal(err)
	}
	requireClosed(t, c, 5*time.Second, "an unauthenticated HELLO")
	g.untouched(t, "a WRITE behind an unauthenticated HELLO")
	if owner.Stats().AuthRefused != 1 {
		t.Fatalf("AuthRefused = %d, want 1", owner.Stats().AuthRefused)
	}
}

// legitHandshake runs, as the holder of a's secret key, the initiator's
// side of the handshake on a raw connection to the owner at addr (a second
// implementation of the wire auth.go describes, as an eavesdropper would
// see it), requires the owner's HELLO_ACK, and returns the bytes it sent:
// a valid handshake, recorded.
func legitHandshake(t *testing.T, a *auth.Authority, addr, name string) []byte {
	t.Helper()
	c := dialFrom(t, addr, "")
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	pi := a.Public()
	ni := make([]byte, 32)
	_, _ = rand.Read(ni)
	payload := append(append([]byte(nil), pi[:]...), ni...)
	payload = binary.LittleEndian.AppendUint16(payload, uint16(len(addr)))
	payload = append(append(payload, addr...), name...)
	hello := append(helloAuthFrame(len(payload)), payload...)
	if _, err := c.Write(hello); err != nil {
		t.Fatal(err)
	}
	ch := make([]byte, tcp.HeaderSize+96)
	if _, err := io.ReadFull(c, ch); err != nil || ch[3] != 9 {
		t.Fatalf("no CHALLENGE: %v (type %d)", err, ch[3])
	}
	var po auth.Key
	copy(po[:], ch[tcp.HeaderSize:])
	no := ch[tcp.HeaderSize+32 : tcp.HeaderSize+64]
	k, err := a.DataKey(po, "tcp")
	if err != nil {
		t.Fatal(err)
	}
	m := hmac.New(sha256.New, k[:])
	for _, part := range [][]byte{[]byte("kvferry tcp initiator v1"), ni, no, pi[:], po[:],
		binary.LittleEndian.AppendUint32(nil, uint32(len(addr))), []byte(addr),
		binary.LittleEndian.AppendUint32(nil, uint32(len(name))), []byte(name)} {
		m.Write(part)
	}
	authFrame := append(rawFrame(10, 0, 32, 0, 0), m.Sum(nil)...)
	if _, err := c.Write(authFrame); err != nil {
		t.Fatal(err)
	}
	ack := make([]byte, tcp.HeaderSize)
	if _, err := io.ReadFull(c, ack); err != nil || ack[3] != 2 || binary.LittleEndian.Uint32(ack[4:]) != 0 {
		t.Fatalf("the legitimate handshake was not accepted: %v, %x", err, ack[:8])
	}
	return append(hello, authFrame...)
}

// A handshake recorded from a real, allowed initiator and replayed on a new
// connection is refused: the owner's nonce is new, so the recorded AUTH no
// longer proves anything.
func TestAReplayedHandshakeIsRefused(t *testing.T) {
	o, i := authtest.NewIdentity(t), authtest.NewIdentity(t)
	oa, _ := authtest.New(t, o, i.Public)
	ia, _ := authtest.New(t, i, o.Public)
	reg := memory.NewRegistry()
	owner, addr := ownerWith(t, tcp.Options{Auth: oa}, transporttest.NewOwner(reg))
	g := newGuarded(t, reg)

	handshake := legitHandshake(t, ia, addr, "victim:1")
	refused := owner.Stats().AuthRefused
	c := dialFrom(t, addr, "")
	payload := bytes.Repeat([]byte{0xee}, 64)
	msg := append(handshake, rawFrame(3, 1, uint32(len(payload)), g.reg.Key, g.reg.Addr)...)
	if _, err := c.Write(append(msg, payload...)); err != nil {
		t.Fatal(err)
	}
	requireClosed(t, c, 5*time.Second, "a replayed handshake")
	g.untouched(t, "a replayed handshake")
	if owner.Stats().AuthRefused != refused+1 {
		t.Fatalf("AuthRefused = %d, want %d", owner.Stats().AuthRefused, refused+1)
	}
}

// After the allowlist drops an initiator's key, CutUnallowed closes its
// connections and waits for their serving to end: its next WRITE fails and
// lands nothing, and it cannot connect again; another initiator goes on.
func TestCutUnallowedEndsARemovedInitiatorsConnections(t *testing.T) {
	o, a, b := authtest.NewIdentity(t), authtest.NewIdentity(t), authtest.NewIdentity(t)
	oa, allowFile := authtest.New(t, o, a.Public, b.Public)
	reg := memory.NewRegistry()
	owner, addr := ownerWith(t, tcp.Options{Auth: oa}, transporttest.NewOwner(reg))
	g := newGuarded(t, reg)
	dial := func(id auth.Identity, name string) (*tcp.Transport, transport.Endpoint) {
		ia, _ := authtest.New(t, id, o.Public)
		tr := tcp.New(tcp.Options{Auth: ia})
		t.Cleanup(func() { _ = tr.Close() })
		ep, err := tr.Dial(context.Background(), addr, name)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		return tr, ep
	}
	ta, epA := dial(a, "a:1")
	_, epB := dial(b, "b:1")
	if err := writeOne(t, epA, g, []byte("a-before")); err != nil {
		t.Fatal(err)
	}
	authtest.WriteAllowlist(t, allowFile, b.Public)
	if _, err := oa.Reload(); err != nil {
		t.Fatal(err)
	}
	names, err := owner.CutUnallowed(context.Background())
	if err != nil || len(names) != 1 || names[0] != "a:1" {
		t.Fatalf("CutUnallowed = %v, %v; want [a:1]", names, err)
	}
	copy(g.mem, bytes.Repeat([]byte{0x5a}, 8))
	if err := writeOne(t, epA, g, []byte("a-after!")); err == nil {
		t.Fatal("the removed initiator's WRITE completed")
	}
	g.untouched(t, "the removed initiator's WRITE")
	if _, err := ta.Dial(context.Background(), addr, "a:1"); !errors.Is(err, tcp.ErrUnauthenticated) {
		t.Fatalf("the removed initiator dialled again: %v", err)
	}
	if err := writeOne(t, epB, g, []byte("b-still")); err != nil {
		t.Fatalf("the initiator still allowed: %v", err)
	}
}

// helloAuthFrame is an authenticating HELLO's header for a payload of n
// bytes (done = helloGoAway | helloAuth).
func helloAuthFrame(n int) []byte {
	h := rawFrame(1, 0, uint32(n), 0, 0)
	h[56] = 3
	return h
}

// FuzzHandshakeOwner sends arbitrary bytes as an initiator's side of the
// handshake to an owner with authentication: it never answers HELLO_ACK
// with success, never lets a byte into its memory, and never hangs (the
// connection ends once the input does).
func FuzzHandshakeOwner(f *testing.F) {
	o, i := authtest.NewIdentity(f), authtest.NewIdentity(f)
	oa, _ := authtest.New(f, o, i.Public)
	reg := memory.NewRegistry()
	tr := tcp.New(tcp.Options{Auth: oa, HandshakeTimeout: 2 * time.Second})
	addr, err := tr.Listen(transporttest.NewOwner(reg))
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { _ = tr.Close() })
	mem := bytes.Repeat([]byte{0x5a}, 4096)
	regs, err := reg.Register([]memory.Range{{Mem: mem}})
	if err != nil {
		f.Fatal(err)
	}
	payload := append(append([]byte(nil), i.Public[:]...), make([]byte, 32)...)
	payload = binary.LittleEndian.AppendUint16(payload, uint16(len(addr)))
	payload = append(append(payload, addr...), "x:1"...)
	valid := append(helloAuthFrame(len(payload)), payload...)
	auth := append(rawFrame(10, 0, 32, 0, 0), make([]byte, 32)...)
	write := append(rawFrame(3, 1, 16, regs[0].Key, regs[0].Addr), bytes.Repeat([]byte{0xee}, 16)...)
	f.Add(append(append(append([]byte(nil), valid...), auth...), write...))
	f.Add(append(helloFrame("x:1"), write...))
	f.Add(valid[:70])
	f.Fuzz(func(t *testing.T, data []byte) {
		nc, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer nc.Close()
		c := nc.(*net.TCPConn)
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := c.Write(data); err != nil {
			return // the owner already closed: it refused
		}
		_ = c.CloseWrite()
		answers, err := io.ReadAll(c)
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			t.Fatal("the owner neither answered nor closed")
		}
		for len(answers) >= tcp.HeaderSize {
			typ, status := answers[3], uint32(answers[4])|uint32(answers[5])<<8
			if typ == 2 && status == 0 {
				t.Fatal("the owner said HELLO_ACK to an initiator that proved nothing")
			}
			n := tcp.HeaderSize
			if typ == 9 {
				n += 96
			}
			answers = answers[min(n, len(answers)):]
		}
		if !bytes.Equal(mem, bytes.Repeat([]byte{0x5a}, len(mem))) {
			t.Fatal("owner memory changed")
		}
	})
}

// FuzzHandshakeInitiator answers an authenticating initiator's HELLO with
// arbitrary bytes: its Dial always fails (only the owner's secret key makes
// a CHALLENGE it accepts), and never hangs past its deadline.
func FuzzHandshakeInitiator(f *testing.F) {
	o, i := authtest.NewIdentity(f), authtest.NewIdentity(f)
	ia, _ := authtest.New(f, i, o.Public)
	tr := tcp.New(tcp.Options{Auth: ia, HandshakeTimeout: 2 * time.Second})
	f.Cleanup(func() { _ = tr.Close() })
	ch := append(rawFrame(9, 0, 96, 0, 0), append(append([]byte(nil), o.Public[:]...), make([]byte, 64)...)...)
	f.Add(append(ch, rawFrame(2, 0, 0, 0, 0)...))
	f.Add(rawFrame(2, 0, 0, 0, 0))
	f.Add(ch[:100])
	f.Fuzz(func(t *testing.T, data []byte) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		go func() {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(5 * time.Second))
			hdr := make([]byte, tcp.HeaderSize)
			if _, err := io.ReadFull(c, hdr); err != nil {
				return
			}
			n := int(hdr[28]) | int(hdr[29])<<8
			_, _ = io.ReadFull(c, make([]byte, n))
			_, _ = c.Write(data)
		}()
		ep, err := tr.Dial(context.Background(), ln.Addr().String(), "me:1")
		if err == nil {
			_ = ep.Close()
			t.Fatal("Dial succeeded against an owner that proved nothing")
		}
	})
}
