package control_test

// Connections that end and come back: a name another peer claims, a plane's
// connection to itself, a peer that no longer listens, and what a
// reconnection sends first.

import (
	"io"
	"net"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/control"
)

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
