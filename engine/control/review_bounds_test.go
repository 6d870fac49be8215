package control_test

// Hostile-review regression tests of the control plane's bounds: attacks
// from a second process (the attacker modes below run in the child started
// by startAttacker) and reconnect cases.

import (
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/control"
)

// reviewAttacks are the attacker modes of this file, run by
// TestAttackerProcess in the child process.
var reviewAttacks = map[string]func(target string) error{
	"unread":      attackUnread,
	"budget-hold": attackBudgetHold,
	"flood":       attackFlood,
	"claim":       attackClaim,
	"zombie":      attackZombie,
	"hangup":      attackHangup,
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil {
		return v
	}
	return def
}

// attackUnread opens KVFERRY_ATTACK_CONNS connections with a tiny receive
// buffer; each sends KVFERRY_ATTACK_REQS GET_DESCRIPTOR requests (18 bytes
// each) and never reads a reply. It prints SENT, then holds the connections
// until stdin closes.
func attackUnread(target string) error {
	n := envInt("KVFERRY_ATTACK_CONNS", 16)
	reqs := envInt("KVFERRY_ATTACK_REQS", 3000)
	dialer := net.Dialer{Timeout: 5 * time.Second, Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		err := rc.Control(func(fd uintptr) { serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096) })
		if err != nil {
			return err
		}
		return serr
	}}
	var req []byte
	for i := 0; i < reqs; i++ {
		req = append(req, 0x00, 16)
		req = append(req, control.EncodeEnvelope(control.Envelope{Type: control.MsgGetDescriptor, Corr: uint64(i + 1)})...)
	}
	var conns []net.Conn
	for i := 0; i < n; i++ {
		c, err := dialer.Dial("tcp", target)
		if err != nil {
			return err
		}
		if _, err := c.Write(zmtpHello(fmt.Sprintf("10.1.0.%d:1", i+1))); err != nil {
			return err
		}
		if _, err := c.Write(req); err != nil {
			return err
		}
		conns = append(conns, c)
	}
	fmt.Println("SENT", n*reqs)
	waitStdin()
	for _, c := range conns {
		_ = c.Close()
	}
	return nil
}

// attackBudgetHold opens KVFERRY_ATTACK_CONNS connections; on each it sends
// a hello, an envelope frame and only the 9-byte header of a 16 MiB body
// frame, then nothing. It prints HELD and keeps them until stdin closes.
func attackBudgetHold(target string) error {
	n := envInt("KVFERRY_ATTACK_CONNS", 8)
	var conns []net.Conn
	for i := 0; i < n; i++ {
		c, err := net.Dial("tcp", target)
		if err != nil {
			return err
		}
		msg := append(zmtpHello(fmt.Sprintf("10.2.0.%d:1", i+1)), 0x01, 16)
		msg = append(msg, control.EncodeEnvelope(control.Envelope{Type: control.MsgPing, Corr: 1})...)
		msg = append(msg, longFrameHeader(control.MaxBody, false)...)
		if _, err := c.Write(msg); err != nil {
			return err
		}
		conns = append(conns, c)
	}
	fmt.Println("HELD", n)
	waitStdin()
	for _, c := range conns {
		_ = c.Close()
	}
	return nil
}

// rss returns the process's resident set (VmRSS) in bytes.
func rss(t *testing.T) uint64 {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	must(t, err)
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "VmRSS:") {
			kb, err := strconv.ParseUint(strings.Fields(l)[1], 10, 64)
			must(t, err)
			return kb << 10
		}
	}
	t.Fatal("no VmRSS in /proc/self/status")
	return 0
}

// zmtpHelloAs is a ZMTP 3.0 NULL greeting and a READY of socket type typ,
// with an Identity property when name is not empty.
func zmtpHelloAs(typ, name string) []byte {
	g := make([]byte, 64)
	g[0], g[9], g[10] = 0xff, 0x7f, 3
	copy(g[12:], "NULL")
	props := [][2]string{{"Socket-Type", typ}}
	if name != "" {
		props = append(props, [2]string{"Identity", name})
	}
	ready := append([]byte{5}, "READY"...)
	for _, p := range props {
		ready = append(ready, byte(len(p[0])))
		ready = append(ready, p[0]...)
		ready = binary.BigEndian.AppendUint32(ready, uint32(len(p[1])))
		ready = append(ready, p[1]...)
	}
	return append(append(g, 0x04, byte(len(ready))), ready...)
}

// attackFlood opens KVFERRY_ATTACK_CONNS connections and writes PING
// requests (18 bytes each, no body) on each as fast as TCP takes them,
// reading the answers, until stdin closes. It prints FLOODING once every
// connection said hello.
func attackFlood(target string) error {
	n := envInt("KVFERRY_ATTACK_CONNS", 4)
	var burst []byte
	for i := 0; i < 4096; i++ {
		burst = append(burst, 0x00, 16)
		burst = append(burst, control.EncodeEnvelope(control.Envelope{Type: control.MsgPing, Corr: uint64(i + 1)})...)
	}
	var conns []net.Conn
	for i := 0; i < n; i++ {
		c, err := net.Dial("tcp", target)
		if err != nil {
			return err
		}
		if _, err := c.Write(zmtpHello(fmt.Sprintf("10.3.0.%d:1", i+1))); err != nil {
			return err
		}
		conns = append(conns, c)
	}
	for _, c := range conns {
		go func() { _, _ = io.Copy(io.Discard, c) }() // read the answers, as a real client would
		go func() {
			for {
				if _, err := c.Write(burst); err != nil {
					return
				}
			}
		}()
	}
	fmt.Println("FLOODING")
	waitStdin()
	for _, c := range conns {
		_ = c.Close()
	}
	return nil
}

// attackClaim connects once with the identity KVFERRY_ATTACK_NAME, waits
// for the target's hello, prints CLAIMED and closes at once.
func attackClaim(target string) error {
	c, err := net.Dial("tcp", target)
	if err != nil {
		return err
	}
	if _, err := c.Write(zmtpHello(os.Getenv("KVFERRY_ATTACK_NAME"))); err != nil {
		return err
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(c, make([]byte, 64)); err != nil {
		return err
	}
	fmt.Println("CLAIMED")
	_ = c.Close()
	fmt.Println("CLOSED")
	waitStdin()
	return nil
}

// TestUnreadRepliesAreBounded: 16 connections each send 3,000
// GET_DESCRIPTOR requests (54 KB) for a 16 KB descriptor (a real engine's
// 512 registrations) and never read. Every reply went into libzmq's send
// queue for its connection (SNDHWM 1,000 messages by default) outside the
// plane's budget: the owner's RSS grew by 217 MiB for 864 KB received, so
// the default 1,024 connections reach about 14 GiB.
func TestUnreadRepliesAreBounded(t *testing.T) {
	desc := bigDescriptor(512, func(int) string { return "cuda:0" }).Encode()
	p, err := control.ListenWith("127.0.0.1", 0, control.Options{}, nil)
	must(t, err)
	p.Handle(control.MsgGetDescriptor, func(string, []byte) (control.MsgType, []byte) { return control.MsgDescriptor, desc })
	p.Start()
	t.Cleanup(func() { _ = p.Close() })
	debug.FreeOSMemory()
	before := rss(t)
	const conns, reqs = 16, 3000
	sc, _ := startAttacker(t, "unread", p.Name(), fmt.Sprintf("KVFERRY_ATTACK_CONNS=%d", conns), fmt.Sprintf("KVFERRY_ATTACK_REQS=%d", reqs))
	expectLine(t, sc, "SENT")
	// Every request read and answered (or its answer refused, or its
	// connection cut): what is queued now stays queued, the attacker reads
	// nothing.
	waitFor(t, "every request handled", 60*time.Second, func() bool {
		s := p.Stats()
		return s.Received >= conns*reqs || s.ConnsCut >= conns
	})
	debug.FreeOSMemory()
	grew := int64(rss(t)) - int64(before)
	t.Logf("RSS grew by %.1f MiB for %d KB of requests (%d-byte replies); stats %+v",
		float64(grew)/(1<<20), conns*reqs*18/1000, len(desc), p.Stats())
	if grew > 64<<20 {
		t.Fatalf("RSS grew by %d MiB: replies nobody reads are queued without bound (%d connections x %d bytes x the send HWM)",
			grew>>20, conns, len(desc))
	}
}

// TestBudgetHoldersCannotStarveOurReplies: 8 connections each send the
// 9-byte header of a 16 MiB frame and nothing more; the plane reserved
// the whole frame at the header, so 1.4 KB held the whole 128 MiB budget
// for MessageTimeout, and the reply to our own request (200 KiB, from a
// peer we chose to ask) was dropped as over budget: the request timed out.
func TestBudgetHoldersCannotStarveOurReplies(t *testing.T) {
	victim := newPlane(t, "127.0.0.1")
	peer := newPlane(t, "127.0.0.1")
	sc, _ := startAttacker(t, "budget-hold", victim.Name(), "KVFERRY_ATTACK_CONNS=8")
	expectLine(t, sc, "HELD")
	waitFor(t, "the 8 attack messages started", 10*time.Second, func() bool {
		s := victim.Stats()
		return s.Conns == 8 && (s.BufferedBytes >= 8*control.MaxBody || s.OverBudget > 0)
	})
	body := make([]byte, 200<<10)
	_, _ = rand.Read(body)
	if _, got, err := victim.Request(ctxFor(t, 5*time.Second), peer.Name(), control.MsgPing, body); err != nil || len(got) != len(body) {
		t.Fatalf("the reply to our own request was dropped while strangers held the budget: %v (%d bytes); stats %+v", err, len(got), victim.Stats())
	}
}

// TestFloodDoesNotStarveOwnRequests: 4 connections write 18-byte PINGs as
// fast as TCP takes them (and read the answers). libzmq reads 8 KiB (455 requests) per syscall
// and the plane's loop drained the socket until it was empty before
// running its own sends and deadlines, so it never got to them: our own
// request to another peer timed out (3 s), where the ROUTER plane of
// fc30316 answered it in 63 ms under the same flood.
func TestFloodDoesNotStarveOwnRequests(t *testing.T) {
	victim := newPlane(t, "127.0.0.1")
	peer := newPlane(t, "127.0.0.1")
	if _, _, err := victim.Request(ctxFor(t, 5*time.Second), peer.Name(), control.MsgPing, nil); err != nil {
		t.Fatal(err)
	}
	sc, _ := startAttacker(t, "flood", victim.Name(), "KVFERRY_ATTACK_CONNS=4")
	expectLine(t, sc, "FLOODING")
	waitFor(t, "the flood arriving", 10*time.Second, func() bool { return victim.Stats().Received > 100_000 })
	start := time.Now()
	if _, _, err := victim.Request(ctxFor(t, 3*time.Second), peer.Name(), control.MsgPing, nil); err != nil {
		t.Fatalf("our request under a flood of PINGs: %v after %v; stats %+v", err, time.Since(start), victim.Stats())
	}
	t.Logf("answered in %v under the flood; stats %+v", time.Since(start), victim.Stats())
}

// ackPlanes returns an owner plane that collects ABORT_ACKs and an
// initiator plane that answers each ABORT with an ABORT_ACK through
// SendIfConnected, as the engine's sendAck does.
func ackPlanes(t *testing.T) (owner, init *control.Plane, acks chan control.AbortAck) {
	t.Helper()
	acks = make(chan control.AbortAck, 64)
	owner, err := control.ListenWith("127.0.0.1", 0, control.Options{}, nil)
	must(t, err)
	owner.Handle(control.MsgAbortAck, func(_ string, b []byte) (control.MsgType, []byte) {
		if a, err := control.DecodeAbortAck(b); err == nil {
			select {
			case acks <- a:
			default:
			}
		}
		return 0, nil
	})
	owner.Start()
	t.Cleanup(func() { _ = owner.Close() })
	init, err = control.ListenWith("127.0.0.1", 0, control.Options{}, nil)
	must(t, err)
	init.Handle(control.MsgAbort, func(from string, b []byte) (control.MsgType, []byte) {
		if m, err := control.DecodeAbortMsg(b); err == nil {
			ack := control.AbortAck{RequestID: m.RequestID, Generation: m.Generation, Outcome: control.AckDrained}
			_ = init.SendIfConnected(from, control.MsgAbortAck, ack.Encode())
		}
		return 0, nil
	})
	init.Start()
	t.Cleanup(func() { _ = init.Close() })
	return owner, init, acks
}

// abortUntilAcked sends ABORT(rid, gen) from owner to init every 100 ms,
// as the engine's resendAbort does, until its ACK arrives or d passes.
func abortUntilAcked(owner *control.Plane, init string, acks chan control.AbortAck, rid uint64, gen uint32, d time.Duration) bool {
	msg := control.AbortMsg{RequestID: rid, Generation: gen}.Encode()
	deadline := time.NewTimer(d)
	defer deadline.Stop()
	resend := time.NewTicker(100 * time.Millisecond)
	defer resend.Stop()
	_ = owner.Send(init, control.MsgAbort, msg)
	for {
		select {
		case a := <-acks:
			if a.RequestID == rid && a.Generation == gen {
				return true
			}
		case <-resend.C:
			_ = owner.Send(init, control.MsgAbort, msg)
		case <-deadline.C:
			return false
		}
	}
}

// TestClaimedNameDoesNotStrandAcks: the owner reaches the initiator over
// its own connection (the initiator holds none to the owner, e.g. its
// segment was closed or its connection idled out), so the initiator's ACKs
// go back over the owner's connection, found by the owner's name. A second
// process connects once claiming the owner's name and leaves: the plane
// then forgot the name altogether although the owner's real connection
// was still up, and dropped every later ACK (30 ABORTs received from the
// owner in 3 s, 30 ACKs dropped). With libzmq's ROUTER_HANDOVER (fc30316)
// the claimer's handover closed the owner's connection, whose DEALER
// reconnected and took its name back.
func TestClaimedNameDoesNotStrandAcks(t *testing.T) {
	owner, init, acks := ackPlanes(t)
	if !abortUntilAcked(owner, init.Name(), acks, 9, 1, 5*time.Second) {
		t.Fatalf("the first ABORT was not acknowledged; init %+v", init.Stats())
	}
	sc, _ := startAttacker(t, "claim", init.Name(), "KVFERRY_ATTACK_NAME="+owner.Name())
	expectLine(t, sc, "CLOSED")
	waitFor(t, "the claimer's connection gone", 10*time.Second, func() bool { return init.Stats().Conns == 1 })
	if !abortUntilAcked(owner, init.Name(), acks, 9, 2, 5*time.Second) {
		t.Fatalf("after a stranger claimed the owner's name and left, the owner's ABORTs (still connected) are never acknowledged; init %+v",
			init.Stats())
	}
}

// TestSelfConnectionCloseKeepsListening: a plane that sent to its own name
// (an engine's Notify on its own segment, or an Abort naming itself) dialed
// its own bound endpoint; closing that connection (Forget, or the idle
// sweep 2 minutes later) called zmq_disconnect("tcp://<own name>"), which
// libzmq matches against the bind too: the listener and every connection
// it had accepted were torn down, and no peer could reach the plane again.
func TestSelfConnectionCloseKeepsListening(t *testing.T) {
	for _, how := range []string{"forget", "idle"} {
		t.Run(how, func(t *testing.T) {
			p, err := control.ListenWith("127.0.0.1", 0, control.Options{PeerIdleTimeout: 300 * time.Millisecond}, nil)
			must(t, err)
			p.Handle(control.MsgPing, func(_ string, b []byte) (control.MsgType, []byte) { return control.MsgPong, b })
			p.Start()
			t.Cleanup(func() { _ = p.Close() })
			before := newPlane(t, "127.0.0.1") // holds a connection to p from before
			if _, _, err := before.Request(ctxFor(t, 5*time.Second), p.Name(), control.MsgPing, nil); err != nil {
				t.Fatal(err)
			}
			if _, _, err := p.Request(ctxFor(t, 5*time.Second), p.Name(), control.MsgPing, []byte("me")); err != nil {
				t.Fatalf("a request to our own name: %v", err)
			}
			switch how {
			case "forget":
				p.Forget(p.Name())
			case "idle":
				waitFor(t, "the idle connection closed", 10*time.Second, func() bool { return p.Stats().Peers == 0 })
			}
			// Ops run in order: once a later request is answered, the
			// close ran.
			other := newPlane(t, "127.0.0.1")
			if _, _, err := p.Request(ctxFor(t, 5*time.Second), other.Name(), control.MsgPing, nil); err != nil {
				t.Fatal(err)
			}
			if _, _, err := before.Request(ctxFor(t, 3*time.Second), p.Name(), control.MsgPing, nil); err != nil {
				t.Errorf("a peer connected before can no longer reach the plane: %v", err)
			}
			if _, _, err := newPlane(t, "127.0.0.1").Request(ctxFor(t, 3*time.Second), p.Name(), control.MsgPing, nil); err != nil {
				t.Errorf("a new peer can no longer reach the plane: %v", err)
			}
		})
	}
}

// TestUnreachablePeerConnectionIsDropped: a request to a name where nothing
// listens left its message queued, and the idle sweep spares connections
// with queued messages, so the connection (a socket redialed every 100 ms)
// stayed for ever; later sends queued behind it until MaxQueued.
func TestUnreachablePeerConnectionIsDropped(t *testing.T) {
	p, err := control.ListenWith("127.0.0.1", 0, control.Options{PeerIdleTimeout: 300 * time.Millisecond}, nil)
	must(t, err)
	p.Start()
	t.Cleanup(func() { _ = p.Close() })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	dead := ln.Addr().String()
	must(t, ln.Close())
	if _, _, err := p.Request(ctxFor(t, 100*time.Millisecond), dead, control.MsgPing, nil); err == nil {
		t.Fatal("a request to a closed port was answered")
	}
	_ = p.Send(dead, control.MsgAbort, control.AbortMsg{RequestID: 1, Generation: 1}.Encode())
	waitFor(t, "the connection to the dead peer dropped after PeerIdleTimeout", 10*time.Second, func() bool { return p.Stats().Peers == 0 })
}

// TestReconnectStartsWithGreeting: our connection to a peer drops while
// one-way messages are being sent to it. libzmq keeps a STREAM connection's
// queue across its reconnect, so messages written between the drop and
// the plane seeing its notice went out first on the new connection, before
// the greeting: 5 of 30 reconnections began with a message frame
// (01 10 4b 43 ...), which any ZMTP peer rejects as a bad greeting.
func TestReconnectStartsWithGreeting(t *testing.T) {
	p := newPlane(t, "127.0.0.1")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	t.Cleanup(func() { _ = ln.Close() })
	stop := make(chan struct{})
	flooded := make(chan struct{})
	t.Cleanup(func() { close(stop); <-flooded })
	abort := control.AbortMsg{RequestID: 1, Generation: 1}.Encode()
	go func() {
		defer close(flooded)
		for {
			select {
			case <-stop:
				return
			default:
			}
			_ = p.Send(ln.Addr().String(), control.MsgAbort, abort)
			time.Sleep(50 * time.Microsecond) // a steady stream, not a synchronization
		}
	}()
	const cycles = 40
	for i := 0; i < cycles; i++ {
		_ = ln.(*net.TCPListener).SetDeadline(time.Now().Add(10 * time.Second))
		c, err := ln.Accept()
		if err != nil {
			t.Fatalf("cycle %d: the plane did not reconnect: %v", i, err)
		}
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		first := make([]byte, 64)
		n, err := io.ReadFull(c, first)
		if n > 0 && first[0] != 0xff {
			t.Fatalf("cycle %d: the reconnected connection starts with %x, not a ZMTP greeting", i, first[:min(n, 20)])
		}
		if err != nil {
			// Closed by the plane before it sent anything: not a
			// connection it uses.
			_ = c.Close()
			i--
			continue
		}
		// Answer as a ROUTER, take one message, then reset the connection.
		_, _ = c.Write(zmtpHelloAs("ROUTER", ""))
		if _, err := io.ReadFull(c, make([]byte, 64)); err != nil { // READY and a message at least
			t.Fatalf("cycle %d: %v", i, err)
		}
		_ = c.(*net.TCPConn).SetLinger(0)
		_ = c.Close()
	}
}

// attackZombie opens KVFERRY_ATTACK_CONNS connections with a tiny receive
// buffer; on each it sends 3,000 PINGs it never reads the answers of (so
// that the target's send queue for it fills), then a frame with an invalid
// flag byte, a protocol error the target answers by closing the connection.
// It prints SENT and holds the connections until stdin closes.
func attackZombie(target string) error {
	n := envInt("KVFERRY_ATTACK_CONNS", 32)
	dialer := net.Dialer{Timeout: 5 * time.Second, Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		err := rc.Control(func(fd uintptr) { serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096) })
		if err != nil {
			return err
		}
		return serr
	}}
	var pings []byte
	for i := 0; i < 3000; i++ {
		pings = append(pings, 0x01, 16)
		pings = append(pings, control.EncodeEnvelope(control.Envelope{Type: control.MsgPing, Corr: uint64(i + 1)})...)
		pings = append(pings, longFrameHeader(8<<10, false)...)
		pings = append(pings, make([]byte, 8<<10)...)
	}
	var conns []net.Conn
	for i := 0; i < n; i++ {
		c, err := dialer.Dial("tcp", target)
		if err != nil {
			return err
		}
		if _, err := c.Write(append(append(zmtpHello(fmt.Sprintf("10.4.0.%d:1", i+1)), pings...), 0x80, 0)); err != nil {
			return err
		}
		conns = append(conns, c)
	}
	fmt.Println("SENT", n)
	waitStdin()
	for _, c := range conns {
		_ = c.Close()
	}
	return nil
}

// openFDs counts the process's open file descriptors.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	must(t, err)
	return len(ents)
}

// attackHangup opens KVFERRY_ATTACK_CONNS connections one after the other;
// each writes 80 bytes that are no ZMTP greeting and closes at once
// (every other one with a reset). It prints DONE.
func attackHangup(target string) error {
	n := envInt("KVFERRY_ATTACK_CONNS", 1000)
	for i := 0; i < n; i++ {
		c, err := net.Dial("tcp", target)
		if err != nil {
			return err
		}
		if _, err := c.Write([]byte("GET / HTTP/1.0\r\nHost: kvferry\r\nUser-Agent: a ZMTP greeting is 64 bytes\r\n\r\n")); err != nil {
			return err
		}
		if i%2 == 0 {
			_ = c.(*net.TCPConn).SetLinger(0)
		}
		_ = c.Close()
	}
	fmt.Println("DONE", n)
	waitStdin()
	return nil
}

// TestClosedConnectionsAreNotLeftOpen: 32 connections send 3,000 PINGs of
// 8 KiB without reading the answers, then a protocol error. The plane
// closed each by an empty message, which libzmq refuses (EAGAIN) while the
// connection's send queue is full, and forgot it: the 32 connections stayed
// open in libzmq (32 file descriptors more, each with its queue of 1,000
// replies, 8 MiB) while Stats said 0 connections, so a peer could open
// connections past every cap until the process ran out of descriptors.
func TestClosedConnectionsAreNotLeftOpen(t *testing.T) {
	p := newPlane(t, "127.0.0.1")
	before := openFDs(t)
	const n = 32
	sc, stop := startAttacker(t, "zombie", p.Name(), fmt.Sprintf("KVFERRY_ATTACK_CONNS=%d", n))
	expectLine(t, sc, "SENT")
	waitFor(t, "every attack connection cut", 30*time.Second, func() bool { return p.Stats().ConnsCut >= n })
	// The descriptors still open must be counted as connections (and so
	// against MaxConns): at most a few others come and go (the attacker's
	// pipes, the test's own).
	fds, s := openFDs(t), p.Stats()
	t.Logf("fds %d -> %d; stats %+v", before, fds, s)
	if fds-before > s.Conns+4 {
		t.Fatalf("%d more file descriptors open with %d connections counted: closed connections left open", fds-before, s.Conns)
	}
	stop()
	waitFor(t, "the connections gone once the attacker left", 10*time.Second, func() bool {
		return p.Stats().Conns == 0 && openFDs(t) <= before+4
	})
}

// TestHungUpConnectionsLeaveNoPhantoms: 1,000 connections each write a
// bad greeting and close. When the plane's close of one raced the peer's,
// libzmq refused the close (the pipe was already ending) and still
// delivered the connection's end notice, an empty message the plane took
// for a new connection: a phantom that held a connection slot (and its
// address's) until HandshakeTimeout. 512 phantoms in one run, and 416 of
// the connections refused as over the per-address cap of 256.
func TestHungUpConnectionsLeaveNoPhantoms(t *testing.T) {
	p, err := control.ListenWith("127.0.0.1", 0, control.Options{HandshakeTimeout: 30 * time.Second}, nil)
	must(t, err)
	p.Start()
	t.Cleanup(func() { _ = p.Close() })
	const n = 1000
	sc, _ := startAttacker(t, "hangup", p.Name(), fmt.Sprintf("KVFERRY_ATTACK_CONNS=%d", n))
	expectLine(t, sc, "DONE")
	// Each connection ends by its protocol error, its refusal or its end
	// notice; a phantom stays until HandshakeTimeout (30 s).
	waitFor(t, "no connection left (phantoms stay 30 s)", 10*time.Second, func() bool { return p.Stats().Conns == 0 })
	if s := p.Stats(); s.ConnsCut+s.ConnsRefused > n {
		t.Fatalf("%d connections cut or refused for %d opened: end notices were taken for new connections; stats %+v", s.ConnsCut+s.ConnsRefused, n, s)
	}
}
