package tcp_test

import (
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/engine/transport/tcp"
	"github.com/kvferry/kvferry/engine/transport/transporttest"
)

// waitFor polls cond until it holds, failing the test after d.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(d); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, d)
		}
	}
}

// ownerWith serves owner (an empty registry's when nil) on a transport
// with opts and returns it and its address.
func ownerWith(t *testing.T, opts tcp.Options, owner transport.Owner) (*tcp.Transport, string) {
	t.Helper()
	if owner == nil {
		owner = transporttest.NewOwner(memory.NewRegistry())
	}
	tr := tcp.New(opts)
	addr, err := tr.Listen(owner)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tr.Close() })
	return tr, addr
}

// dialFrom opens a raw connection to addr from the local IP from ("" for
// any); it is closed when the test ends.
func dialFrom(t *testing.T, addr, from string) *net.TCPConn {
	t.Helper()
	d := net.Dialer{Timeout: 5 * time.Second}
	if from != "" {
		d.LocalAddr = &net.TCPAddr{IP: net.ParseIP(from)}
	}
	nc, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatalf("dial %s from %q: %v", addr, from, err)
	}
	c := nc.(*net.TCPConn)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// helloFrame is an initiator's HELLO for name.
func helloFrame(name string) []byte {
	return append(rawFrame(1, 0, uint32(len(name)), 0, 0), name...)
}

// sayHello sends HELLO on c and reads the owner's HELLO_ACK; it returns the
// error of either step.
func sayHello(c net.Conn, name string) error {
	if _, err := c.Write(helloFrame(name)); err != nil {
		return err
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	defer c.SetReadDeadline(time.Time{})
	var ack [tcp.HeaderSize]byte
	if _, err := io.ReadFull(c, ack[:]); err != nil {
		return err
	}
	if ack[3] != 2 {
		return errors.New("HELLO answered with something else than HELLO_ACK")
	}
	return nil
}

// requireClosed fails the test unless the owner closes c within d, reading
// and dropping what it sends meanwhile; it returns how long that took.
func requireClosed(t *testing.T, c net.Conn, d time.Duration, what string) time.Duration {
	t.Helper()
	start := time.Now()
	_ = c.SetReadDeadline(start.Add(d))
	_, err := io.Copy(io.Discard, c)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Fatalf("%s: the connection is still open after %v", what, d)
	}
	return time.Since(start)
}
