package tcp_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"github.com/kvferry/kvferry/engine/auth/authtest"
	"io"
	"net"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport/tcp"
	"github.com/kvferry/kvferry/engine/transport/transporttest"
)

// relayFrame copies one frame (header and payload) from src to dst and
// returns its header.
func relayFrame(t *testing.T, dst, src net.Conn) []byte {
	t.Helper()
	_ = src.SetReadDeadline(time.Now().Add(5 * time.Second))
	h := make([]byte, tcp.HeaderSize)
	if _, err := io.ReadFull(src, h); err != nil {
		t.Fatalf("relay: header: %v", err)
	}
	p := make([]byte, binary.LittleEndian.Uint32(h[28:]))
	if _, err := io.ReadFull(src, p); err != nil {
		t.Fatalf("relay: payload: %v", err)
	}
	if _, err := dst.Write(append(append([]byte(nil), h...), p...)); err != nil {
		t.Fatalf("relay: write: %v", err)
	}
	return h
}

// A process with no allowed key that gets an allowed engine to dial it (it
// holds a port an owner left, or an address a descriptor still names)
// relays that engine's handshake to another owner, to keep the connection
// the owner would authenticate. The handshake names the address the
// initiator dialed, under its MAC, and the owner refuses one that is not
// its own: the relay gets no connection and writes nothing.
func TestARelayedHandshakeGivesTheRelayNoDataConnection(t *testing.T) {
	victim, target := authtest.NewIdentity(t), authtest.NewIdentity(t)
	ta, _ := authtest.New(t, target, victim.Public)
	va, _ := authtest.New(t, victim, target.Public)
	reg := memory.NewRegistry()
	_, targetAddr := ownerWith(t, tcp.Options{Auth: ta}, transporttest.NewOwner(reg))
	g := newGuarded(t, reg)

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	relayed := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			relayed <- nil
			return
		}
		relayed <- c
	}()
	tr := tcp.New(tcp.Options{Auth: va})
	t.Cleanup(func() { _ = tr.Close() })
	dialed := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		ep, err := tr.Dial(ctx, ln.Addr().String(), "victim:1")
		if err == nil {
			_ = ep.Close()
		}
		dialed <- err
	}()
	down := <-relayed
	if down == nil {
		t.Fatal("the victim never dialed the relay")
	}
	defer down.Close()
	up := dialFrom(t, targetAddr, "")

	relayFrame(t, up, down) // HELLO
	if first := relayFrame(t, down, up); first[3] == 2 {
		// HELLO_ACK instead of CHALLENGE: the owner refused at once.
		_ = down.Close()
		if err := <-dialed; err == nil {
			t.Fatal("the victim's Dial succeeded through a relay the owner refused")
		}
		g.untouched(t, "a relayed handshake")
		return
	}
	relayFrame(t, up, down)        // AUTH
	ack := relayFrame(t, down, up) // HELLO_ACK
	_ = down.Close()
	<-dialed
	if ack[3] != 2 || binary.LittleEndian.Uint32(ack[4:]) != 0 {
		return // the owner refused the relayed handshake
	}

	// The relay now speaks on the owner's authenticated connection.
	payload := bytes.Repeat([]byte{0xee}, 64)
	if _, err := up.Write(append(rawFrame(3, 1, uint32(len(payload)), g.reg.Key, g.reg.Addr), payload...)); err != nil {
		t.Fatal(err)
	}
	_ = up.SetReadDeadline(time.Now().Add(5 * time.Second))
	var wack [tcp.HeaderSize]byte
	_, _ = io.ReadFull(up, wack[:]) // WRITE_ACK, or the close of a refusal
	g.untouched(t, "a WRITE from a relay that holds no allowed key")
}
