package control_test

// The attacks a second process runs against a control plane: floods,
// unread replies, held budgets, stalls, claimed names, zombie and hung-up
// connections. Each prints a word once it is in place, so the test knows
// when to measure.

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"syscall"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvferry/kvferry/engine/control"
)

// attackMultipart sends one PING of 200 frames of 1 MiB from a libzmq
// DEALER: libzmq's ROUTER held all of it until the last frame arrived.
func attackMultipart(target string) error {
	c, err := zmq.NewContext()
	if err != nil {
		return err
	}
	d, err := c.NewSocket(zmq.DEALER)
	if err != nil {
		return err
	}
	_ = d.SetIdentity("127.0.0.1:9")
	_ = d.SetSndhwm(0)
	if err := d.Connect("tcp://" + target); err != nil {
		return err
	}
	frame := bytes.Repeat([]byte{0xab}, 1<<20)
	parts := []any{control.EncodeEnvelope(control.Envelope{Type: control.MsgPing, Corr: 1})}
	for i := 0; i < 200; i++ {
		parts = append(parts, frame)
	}
	if _, err := d.SendMessage(parts...); err != nil {
		return err
	}
	// Close with an unbounded linger: it returns once libzmq handed every
	// byte to the kernel, which the target must have read for the most
	// part (socket buffers are a few MiB).
	_ = d.SetLinger(-1)
	if err := d.Close(); err != nil {
		return err
	}
	fmt.Println("SENT 200 MiB")
	waitStdin()
	return c.Term()
}

// attackConns opens KVFERRY_ATTACK_CONNS connections from 127.0.0.2 that
// say hello and stay, reports how many the target closed, then holds the
// rest until stdin closes.
func attackConns(target string) error {
	n, _ := strconv.Atoi(os.Getenv("KVFERRY_ATTACK_CONNS"))
	dialer := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.2")}, Timeout: 5 * time.Second}
	conns, err := dialAll(dialer, target, n, func(i int) []byte { return zmtpHello(fmt.Sprintf("10.0.0.%d:1", i)) })
	if err != nil {
		return err
	}
	fmt.Println("OPENED", len(conns))
	closed := 0
	buf := make([]byte, 4096)
	for _, c := range conns {
		// A refused connection is closed at once; a kept one sends its
		// greeting and READY and then nothing.
		_ = c.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
		for {
			if _, err := c.Read(buf); err != nil {
				if ne, ok := err.(net.Error); !ok || !ne.Timeout() {
					closed++
				}
				break
			}
		}
	}
	return holdUntilStdin(conns, "CLOSED", closed)
}

// attackStall opens one connection that never completes the handshake and
// one that starts a 1 MiB message and sends a byte a second, and reports
// when the target closed each.
func attackStall(target string) error {
	silent, err := net.Dial("tcp", target)
	if err != nil {
		return err
	}
	slow, err := net.Dial("tcp", target)
	if err != nil {
		return err
	}
	msg := append(zmtpHello("127.0.0.1:9"), 0x01, 16) // envelope frame, more
	msg = append(msg, control.EncodeEnvelope(control.Envelope{Type: control.MsgPing, Corr: 7})...)
	msg = append(msg, longFrameHeader(1<<20, false)...)
	if _, err := slow.Write(msg); err != nil {
		return err
	}
	ended := make(chan string, 2)
	go func() { _, _ = io.Copy(io.Discard, silent); ended <- "SILENT CLOSED" }()
	go func() {
		for {
			if _, err := slow.Write([]byte{0}); err != nil {
				return
			}
			time.Sleep(time.Second) // the attack is to be slow, not a synchronization
		}
	}()
	go func() { _, _ = io.Copy(io.Discard, slow); ended <- "SLOW CLOSED" }()
	fmt.Println(<-ended)
	fmt.Println(<-ended)
	waitStdin()
	return nil
}

// attackUnread opens KVFERRY_ATTACK_CONNS connections with a tiny receive
// buffer; each sends KVFERRY_ATTACK_REQS GET_DESCRIPTOR requests (18 bytes
// each) and never reads a reply. It prints SENT, then holds the connections
// until stdin closes.
func attackUnread(target string) error {
	n := envInt("KVFERRY_ATTACK_CONNS", 16)
	reqs := envInt("KVFERRY_ATTACK_REQS", 3000)
	var req []byte
	for i := 0; i < reqs; i++ {
		req = append(req, 0x00, 16)
		req = append(req, control.EncodeEnvelope(control.Envelope{Type: control.MsgGetDescriptor, Corr: uint64(i + 1)})...)
	}
	conns, err := dialAll(tinyReceiveBuffer(), target, n, func(i int) []byte {
		return append(zmtpHello(fmt.Sprintf("10.1.0.%d:1", i+1)), req...)
	})
	if err != nil {
		return err
	}
	return holdUntilStdin(conns, "SENT", n*reqs)
}

// attackBudgetHold opens KVFERRY_ATTACK_CONNS connections; on each it sends
// a hello, an envelope frame and only the 9-byte header of a 16 MiB body
// frame, then nothing. It prints HELD and keeps them until stdin closes.
func attackBudgetHold(target string) error {
	n := envInt("KVFERRY_ATTACK_CONNS", 8)
	conns, err := dialAll(&net.Dialer{}, target, n, func(i int) []byte {
		msg := append(zmtpHello(fmt.Sprintf("10.2.0.%d:1", i+1)), 0x01, 16)
		msg = append(msg, control.EncodeEnvelope(control.Envelope{Type: control.MsgPing, Corr: 1})...)
		return append(msg, longFrameHeader(control.MaxBody, false)...)
	})
	if err != nil {
		return err
	}
	return holdUntilStdin(conns, "HELD", n)
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
	conns, err := dialAll(&net.Dialer{}, target, n, func(i int) []byte { return zmtpHello(fmt.Sprintf("10.3.0.%d:1", i+1)) })
	if err != nil {
		return err
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
	return holdUntilStdin(conns, "FLOODING")
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

// attackZombie opens KVFERRY_ATTACK_CONNS connections with a tiny receive
// buffer; on each it sends 3,000 PINGs it never reads the answers of (so
// that the target's send queue for it fills), then a frame with an invalid
// flag byte, a protocol error the target answers by closing the connection.
// It prints SENT and holds the connections until stdin closes.
func attackZombie(target string) error {
	n := envInt("KVFERRY_ATTACK_CONNS", 32)
	var pings []byte
	for i := 0; i < 3000; i++ {
		pings = append(pings, 0x01, 16)
		pings = append(pings, control.EncodeEnvelope(control.Envelope{Type: control.MsgPing, Corr: uint64(i + 1)})...)
		pings = append(pings, longFrameHeader(8<<10, false)...)
		pings = append(pings, make([]byte, 8<<10)...)
	}
	conns, err := dialAll(tinyReceiveBuffer(), target, n, func(i int) []byte {
		return append(append(zmtpHello(fmt.Sprintf("10.4.0.%d:1", i+1)), pings...), 0x80, 0)
	})
	if err != nil {
		return err
	}
	return holdUntilStdin(conns, "SENT", n)
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

// tinyReceiveBuffer is a dialer whose connections have a 4 KiB receive
// buffer: replies the attacker never reads fill it at once, and the target's
// send queue for the connection next.
func tinyReceiveBuffer() *net.Dialer {
	return &net.Dialer{Timeout: 5 * time.Second, Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		err := rc.Control(func(fd uintptr) { serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096) })
		if err != nil {
			return err
		}
		return serr
	}}
}

// dialAll opens n connections to target with d and writes msg(i) on the
// i-th.
func dialAll(d *net.Dialer, target string, n int, msg func(i int) []byte) ([]net.Conn, error) {
	var conns []net.Conn
	for i := 0; i < n; i++ {
		c, err := d.Dial("tcp", target)
		if err != nil {
			return conns, err
		}
		conns = append(conns, c)
		if _, err := c.Write(msg(i)); err != nil {
			return conns, err
		}
	}
	return conns, nil
}

// holdUntilStdin prints line, the attacker's report to the test, and holds
// conns until stdin closes.
func holdUntilStdin(conns []net.Conn, line ...any) error {
	fmt.Println(line...)
	waitStdin()
	for _, c := range conns {
		_ = c.Close()
	}
	return nil
}
