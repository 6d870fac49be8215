package tcp

// Authentication of data connections. With Options.Auth, both ends prove on
// each new connection that they hold the secret key of a public key the
// other's allowlist holds, before a byte of memory moves:
//
//	initiator -> owner  HELLO      done |= helloAuth; payload Pi | Ni | len(A) | A | name
//	owner -> initiator  CHALLENGE  payload Po | No | MACo
//	initiator -> owner  AUTH       payload MACi
//	owner -> initiator  HELLO_ACK
//
// P are the static public keys, N fresh random nonces, A the address the
// initiator dialed ("host:port", a u16 length before it), and the MACs are
// HMAC-SHA256 under k, the key both derive from X25519 of their own secret
// and the other's public key (auth.Authority.DataKey), over a label of the
// sender's role and the transcript Ni | No | Pi | Po | A | name. The
// owner's fresh No makes a recorded HELLO and AUTH useless on a new
// connection; the labels keep one side's MAC from serving as the other's;
// and the owner refuses an A that is not one of its own addresses, so a
// process the initiator was led to dial (a stale address, a port an owner
// left) cannot relay the handshake to another owner and keep the
// connection it opens. An owner that
// refuses answers HELLO_ACK with statusUnauthenticated and closes; an
// initiator with Auth never talks to an owner that does not authenticate.
// Payloads are not encrypted: authentication keeps strangers from memory,
// it does not hide the bytes on the wire.

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/kvferry/kvferry/engine/auth"
)

// ErrUnauthenticated: a data connection's peer did not prove a key the
// allowlist holds, or refused ours.
var ErrUnauthenticated = auth.ErrUnauthenticated

const (
	authNonceSize    = 32
	authMACSize      = sha256.Size
	challengeSize    = auth.KeySize + authNonceSize + authMACSize
	helloAuthPrefix  = auth.KeySize + authNonceSize
	macLabelOwner    = "kvferry tcp owner v1"
	macLabelInitator = "kvferry tcp initiator v1"
	dataKeyLabel     = "tcp"
)

// handshakeMAC is the MAC of one side (label) over the transcript.
func handshakeMAC(k auth.Key, label string, ni, no []byte, pi, po auth.Key, dialed, name []byte) []byte {
	m := hmac.New(sha256.New, k[:])
	m.Write([]byte(label))
	m.Write(ni)
	m.Write(no)
	m.Write(pi[:])
	m.Write(po[:])
	m.Write(binary.LittleEndian.AppendUint32(nil, uint32(len(dialed))))
	m.Write(dialed)
	m.Write(binary.LittleEndian.AppendUint32(nil, uint32(len(name))))
	m.Write(name)
	return m.Sum(nil)
}

// maxDialedAddr bounds the dialed address in an authenticating HELLO.
const maxDialedAddr = 300

// splitAuthHello parses an authenticating HELLO's payload.
func splitAuthHello(p []byte) (pi auth.Key, ni, dialed, name []byte, ok bool) {
	if len(p) < helloAuthPrefix+2 {
		return pi, nil, nil, nil, false
	}
	copy(pi[:], p[:auth.KeySize])
	ni = p[auth.KeySize:helloAuthPrefix]
	n := int(binary.LittleEndian.Uint16(p[helloAuthPrefix:]))
	rest := p[helloAuthPrefix+2:]
	if n == 0 || n > maxDialedAddr || n >= len(rest) {
		return pi, nil, nil, nil, false
	}
	return pi, ni, rest[:n], rest[n:], true
}

// ownAddress reports whether addr ("host:port", as an initiator dialed it)
// reaches this transport: our port, and our bound address, our advertised
// host, or, bound to a wildcard, one of this machine's addresses.
func (t *Transport) ownAddress(addr string) bool {
	host, port, err := net.SplitHostPort(addr)
	if err != nil || t.ln == nil {
		return false
	}
	bound := t.ln.Addr().(*net.TCPAddr)
	if port != strconv.Itoa(bound.Port) {
		return false
	}
	if t.opts.AdvertiseHost != "" && strings.EqualFold(host, strings.Trim(t.opts.AdvertiseHost, "[]")) {
		return true
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return false
	}
	ip = ip.Unmap()
	b, _ := netip.AddrFromSlice(bound.IP)
	b = b.Unmap()
	if ip == b {
		return true
	}
	if !b.IsUnspecified() {
		return false
	}
	if ip.IsLoopback() {
		return true
	}
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return false
	}
	for _, a := range addrs {
		if p, err := netip.ParsePrefix(a.String()); err == nil && p.Addr().Unmap() == ip {
			return true
		}
	}
	return false
}

// authedConn is an accepted connection that authenticated: its peer's key
// and name, and done, closed when its serving goroutine has returned.
type authedConn struct {
	key  auth.Key
	name string
	conn *net.TCPConn
	done chan struct{}
}

// ownerAuth runs the owner's side of the handshake after HELLO's header.
// It returns the initiator's name, or an error after refusing the
// connection (counted and logged).
func (t *Transport) ownerAuth(c *ownerConn, h *header) (string, *authedConn, error) {
	a := t.opts.Auth
	if h.done&helloAuth == 0 || h.length <= helloAuthPrefix {
		// Read nothing more: the stranger gets only the refusal.
		return "", nil, t.refuseAuth(c, "the initiator does not authenticate")
	}
	payload := make([]byte, h.length)
	if err := c.raw.readFull(payload); err != nil {
		t.handshakeErr(c, err)
		return "", nil, err
	}
	pi, ni, dialed, name, ok := splitAuthHello(payload)
	switch {
	case !ok:
		return "", nil, t.refuseAuth(c, "a malformed authenticating HELLO")
	case !a.Allowed(pi):
		return "", nil, t.refuseAuth(c, "the initiator's key is not on the allowlist")
	case !t.ownAddress(string(dialed)):
		return "", nil, t.refuseAuth(c, fmt.Sprintf("the initiator dialed %q, not an address of ours (a relayed handshake?)", dialed))
	}
	k, err := a.DataKey(pi, dataKeyLabel)
	if err != nil {
		return "", nil, t.refuseAuth(c, "the initiator's key is unusable")
	}
	po := a.Public()
	no := make([]byte, authNonceSize)
	if _, err := rand.Read(no); err != nil {
		return "", nil, fmt.Errorf("tcp: nonce: %w", err)
	}
	ch := make([]byte, 0, challengeSize)
	ch = append(append(append(ch, po[:]...), no...), handshakeMAC(k, macLabelOwner, ni, no, pi, po, dialed, name)...)
	var hb [HeaderSize]byte
	(&header{typ: frameChallenge, length: challengeSize}).encode(hb[:])
	_ = c.conn.SetWriteDeadline(t.writeDeadline(HeaderSize + challengeSize))
	if _, _, err := c.raw.writeGuarded(hb[:], ch, nil); err != nil {
		return "", nil, err
	}
	var ah header
	if err := c.raw.readFull(hb[:]); err != nil {
		t.handshakeErr(c, err)
		return "", nil, err
	}
	if err := ah.decode(hb[:]); err != nil || ah.typ != frameAuth {
		return "", nil, t.refuseAuth(c, fmt.Sprintf("want AUTH, got type %d (%v)", ah.typ, err))
	}
	mac := make([]byte, authMACSize)
	if err := c.raw.readFull(mac); err != nil {
		t.handshakeErr(c, err)
		return "", nil, err
	}
	if !hmac.Equal(mac, handshakeMAC(k, macLabelInitator, ni, no, pi, po, dialed, name)) {
		return "", nil, t.refuseAuth(c, "the initiator's AUTH does not prove its key (a replayed or forged handshake)")
	}
	ac := &authedConn{key: pi, name: string(name), conn: c.conn, done: make(chan struct{})}
	// Registered, and the key checked again, under the lock CutUnallowed
	// scans with: a reload that ran since the first check cuts this
	// connection either here or in its scan.
	t.authMu.Lock()
	allowed := a.Allowed(pi) && t.authed != nil
	if allowed {
		t.authed[ac] = struct{}{}
	}
	t.authMu.Unlock()
	if !allowed {
		return "", nil, t.refuseAuth(c, "the initiator's key left the allowlist during the handshake")
	}
	return string(name), ac, nil
}

// releaseAuthed forgets an authenticated connection whose serving ended.
func (t *Transport) releaseAuthed(ac *authedConn) {
	t.authMu.Lock()
	delete(t.authed, ac)
	t.authMu.Unlock()
	close(ac.done)
}

// refuseAuth counts and logs a refused connection and tells the peer so;
// the caller closes it.
func (t *Transport) refuseAuth(c *ownerConn, why string) error {
	t.stats.authRefused.Add(1)
	t.warn.Warn("auth "+c.ip, "tcp: refusing a data connection: not authenticated", "remote", c.remote, "why", why)
	var hb [HeaderSize]byte
	(&header{typ: frameHelloAck, status: statusUnauthenticated}).encode(hb[:])
	_ = c.conn.SetWriteDeadline(time.Now().Add(time.Second))
	_, _, _ = c.raw.writeGuarded(hb[:], nil, nil)
	return fmt.Errorf("%w: %s", ErrUnauthenticated, why)
}

// initiatorAuth runs the initiator's side: HELLO with our key and a nonce,
// the owner's CHALLENGE checked, our AUTH. It returns the owner's key.
func (ep *endpoint) initiatorAuth(dialed, self string) (auth.Key, error) {
	a := ep.t.opts.Auth
	pi := a.Public()
	ni := make([]byte, authNonceSize)
	if _, err := rand.Read(ni); err != nil {
		return auth.Key{}, fmt.Errorf("tcp: nonce: %w", err)
	}
	if len(dialed) == 0 || len(dialed) > maxDialedAddr {
		return auth.Key{}, fmt.Errorf("tcp: address %q: 1 to %d bytes", dialed, maxDialedAddr)
	}
	payload := make([]byte, 0, helloAuthPrefix+2+len(dialed)+len(self))
	payload = append(append(payload, pi[:]...), ni...)
	payload = binary.LittleEndian.AppendUint16(payload, uint16(len(dialed)))
	payload = append(append(payload, dialed...), self...)
	var hb [HeaderSize]byte
	(&header{typ: frameHello, length: uint32(len(payload)), done: helloGoAway | helloAuth | ep.t.helloCodecs()}).encode(hb[:])
	if _, _, err := ep.out.writeGuarded(hb[:], payload, nil); err != nil {
		return auth.Key{}, err
	}
	if err := ep.in.readFull(hb[:]); err != nil {
		return auth.Key{}, err
	}
	var h header
	if err := h.decode(hb[:]); err != nil {
		return auth.Key{}, err
	}
	switch {
	case h.typ == frameHelloAck && h.status == statusUnauthenticated:
		return auth.Key{}, fmt.Errorf("%w: the owner refused our key", ErrUnauthenticated)
	case h.typ == frameHelloAck:
		return auth.Key{}, fmt.Errorf("%w: the owner does not authenticate", ErrUnauthenticated)
	case h.typ != frameChallenge:
		return auth.Key{}, fmt.Errorf("%w: HELLO answered with type %d", errBadFrame, h.typ)
	}
	ch := make([]byte, challengeSize)
	if err := ep.in.readFull(ch); err != nil {
		return auth.Key{}, err
	}
	var po auth.Key
	copy(po[:], ch[:auth.KeySize])
	no := ch[auth.KeySize:helloAuthPrefix]
	if !a.Allowed(po) {
		return auth.Key{}, fmt.Errorf("%w: the owner's key %s is not on our allowlist", ErrUnauthenticated, po)
	}
	k, err := a.DataKey(po, dataKeyLabel)
	if err != nil {
		return auth.Key{}, fmt.Errorf("%w: the owner's key: %w", ErrUnauthenticated, err)
	}
	name := []byte(self)
	if !hmac.Equal(ch[helloAuthPrefix:], handshakeMAC(k, macLabelOwner, ni, no, pi, po, []byte(dialed), name)) {
		return auth.Key{}, fmt.Errorf("%w: the owner did not prove the key it announced", ErrUnauthenticated)
	}
	(&header{typ: frameAuth, length: authMACSize}).encode(hb[:])
	if _, _, err := ep.out.writeGuarded(hb[:], handshakeMAC(k, macLabelInitator, ni, no, pi, po, []byte(dialed), name), nil); err != nil {
		return auth.Key{}, err
	}
	return po, nil
}

// CutUnallowed closes every data connection whose peer's key the Authority
// no longer allows (after its allowlist was reloaded): accepted ones, whose
// serving goroutines it waits for, so no byte of theirs lands in our memory
// once it returns, and ours to owners no longer allowed, whose slices fail.
// It returns the peers cut: initiators' segment names and owners' data
// addresses. Without Options.Auth it does nothing.
func (t *Transport) CutUnallowed(ctx context.Context) ([]string, error) {
	a := t.opts.Auth
	if a == nil {
		return nil, nil
	}
	var cut []*authedConn
	seen := map[string]bool{}
	var names []string
	t.authMu.Lock()
	for ac := range t.authed {
		if !a.Allowed(ac.key) {
			cut = append(cut, ac)
			delete(t.authed, ac)
		}
	}
	t.authMu.Unlock()
	for _, ac := range cut {
		t.stats.authRefused.Add(1)
		_ = ac.conn.Close()
		if !seen[ac.name] {
			seen[ac.name] = true
			names = append(names, ac.name)
		}
	}
	t.epMu.Lock()
	var eps []*endpoint
	for ep := range t.endpoints {
		if !a.Allowed(ep.ownerKey) {
			eps = append(eps, ep)
		}
	}
	t.epMu.Unlock()
	for _, ep := range eps {
		ep.Abort(fmt.Errorf("%w: the owner's key was removed from the allowlist", ErrUnauthenticated))
		addr := ep.conn.RemoteAddr().String()
		if !seen[addr] {
			seen[addr] = true
			names = append(names, addr)
		}
	}
	for _, ac := range cut {
		select {
		case <-ac.done:
		case <-ctx.Done():
			return names, fmt.Errorf("tcp: cut peers: %w", ctx.Err())
		}
	}
	if len(names) > 0 {
		t.opts.Logger.Warn("tcp: cut data connections of peers whose keys left the allowlist", "peers", names)
	}
	return names, nil
}
