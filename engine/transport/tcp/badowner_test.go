package tcp

import (
	"context"
	"errors"
	"io"
	"net"
	"testing"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
)

// badOwner accepts one connection, completes the handshake, reads the first
// request frame and lets answer write whatever it likes.
func badOwner(t *testing.T, answer func(c net.Conn, h header)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	hold := make(chan struct{})
	t.Cleanup(func() { close(hold) })
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		var hb [HeaderSize]byte
		var h header
		_, _ = io.ReadFull(c, hb[:])
		_ = h.decode(hb[:])
		_, _ = io.ReadFull(c, make([]byte, h.length))
		_, _ = c.Write(frameOf(header{typ: frameHelloAck}))
		_, _ = io.ReadFull(c, hb[:])
		_ = h.decode(hb[:])
		if h.typ == frameWrite {
			_, _ = io.ReadFull(c, make([]byte, h.length))
		}
		answer(c, h)
		// Hold the connection until the test ends: the slice's outcome is
		// then the answer's, never the connection closing.
		<-hold
	}()
	return ln.Addr().String()
}

func frameOf(h header) []byte { b := make([]byte, HeaderSize); h.encode(b); return b }

func postOne(t *testing.T, addr string, op transport.Op, mem []byte) error {
	t.Helper()
	regs, err := memory.NewRegistry().Register([]memory.Range{{Mem: mem}})
	if err != nil {
		t.Fatal(err)
	}
	tr := New(Options{})
	t.Cleanup(func() { tr.Close() })
	ep, err := tr.Dial(context.Background(), addr, "me:1")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	ep.Post([]*transport.Slice{{Op: op, Local: mem, LocalReg: regs[0], Done: func(_ *transport.Slice, err error) { done <- err }}})
	return outcome(t, done)
}

// An owner answering a WRITE with READ_DATA must not write into the
// WRITE's source buffer: the path fails instead.
func TestReadDataForAWriteNeverLandsInItsSource(t *testing.T) {
	src := make([]byte, 64)
	for i := range src {
		src[i] = 0x11
	}
	addr := badOwner(t, func(c net.Conn, h header) {
		payload := make([]byte, h.length)
		for i := range payload {
			payload[i] = 0xee
		}
		_, _ = c.Write(append(frameOf(header{typ: frameReadData, seq: h.seq, length: h.length}), payload...))
		_, _ = c.Write(frameOf(header{typ: frameWriteAck, seq: h.seq, done: uint64(h.length)}))
	})
	err := postOne(t, addr, transport.Write, src)
	if !errors.Is(err, transport.ErrConnection) {
		t.Fatalf("WRITE answered with READ_DATA ended with %v, want a failed path", err)
	}
	for i, b := range src {
		if b != 0x11 {
			t.Fatalf("source byte %d changed to %#x", i, b)
		}
	}
}

// A READ_DONE that reports success without any READ_DATA fails the READ.
func TestReadDoneWithoutDataFailsTheRead(t *testing.T) {
	addr := badOwner(t, func(c net.Conn, h header) {
		_, _ = c.Write(frameOf(header{typ: frameReadDone, seq: h.seq, done: uint64(h.length)}))
	})
	if err := postOne(t, addr, transport.Read, make([]byte, 64)); err == nil {
		t.Fatal("a READ without data completed")
	}
}
