package engine_test

// The attacker process of the authentication tests: a second process on the
// same host that knows the victim's ports and guesses (is handed) the
// address and key of its registered buffer, and tries everything the control
// and data planes let a stranger try. It prints one "result <step> <verdict>"
// line per step; the test decides from those and from the victim's memory.

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/engine/auth"
	"github.com/kvferry/kvferry/engine/control"
	"github.com/kvferry/kvferry/engine/transport/tcp"
)

// attackEnv carries the attack plan (JSON) to the attacker process.
const attackEnv = "KVFERRY_TEST_ATTACK"

// attackPlan is what the attacker knows and holds.
type attackPlan struct {
	Target   string // the victim's segment name (control port)
	DataAddr string // the victim's tcp data address
	Buffer   uint64 // a registered buffer's address, key and length
	Key      uint64
	Len      int
	Seed     uint64 // the buffer's pattern, to tell a read that got it
	Grantee  string // the peer the victim granted a request to
	GrantRID uint64
	GrantID  uint64
	GrantGen uint32
	Peer     string // the legitimate peer's control name, to send it a spoofed ABORT
	AbortRID uint64
	// The attacker's own key files; empty: no key at all.
	SecretKeyFile, AllowlistFile string
	// ForgeKey: the legitimate peer's public key, claimed without its
	// secret. ReplayFile: a data-connection handshake of the legitimate
	// peer, recorded off the wire.
	ForgeKey   string
	ReplayFile string
	// Flood: unauthenticated connection attempts to make, control and data
	// each, instead of the steps above.
	Flood int
}

const attackByte = 0xEE

func result(step, verdict string) { fmt.Printf("result %s %s\n", step, verdict) }

// runAttacker is the attacker process's main.
func runAttacker() error {
	var p attackPlan
	if err := json.Unmarshal([]byte(os.Getenv(attackEnv)), &p); err != nil {
		return fmt.Errorf("%s: %w", attackEnv, err)
	}
	if p.Flood > 0 {
		if err := flood(p); err != nil {
			return err
		}
		result("flood", "done")
		return nil
	}
	// The descriptor, through an engine of our own with our key, if any.
	opts := engine.Options{IgnoreEnv: true, Protocol: "tcp", SecretKeyFile: p.SecretKeyFile, AllowlistFile: p.AllowlistFile}
	e, err := engine.New(opts)
	if err != nil {
		return fmt.Errorf("attacker engine: %w", err)
	}
	defer e.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	seg, err := e.OpenSegment(ctx, p.Target)
	cancel()
	if err != nil {
		result("descriptor", "refused")
	} else {
		result("descriptor", "fetched")
		// What the victim handed us replaces our guess.
		for _, b := range seg.Descriptor().Buffers {
			if b.Len == uint64(p.Len) {
				p.Buffer, p.Key = b.Addr, b.Key
			}
		}
	}
	payload := make([]byte, 64)
	for i := range payload {
		payload[i] = attackByte
	}
	hello := rawHello("attacker:1")
	// Writes and reads at request id 0, as a peer that fetched the
	// descriptor may; an address just before the buffer too.
	result("write", dataVerdict(p.DataAddr, hello, dataReq(3, 1, 0, 0, 0, p.Key, p.Buffer+128, payload), payload, nil))
	result("write-outside", dataVerdict(p.DataAddr, hello, dataReq(3, 1, 0, 0, 0, p.Key, p.Buffer-64, payload), payload, nil))
	secret := pattern(p.Len, p.Seed)[:64]
	result("read", dataVerdict(p.DataAddr, hello, dataReq(5, 1, 0, 0, 0, p.Key, p.Buffer, make([]byte, 64))[:tcp.HeaderSize], nil, secret))
	// A write under the grant, claiming the grantee's name.
	result("claim", dataVerdict(p.DataAddr, rawHello(p.Grantee),
		dataReq(3, 1, p.GrantRID, p.GrantGen, p.GrantID, p.Key, p.Buffer+256, payload), payload, nil))
	// Our own key, authenticated: the victim must not let it in either.
	if p.SecretKeyFile != "" {
		a, err := auth.New(auth.Config{SecretKeyFile: p.SecretKeyFile, AllowlistFile: p.AllowlistFile})
		if err != nil {
			return err
		}
		tr := tcp.New(tcp.Options{Auth: a})
		ep, err := tr.Dial(context.Background(), p.DataAddr, "attacker:1")
		if err != nil {
			result("own-key", "refused")
		} else {
			_ = ep.Close()
			result("own-key", "accepted")
		}
		_ = tr.Close()
	}
	if p.ForgeKey != "" {
		k, err := auth.ParseKey(p.ForgeKey)
		if err != nil {
			return err
		}
		result("forge", forged(p, k, payload))
	}
	if p.ReplayFile != "" {
		rec, err := os.ReadFile(p.ReplayFile)
		if err != nil {
			return err
		}
		result("replay", dataVerdict(p.DataAddr, rec, dataReq(3, 1, 0, 0, 0, p.Key, p.Buffer+384, payload), payload, nil))
	}
	result("abort", spoofAbortTo(p.Peer, p.Target, p.AbortRID))
	return nil
}

// rawHello is a HELLO without authentication.
func rawHello(name string) []byte {
	return append(dataReq(1, 0, 0, 0, 0, 0, 0, []byte(name))[:tcp.HeaderSize], name...)
}

// dataReq is a tcp data frame with every header field, and payload.
func dataReq(typ uint8, seq, rid uint64, gen uint32, grant, key, addr uint64, payload []byte) []byte {
	b := make([]byte, tcp.HeaderSize, tcp.HeaderSize+len(payload))
	binary.LittleEndian.PutUint16(b[0:], 0x464b)
	b[2], b[3] = 1, typ
	binary.LittleEndian.PutUint64(b[8:], seq)
	binary.LittleEndian.PutUint64(b[16:], rid)
	binary.LittleEndian.PutUint32(b[24:], gen)
	binary.LittleEndian.PutUint32(b[28:], uint32(len(payload)))
	binary.LittleEndian.PutUint64(b[32:], key)
	binary.LittleEndian.PutUint64(b[40:], addr)
	binary.LittleEndian.PutUint64(b[48:], grant)
	return append(b, payload...)
}

// dataVerdict sends handshake then req on a new data connection and reads
// the answers until the victim closes or goes quiet: "acked" when a WRITE
// was acknowledged with bytes applied, "got-secret" when a READ returned
// secret, else "refused".
func dataVerdict(addr string, handshake, req, wrote, secret []byte) string {
	c, err := net.DialTimeout("tcp", addr, 3*time.Second)
	if err != nil {
		return "refused"
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := c.Write(append(append([]byte(nil), handshake...), req...)); err != nil {
		return "refused"
	}
	for {
		var h [tcp.HeaderSize]byte
		if _, err := io.ReadFull(c, h[:]); err != nil {
			return "refused"
		}
		typ, status := h[3], binary.LittleEndian.Uint32(h[4:])
		n := binary.LittleEndian.Uint32(h[28:])
		done := binary.LittleEndian.Uint64(h[56:])
		switch typ {
		case 4: // WRITE_ACK
			if status == 0 && done == uint64(len(wrote)) && wrote != nil {
				return "acked"
			}
			return "refused"
		case 6: // READ_DATA
			got := make([]byte, n)
			if _, err := io.ReadFull(c, got); err != nil {
				return "refused"
			}
			if secret != nil && string(got) == string(secret) {
				return "got-secret"
			}
		case 7: // READ_DONE
			return "refused"
		case 9: // CHALLENGE: we cannot answer it
			if _, err := io.ReadFull(c, make([]byte, n)); err != nil {
				return "refused"
			}
		}
	}
}

// authHello is an authenticating HELLO (see engine/transport/tcp's
// auth.go): key, nonce, the address dialed, name.
func authHello(key auth.Key, ni []byte, dialed, name string) []byte {
	body := append(append([]byte(nil), key[:]...), ni...)
	body = binary.LittleEndian.AppendUint16(body, uint16(len(dialed)))
	body = append(append(body, dialed...), name...)
	hello := dataReq(1, 0, 0, 0, 0, 0, 0, body)
	hello[56] = 3 // GOAWAY | AUTH
	return hello
}

// authedHandshake runs, with a's secret key, the initiator's side of a data
// connection's handshake with the owner at addr (a second implementation of
// the wire engine/transport/tcp's auth.go describes), requires the owner's
// HELLO_ACK, and returns the bytes it sent.
func authedHandshake(a *auth.Authority, addr, name string) ([]byte, error) {
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	ni := make([]byte, 32)
	_, _ = rand.Read(ni)
	pi := a.Public()
	hello := authHello(pi, ni, addr, name)
	if _, err := c.Write(hello); err != nil {
		return nil, err
	}
	ch := make([]byte, tcp.HeaderSize+96)
	if _, err := io.ReadFull(c, ch); err != nil || ch[3] != 9 {
		return nil, fmt.Errorf("no CHALLENGE: %v (type %d)", err, ch[3])
	}
	var po auth.Key
	copy(po[:], ch[tcp.HeaderSize:])
	no := ch[tcp.HeaderSize+32 : tcp.HeaderSize+64]
	k, err := a.DataKey(po, "tcp")
	if err != nil {
		return nil, err
	}
	m := hmac.New(sha256.New, k[:])
	for _, part := range [][]byte{[]byte("kvferry tcp initiator v1"), ni, no, pi[:], po[:],
		binary.LittleEndian.AppendUint32(nil, uint32(len(addr))), []byte(addr),
		binary.LittleEndian.AppendUint32(nil, uint32(len(name))), []byte(name)} {
		m.Write(part)
	}
	authFrame := dataReq(10, 0, 0, 0, 0, 0, 0, m.Sum(nil))
	if _, err := c.Write(authFrame); err != nil {
		return nil, err
	}
	ack := make([]byte, tcp.HeaderSize)
	if _, err := io.ReadFull(c, ack); err != nil || ack[3] != 2 || binary.LittleEndian.Uint32(ack[4:]) != 0 {
		return nil, fmt.Errorf("the handshake was not accepted: %v, %x", err, ack[:8])
	}
	return append(hello, authFrame...), nil
}

// forged says HELLO with the legitimate peer's public key and a made-up
// AUTH, then writes.
func forged(p attackPlan, claimed auth.Key, payload []byte) string {
	ni := make([]byte, 32)
	_, _ = rand.Read(ni)
	hello := authHello(claimed, ni, p.DataAddr, p.Grantee)
	mac := make([]byte, 32)
	_, _ = rand.Read(mac)
	handshake := append(hello, dataReq(10, 0, 0, 0, 0, 0, 0, mac)...)
	return dataVerdict(p.DataAddr, handshake, dataReq(3, 1, 0, 0, 0, p.Key, p.Buffer+512, payload), payload, nil)
}

// spoofAbortTo opens a NULL control connection to peer claiming to be
// owner and sends it an ABORT of rid: "sent" once the peer completed the
// handshake and took the message, "refused" when it would not talk.
func spoofAbortTo(peer, owner string, rid uint64) string {
	c, err := net.DialTimeout("tcp", peer, 3*time.Second)
	if err != nil {
		return "refused"
	}
	defer c.Close()
	if _, err := c.Write(zmtpHello(owner)); err != nil {
		return "refused"
	}
	if err := readHello(c); err != nil {
		return "refused"
	}
	env := control.EncodeEnvelope(control.Envelope{Type: control.MsgAbort, Corr: 1})
	body := control.AbortMsg{RequestID: rid, Generation: 1}.Encode()
	msg := append([]byte{0x01, byte(len(env))}, env...)
	msg = append(append(msg, 0x00, byte(len(body))), body...)
	if _, err := c.Write(msg); err != nil {
		return "refused"
	}
	// A PING behind it: its PONG says the ABORT before it was read.
	ping := control.EncodeEnvelope(control.Envelope{Type: control.MsgPing, Corr: 2})
	if _, err := c.Write(append([]byte{0x00, byte(len(ping))}, ping...)); err != nil {
		return "refused"
	}
	_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
	if _, err := io.ReadFull(c, make([]byte, 2)); err != nil {
		return "refused"
	}
	return "sent"
}

// flood makes n control and n data connection attempts without an allowed
// key: NULL greetings, CURVE greetings with HELLOs of garbage, and data
// HELLOs. Each is closed with a reset (linger 0), so the attacker's side
// keeps no TIME_WAIT and the victim carries what it chose to.
func flood(p attackPlan) error {
	curve := make([]byte, 64)
	curve[0], curve[9], curve[10] = 0xff, 0x7f, 3
	copy(curve[12:], "CURVE")
	garbage := make([]byte, 202)
	garbage[0], garbage[1] = 0x04, 200
	garbage[2] = 5
	copy(garbage[3:], "HELLO")
	var refusedCtl, refusedData int
	for i := 0; i < p.Flood; i++ {
		msg := zmtpHello(fmt.Sprintf("flood%d:1", i))
		if i%2 == 1 {
			_, _ = rand.Read(garbage[10:])
			msg = append(append([]byte(nil), curve...), garbage...)
		}
		if attempt(p.Target, msg) {
			refusedCtl++
		}
		if attempt(p.DataAddr, rawHello("flood:1")) {
			refusedData++
		}
	}
	if refusedCtl != p.Flood || refusedData != p.Flood {
		return fmt.Errorf("flood: %d of %d control and %d of %d data attempts were not closed by the victim", p.Flood-refusedCtl, p.Flood, p.Flood-refusedData, p.Flood)
	}
	return nil
}

// attempt sends msg on a new connection and reports whether the victim
// closed it (read to EOF or reset within 5 s).
func attempt(addr string, msg []byte) bool {
	nc, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return false
	}
	c := nc.(*net.TCPConn)
	defer func() { _ = c.SetLinger(0); _ = c.Close() }()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	_, _ = c.Write(msg)
	_, err = io.Copy(io.Discard, c)
	var ne net.Error
	return !(errors.As(err, &ne) && ne.Timeout())
}
