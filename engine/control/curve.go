package control

// CurveZMQ (ZeroMQ RFC 26) on the plane's own ZMTP parser. With an
// Authority, every connection runs the CURVE handshake before any message:
// the client proves it holds the secret key of the public key it names, the
// server proves the same, and the server lets the client in only when that
// key is on its allowlist (what a ZAP handler does for libzmq sockets). After
// the handshake every ZMTP frame travels as a MESSAGE command boxed with the
// connection's transient keys, so a frame cannot be read, changed, replayed
// or moved to another connection.
//
// A session sits between the socket and the connection's zmtpReader: it
// parses the outer frames itself, runs the handshake, and feeds the reader
// the plain frames it opens, preceded by a NULL greeting and a READY built
// from the peer's authenticated metadata. The reader's limits and the
// plane's buffer budget therefore apply to the plain frames as they do
// without CURVE.
//
// A CURVE client must know the server's public key before it says HELLO.
// Our greeting's 31 filler bytes carry the first 31 bytes of the server's
// key, and the client takes the one key of its allowlist that starts with
// them; a server that does not hold that key's secret cannot open HELLO nor
// write a WELCOME the client opens.

import (
	"bytes"
	"crypto/rand"
	"crypto/subtle"
	"encoding/binary"
	"fmt"

	"golang.org/x/crypto/nacl/box"
	"golang.org/x/crypto/nacl/secretbox"

	"github.com/kvferry/kvferry/engine/auth"
)

// ErrUnauthenticated: a peer did not prove an identity our allowlist
// accepts, or would not accept ours; nothing was exchanged with it.
var ErrUnauthenticated = auth.ErrUnauthenticated

// Sizes of the CURVE commands (RFC 26), with their name.
const (
	curveHelloSize    = 1 + 5 + 2 + 72 + 32 + 8 + 80 // 200
	curveWelcomeSize  = 1 + 7 + 16 + 144             // 168
	curveCookieSize   = 16 + 80
	curveInitiateMin  = 1 + 8 + curveCookieSize + 8 + 16 + 32 + 96
	curveReadyMin     = 1 + 5 + 8 + 16
	curveMessageMin   = 8 + 8 + 16 + 1
	curveErrorMax     = 1 + 5 + 1 + 255
	curveBoxOverhead  = box.Overhead
	curveMessageExtra = 8 + 8 + curveBoxOverhead + 1 // what boxing adds to a frame
	curveMetadataMax  = maxCommandSize - curveInitiateMin
)

// Flags inside a MESSAGE box.
const (
	curveMore    = 0x01
	curveCommand = 0x02
)

// curveGreeting returns our CURVE greeting. A server's filler holds the
// first 31 bytes of its public key.
func curveGreeting(server bool, pub auth.Key) []byte {
	g := make([]byte, zmtpGreetingSize)
	g[0], g[9] = 0xff, 0x7f
	g[10], g[11] = 3, 0
	copy(g[12:32], "CURVE")
	if server {
		g[32] = 1
		copy(g[33:], pub[:31])
	}
	return g
}

type curveStage uint8

const (
	curveGreet    curveStage = iota // waiting for the peer's greeting
	curveHello                      // server: waiting for HELLO
	curveWelcome                    // client: waiting for WELCOME
	curveInitiate                   // server: waiting for INITIATE
	curveReady                      // client: waiting for READY
	curveOpen                       // handshake done: MESSAGE only
)

// curveSession is one connection's CURVE state.
type curveSession struct {
	a      *auth.Authority
	server bool
	stage  curveStage

	tpub, tsec [32]byte // our transient key pair
	peerT      [32]byte // the peer's transient public key
	peerKey    auth.Key // the peer's permanent key: the server's (client side) or the client's once INITIATE proved it
	shared     [32]byte // precomputed box key of the two transient keys
	sendN      uint64   // our last short nonce
	recvN      uint64   // the peer's last short nonce
	cookieKey  [32]byte // server: key of the cookie it sent
	cookie     [curveCookieSize]byte

	// Metadata the peer sent (INITIATE or READY), authenticated.
	socketType, identity string

	// ready: the plain greeting and READY to feed the reader (set once
	// the handshake is done, taken by the plane); send: commands to write.
	ready []byte

	out outerFramer
}

// curveRefusal is a handshake that failed: the peer is not let in (server)
// or not trusted (client). reason, when set, goes to the peer in ERROR: only
// for a peer that proved its key and is not allowed, a misconfiguration its
// operator wants to see; anything else is closed without a word.
type curveRefusal struct {
	reason string
	err    error
}

func (r *curveRefusal) Error() string { return fmt.Sprintf("%s: %v", r.reason, r.err) }
func (r *curveRefusal) Unwrap() error { return r.err }

func refuse(reason string, format string, args ...any) error {
	return &curveRefusal{reason: reason, err: fmt.Errorf("%w: "+format, append([]any{ErrUnauthenticated}, args...)...)}
}

func newCurveSession(a *auth.Authority, server bool) (*curveSession, error) {
	pub, sec, err := box.GenerateKey(rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("control: transient key: %w", err)
	}
	s := &curveSession{a: a, server: server, tpub: *pub, tsec: *sec}
	s.out.limit = maxCommandSize
	return s, nil
}

// greeting is what the session sends when the connection comes up.
func (s *curveSession) greeting() []byte { return curveGreeting(s.server, s.a.Public()) }

// feed parses the outer bytes of the connection. Handshake replies go out
// through send; plain frames, once the handshake is done, go to plain. A
// *curveRefusal error is an authentication failure, any other error a
// protocol error; either ends the connection.
func (s *curveSession) feed(data []byte, send func([]byte), plain func([]byte) error) error {
	return s.out.feed(data,
		func(g []byte) error { return s.takeGreeting(g, send) },
		func(flags byte, frame []byte) error {
			if s.stage == curveOpen {
				return s.openMessage(flags, frame, plain)
			}
			if flags&zmtpCommand == 0 {
				return fmt.Errorf("%w: message before the CURVE handshake ended", errProtocol)
			}
			return s.takeCommand(frame, send)
		})
}

func (s *curveSession) takeGreeting(g []byte, send func([]byte)) error {
	if g[0] != 0xff || g[9]&1 != 1 || g[10] < 3 {
		return fmt.Errorf("%w: not a ZMTP 3 greeting", errProtocol)
	}
	mech := trimZero(g[12:32])
	if mech != "CURVE" {
		return refuse("", "peer speaks %q, not CURVE", mech)
	}
	asServer := g[32] == 1
	if asServer == s.server {
		return fmt.Errorf("%w: both ends of the connection claim the same CURVE role", errProtocol)
	}
	if s.server {
		s.stage = curveHello
		return nil
	}
	k, ok := s.a.FindByPrefix(g[33:64])
	if !ok {
		return refuse("", "the server's key is not on our allowlist")
	}
	s.peerKey = k
	s.stage = curveWelcome
	send(s.hello())
	return nil
}

func nonce(prefix string, short []byte) *[24]byte {
	var n [24]byte
	copy(n[:], prefix)
	copy(n[len(prefix):], short)
	return &n
}

func (s *curveSession) nextShort() []byte {
	s.sendN++
	return binary.BigEndian.AppendUint64(nil, s.sendN)
}

func longNonce() []byte {
	n := make([]byte, 16)
	_, _ = rand.Read(n)
	return n
}

func command(name string, body ...[]byte) []byte {
	c := append([]byte{byte(len(name))}, name...)
	for _, b := range body {
		c = append(c, b...)
	}
	return appendFrame(nil, c, zmtpCommand)
}

func (s *curveSession) hello() []byte {
	short := s.nextShort()
	sig := box.Seal(nil, make([]byte, 64), nonce("CurveZMQHELLO---", short), (*[32]byte)(&s.peerKey), &s.tsec)
	return command("HELLO", []byte{1, 0}, make([]byte, 72), s.tpub[:], short, sig)
}

// takeCommand runs one handshake step.
func (s *curveSession) takeCommand(cmd []byte, send func([]byte)) error {
	if len(cmd) < 1 || int(cmd[0]) > len(cmd)-1 {
		return fmt.Errorf("%w: bad command frame", errProtocol)
	}
	name := string(cmd[1 : 1+int(cmd[0])])
	if name == "ERROR" && !s.server {
		reason := ""
		if len(cmd) >= 7 && int(cmd[6]) <= len(cmd)-7 {
			reason = string(cmd[7 : 7+int(cmd[6])])
		}
		return refuse("", "the server refused us: %q", reason)
	}
	switch {
	case s.server && s.stage == curveHello && name == "HELLO":
		return s.takeHello(cmd, send)
	case !s.server && s.stage == curveWelcome && name == "WELCOME":
		return s.takeWelcome(cmd, send)
	case s.server && s.stage == curveInitiate && name == "INITIATE":
		return s.takeInitiate(cmd, send)
	case !s.server && s.stage == curveReady && name == "READY":
		return s.takeReady(cmd)
	}
	return refuse("", "CURVE command %q out of order", name)
}

func (s *curveSession) takeHello(cmd []byte, send func([]byte)) error {
	if len(cmd) != curveHelloSize || cmd[6] != 1 {
		return refuse("", "HELLO of %d bytes or version %d", len(cmd), cmd[min(6, len(cmd)-1)])
	}
	copy(s.peerT[:], cmd[80:112])
	short := cmd[112:120]
	self := s.a.Identity()
	sig, ok := box.Open(nil, cmd[120:200], nonce("CurveZMQHELLO---", short), &s.peerT, (*[32]byte)(&self.Secret))
	if !ok || !allZero(sig) {
		return refuse("", "HELLO's signature box does not open with our key")
	}
	s.recvN = binary.BigEndian.Uint64(short)
	if _, err := rand.Read(s.cookieKey[:]); err != nil {
		return fmt.Errorf("control: cookie key: %w", err)
	}
	cn := longNonce()
	copy(s.cookie[:16], cn)
	secretbox.Seal(s.cookie[:16], append(append([]byte(nil), s.peerT[:]...), s.tsec[:]...), nonce("COOKIE--", cn), &s.cookieKey)
	wn := longNonce()
	w := box.Seal(nil, append(append([]byte(nil), s.tpub[:]...), s.cookie[:]...), nonce("WELCOME-", wn), &s.peerT, (*[32]byte)(&self.Secret))
	box.Precompute(&s.shared, &s.peerT, &s.tsec)
	s.stage = curveInitiate
	send(command("WELCOME", wn, w))
	return nil
}

func (s *curveSession) takeWelcome(cmd []byte, send func([]byte)) error {
	if len(cmd) != curveWelcomeSize {
		return refuse("", "WELCOME of %d bytes", len(cmd))
	}
	body, ok := box.Open(nil, cmd[24:], nonce("WELCOME-", cmd[8:24]), (*[32]byte)(&s.peerKey), &s.tsec)
	if !ok {
		return refuse("", "WELCOME does not open with the server's key: it does not hold the key it announced")
	}
	var serverT [32]byte
	copy(serverT[:], body[:32])
	box.Precompute(&s.shared, &serverT, &s.tsec)
	self := s.a.Identity()
	vn := longNonce()
	vouch := box.Seal(append([]byte(nil), vn...), append(append([]byte(nil), s.tpub[:]...), s.peerKey[:]...),
		nonce("VOUCH---", vn), &serverT, (*[32]byte)(&self.Secret))
	plain := append(append([]byte(nil), self.Public[:]...), vouch...)
	plain = appendProps(plain, "DEALER", s.identity)
	short := s.nextShort()
	sealed := box.SealAfterPrecomputation(nil, plain, nonce("CurveZMQINITIATE", short), &s.shared)
	s.stage = curveReady
	send(command("INITIATE", body[32:32+curveCookieSize], short, sealed))
	return nil
}

func (s *curveSession) takeInitiate(cmd []byte, send func([]byte)) error {
	if len(cmd) < curveInitiateMin {
		return refuse("", "INITIATE of %d bytes", len(cmd))
	}
	if subtle.ConstantTimeCompare(cmd[9:9+curveCookieSize], s.cookie[:]) != 1 {
		return refuse("", "INITIATE carries a cookie this connection did not issue")
	}
	short := cmd[9+curveCookieSize : 17+curveCookieSize]
	if n := binary.BigEndian.Uint64(short); n <= s.recvN {
		return refuse("", "INITIATE nonce replayed")
	} else {
		s.recvN = n
	}
	plain, ok := box.OpenAfterPrecomputation(nil, cmd[17+curveCookieSize:], nonce("CurveZMQINITIATE", short), &s.shared)
	if !ok || len(plain) < 32+96 {
		return refuse("", "INITIATE does not open with the connection's keys")
	}
	var client auth.Key
	copy(client[:], plain[:32])
	v, ok := box.Open(nil, plain[48:128], nonce("VOUCH---", plain[32:48]), (*[32]byte)(&client), &s.tsec)
	self := s.a.Public()
	if !ok || !bytes.Equal(v[:32], s.peerT[:]) || !bytes.Equal(v[32:], self[:]) {
		return refuse("", "the vouch does not prove the client's key")
	}
	if !s.a.Allowed(client) {
		return refuse("key not allowed", "client key %s is not on the allowlist", client)
	}
	st, id, err := parseProps(plain[128:])
	if err != nil {
		return refuse("", "INITIATE metadata: %v", err)
	}
	s.peerKey, s.socketType, s.identity = client, st, id
	short = s.nextShort()
	ready := box.SealAfterPrecomputation(nil, appendProps(nil, "ROUTER", ""), nonce("CurveZMQREADY---", short), &s.shared)
	send(command("READY", short, ready))
	s.open()
	return nil
}

func (s *curveSession) takeReady(cmd []byte) error {
	if len(cmd) < curveReadyMin {
		return refuse("", "READY of %d bytes", len(cmd))
	}
	short := cmd[6:14]
	n := binary.BigEndian.Uint64(short)
	plain, ok := box.OpenAfterPrecomputation(nil, cmd[14:], nonce("CurveZMQREADY---", short), &s.shared)
	if !ok {
		return refuse("", "READY does not open with the connection's keys")
	}
	st, id, err := parseProps(plain)
	if err != nil {
		return fmt.Errorf("%w: READY metadata: %v", errProtocol, err)
	}
	// Checked again as the connection opens: Revoke (which runs on the
	// loop, as this does) cuts only open connections, so a server whose
	// key left the allowlist since our greeting is refused here.
	if !s.a.Allowed(s.peerKey) {
		return refuse("", "the server's key %s left our allowlist during the handshake", s.peerKey)
	}
	s.recvN, s.socketType, s.identity = n, st, id
	s.open()
	return nil
}

// open ends the handshake: from now on frames are MESSAGE boxes, and the
// reader is handed the peer's authenticated metadata as a NULL READY.
func (s *curveSession) open() {
	s.stage = curveOpen
	s.ready = append(zmtpGreeting(), zmtpReady(s.socketType, s.identity)...)
	// A MESSAGE boxes one frame of at most the reader's limit; the reader
	// checks the plain frame again.
	s.out.limit = MaxBody + EnvelopeSize + curveMessageExtra
}

// openMessage opens one MESSAGE and hands its plain frame to plain.
func (s *curveSession) openMessage(_ byte, m []byte, plain func([]byte) error) error {
	if len(m) < curveMessageMin || string(m[:8]) != "\x07MESSAGE" {
		return fmt.Errorf("%w: a CURVE connection sent a frame that is not a MESSAGE", errProtocol)
	}
	short := m[8:16]
	n := binary.BigEndian.Uint64(short)
	if n <= s.recvN {
		return fmt.Errorf("%w: MESSAGE nonce %d not above %d (replayed or reordered)", errProtocol, n, s.recvN)
	}
	prefix := "CurveZMQMESSAGES"
	if s.server {
		prefix = "CurveZMQMESSAGEC"
	}
	p, ok := box.OpenAfterPrecomputation(nil, m[16:], nonce(prefix, short), &s.shared)
	if !ok || len(p) < 1 {
		return fmt.Errorf("%w: MESSAGE does not open with the connection's keys", errProtocol)
	}
	s.recvN = n
	var flags byte
	if p[0]&curveMore != 0 {
		flags |= zmtpMore
	}
	if p[0]&curveCommand != 0 {
		flags |= zmtpCommand
	}
	return plain(appendFrame(nil, p[1:], flags))
}

// seal boxes each frame of plain (ZMTP frames we encoded) as a MESSAGE.
func (s *curveSession) seal(plain []byte) []byte {
	prefix := "CurveZMQMESSAGEC"
	if s.server {
		prefix = "CurveZMQMESSAGES"
	}
	out := make([]byte, 0, len(plain)+64)
	for len(plain) > 0 {
		flags := plain[0]
		var size uint64
		if flags&zmtpLong != 0 {
			size, plain = binary.BigEndian.Uint64(plain[1:9]), plain[9:]
		} else {
			size, plain = uint64(plain[1]), plain[2:]
		}
		data := plain[:size]
		plain = plain[size:]
		var inner byte
		if flags&zmtpMore != 0 {
			inner |= curveMore
		}
		if flags&zmtpCommand != 0 {
			inner |= curveCommand
		}
		short := s.nextShort()
		msg := make([]byte, 0, 16+box.Overhead+1+len(data))
		msg = append(msg, "\x07MESSAGE"...)
		msg = append(msg, short...)
		pt := make([]byte, 0, 1+len(data))
		pt = append(append(pt, inner), data...)
		msg = box.SealAfterPrecomputation(msg, pt, nonce(prefix, short), &s.shared)
		out = appendFrame(out, msg, 0)
	}
	return out
}

// errorCommand is the ERROR a server sends a peer it refuses.
func errorCommand(reason string) []byte {
	if len(reason) > 255 {
		reason = reason[:255]
	}
	return command("ERROR", []byte{byte(len(reason))}, []byte(reason))
}

// outerFramer splits a CURVE connection's bytes into its greeting and whole
// frames. It holds at most one frame, of at most limit bytes; frames above
// smallFrame are reserved from the plane's budget first.
type outerFramer struct {
	limit   uint64
	reserve func(uint64) bool
	release func(uint64)

	greeting [zmtpGreetingSize]byte
	gN       int
	hdr      [9]byte
	hdrN     int
	flags    byte
	size     uint64
	buf      []byte
	inFrame  bool
	held     uint64
}

// partial reports whether a frame or the greeting is partly read.
func (f *outerFramer) partial() bool {
	return (f.gN > 0 && f.gN < zmtpGreetingSize) || f.hdrN > 0 || f.inFrame
}

func (f *outerFramer) drop() {
	if f.held > 0 && f.release != nil {
		f.release(f.held)
	}
	f.held, f.buf = 0, nil
}

func (f *outerFramer) feed(data []byte, greeting func([]byte) error, frame func(flags byte, b []byte) error) error {
	for len(data) > 0 {
		if f.gN < zmtpGreetingSize {
			n := copy(f.greeting[f.gN:], data)
			f.gN += n
			data = data[n:]
			if f.gN == zmtpGreetingSize {
				if err := greeting(f.greeting[:]); err != nil {
					return err
				}
			}
			continue
		}
		if !f.inFrame {
			need := 2
			if f.hdrN > 0 && f.hdr[0]&zmtpLong != 0 {
				need = 9
			}
			n := copy(f.hdr[f.hdrN:need], data)
			f.hdrN += n
			data = data[n:]
			if f.hdrN < need || (need == 2 && f.hdr[0]&zmtpLong != 0) {
				continue
			}
			f.flags = f.hdr[0]
			if f.flags&^(zmtpLong|zmtpCommand|zmtpMore) != 0 {
				return fmt.Errorf("%w: CURVE frame flags %#x", errProtocol, f.flags)
			}
			if f.flags&zmtpLong != 0 {
				f.size = binary.BigEndian.Uint64(f.hdr[1:9])
			} else {
				f.size = uint64(f.hdr[1])
			}
			f.hdrN = 0
			if f.size > f.limit {
				return fmt.Errorf("%w: CURVE frame of %d bytes (at most %d)", errProtocol, f.size, f.limit)
			}
			if f.size > smallFrame && f.reserve != nil {
				if !f.reserve(f.size) {
					return fmt.Errorf("%w: %d bytes past the control plane's buffer budget", ErrOverBudget, f.size)
				}
				f.held = f.size
			}
			f.buf = make([]byte, 0, f.size)
			f.inFrame = true
		} else {
			n := uint64(len(data))
			if left := f.size - uint64(len(f.buf)); n > left {
				n = left
			}
			f.buf = append(f.buf, data[:n]...)
			data = data[n:]
		}
		if uint64(len(f.buf)) < f.size {
			continue
		}
		b := f.buf
		f.buf, f.inFrame = nil, false
		err := frame(f.flags, b)
		if f.held > 0 && f.release != nil {
			f.release(f.held)
		}
		f.held = 0
		if err != nil {
			return err
		}
	}
	return nil
}
