package control_test

// What a peer with no credentials can make a plane spend, attacked from a
// second process (this test binary run again as the attacker): memory for
// messages still arriving, connections, and time.

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvferry/kvferry/engine/control"
)

const attackerEnv = "KVFERRY_CONTROL_ATTACKER"

// TestAttackerProcess is the attacker when the test binary runs as a child
// (attackerEnv set); as a test of its own it does nothing.
func TestAttackerProcess(t *testing.T) {
	mode := os.Getenv(attackerEnv)
	if mode == "" {
		t.Skip("the attacker side of the bounds tests; runs only as their child process")
	}
	target := os.Getenv("KVFERRY_CONTROL_TARGET")
	var err error
	switch mode {
	case "multipart":
		err = attackMultipart(target)
	case "conns":
		err = attackConns(target)
	case "stall":
		err = attackStall(target)
	default:
		if f, ok := reviewAttacks[mode]; ok {
			err = f(target)
		} else {
			err = fmt.Errorf("unknown attack %q", mode)
		}
	}
	if err != nil {
		fmt.Println("ATTACK FAILED:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// startAttacker runs the attack mode against target in a child process and
// returns its stdout (one line per step) and a function that ends it (it
// also ends when stdin closes).
func startAttacker(t *testing.T, mode, target string, extra ...string) (*bufio.Scanner, func()) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestAttackerProcess$", "-test.v=false")
	cmd.Env = append(os.Environ(), attackerEnv+"="+mode, "KVFERRY_CONTROL_TARGET="+target)
	cmd.Env = append(cmd.Env, extra...)
	stdin, err := cmd.StdinPipe()
	must(t, err)
	stdout, err := cmd.StdoutPipe()
	must(t, err)
	cmd.Stderr = os.Stderr
	must(t, cmd.Start())
	stop := func() {
		_ = stdin.Close()
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	}
	t.Cleanup(stop)
	return bufio.NewScanner(stdout), stop
}

// expectLine reads the attacker's next line and fails unless it starts
// with want.
func expectLine(t *testing.T, sc *bufio.Scanner, want string) string {
	t.Helper()
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "ATTACK FAILED") {
			t.Fatalf("attacker: %s", line)
		}
		if strings.HasPrefix(line, want) {
			return line
		}
	}
	t.Fatalf("attacker ended before %q: %v", want, sc.Err())
	return ""
}

// waitStdin blocks until the parent closes our stdin (or it ends).
func waitStdin() { _, _ = io.Copy(io.Discard, os.Stdin) }

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

// zmtpHello is what a raw attacker sends first: a ZMTP 3.0 NULL greeting
// and a READY as a DEALER named name.
func zmtpHello(name string) []byte {
	g := make([]byte, 64)
	g[0], g[9], g[10] = 0xff, 0x7f, 3
	copy(g[12:], "NULL")
	var ready []byte
	ready = append(ready, 5)
	ready = append(ready, "READY"...)
	for _, p := range [][2]string{{"Socket-Type", "DEALER"}, {"Identity", name}} {
		ready = append(ready, byte(len(p[0])))
		ready = append(ready, p[0]...)
		ready = binary.BigEndian.AppendUint32(ready, uint32(len(p[1])))
		ready = append(ready, p[1]...)
	}
	return append(append(g, 0x04, byte(len(ready))), ready...)
}

// longFrameHeader is the header of a ZMTP frame of n bytes (long form).
func longFrameHeader(n uint64, more bool) []byte {
	flags := byte(0x02)
	if more {
		flags |= 0x01
	}
	return binary.BigEndian.AppendUint64([]byte{flags}, n)
}

// attackConns opens KVFERRY_ATTACK_CONNS connections from 127.0.0.2 that
// say hello and stay, reports how many the target closed, then holds the
// rest until stdin closes.
func attackConns(target string) error {
	n, _ := strconv.Atoi(os.Getenv("KVFERRY_ATTACK_CONNS"))
	dialer := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.2")}, Timeout: 5 * time.Second}
	var conns []net.Conn
	for i := 0; i < n; i++ {
		c, err := dialer.Dial("tcp", target)
		if err != nil {
			return err
		}
		if _, err := c.Write(zmtpHello(fmt.Sprintf("10.0.0.%d:1", i))); err != nil {
			return err
		}
		conns = append(conns, c)
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
	fmt.Println("CLOSED", closed)
	waitStdin()
	for _, c := range conns {
		_ = c.Close()
	}
	return nil
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

// peakRSS returns the process's peak resident set (VmHWM) in bytes.
func peakRSS(t *testing.T) uint64 {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	must(t, err)
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "VmHWM:") {
			kb, err := strconv.ParseUint(strings.Fields(l)[1], 10, 64)
			must(t, err)
			return kb << 10
		}
	}
	t.Fatal("no VmHWM in /proc/self/status")
	return 0
}

// TestMultipartFloodIsNotBuffered: a 200-frame message of 1 MiB frames
// from a second process. libzmq's ROUTER kept every frame until the last
// (the owner's RSS went from 13 to 208 MiB); the plane must drop the
// message as it streams past, keep its peak memory far below what was sent,
// and go on answering.
func TestMultipartFloodIsNotBuffered(t *testing.T) {
	p := newPlane(t, "127.0.0.1")
	// Reset the peak so that VmHWM measures from here.
	if err := os.WriteFile("/proc/self/clear_refs", []byte("5"), 0); err != nil {
		t.Skipf("cannot reset the peak RSS (/proc/self/clear_refs): %v", err)
	}
	before := peakRSS(t)
	sc, _ := startAttacker(t, "multipart", p.Name())
	expectLine(t, sc, "SENT")
	waitFor(t, "the 200-frame message dropped", 30*time.Second, func() bool { return p.Stats().Malformed >= 1 })
	grew := peakRSS(t) - before
	t.Logf("peak RSS grew by %.1f MiB for a 200 MiB message; stats %+v", float64(grew)/(1<<20), p.Stats())
	if grew > 64<<20 {
		t.Fatalf("peak RSS grew by %d MiB for a 200 MiB message: the plane buffered it", grew>>20)
	}
	pingOverDealer(t, rawDealer(t, zctx(t), p.Name()), 2)
}

// TestControlConnectionsAreCappedPerAddressAndInTotal: 40 connections from
// 127.0.0.2 get 8 slots (the per-address cap); a peer from 127.0.0.1 still
// gets one, and the slots come back when the attacker leaves.
func TestControlConnectionsAreCappedPerAddressAndInTotal(t *testing.T) {
	lc := &logCounter{}
	p, err := control.ListenWith("127.0.0.1", 0, control.Options{MaxConns: 10, MaxConnsPerHost: 8}, slog.New(lc))
	must(t, err)
	p.Handle(control.MsgPing, func(_ string, b []byte) (control.MsgType, []byte) { return control.MsgPong, b })
	p.Start()
	t.Cleanup(func() { _ = p.Close() })
	sc, stop := startAttacker(t, "conns", p.Name(), "KVFERRY_ATTACK_CONNS=40")
	expectLine(t, sc, "OPENED")
	line := expectLine(t, sc, "CLOSED")
	if line != "CLOSED 32" {
		t.Fatalf("attacker saw %q of 40 connections closed, want 32 (8 kept per address)", line)
	}
	if s := p.Stats(); s.Conns != 8 || s.ConnsRefused != 32 {
		t.Fatalf("stats %+v: want 8 connections and 32 refused", s)
	}
	if w := lc.warns.Load(); w < 1 || w > 10 {
		t.Errorf("%d warnings for 32 refused connections: want at least one, rate-limited", w)
	}
	// Another address still gets in, up to the total cap of 10.
	other := newPlane(t, "127.0.0.1")
	if _, _, err := other.Request(ctxFor(t, 5*time.Second), p.Name(), control.MsgPing, []byte("x")); err != nil {
		t.Fatalf("a peer from another address was refused: %v", err)
	}
	stop()
	waitFor(t, "the attacker's connections gone", 10*time.Second, func() bool { return p.Stats().Conns == 1 })
}

// TestStalledControlConnectionsAreCut: a connection that never says hello,
// and one that sends a message at a byte a second, are closed by their
// deadlines.
func TestStalledControlConnectionsAreCut(t *testing.T) {
	p, err := control.ListenWith("127.0.0.1", 0, control.Options{HandshakeTimeout: 300 * time.Millisecond, MessageTimeout: 1500 * time.Millisecond}, nil)
	must(t, err)
	p.Start()
	t.Cleanup(func() { _ = p.Close() })
	sc, _ := startAttacker(t, "stall", p.Name())
	start := time.Now()
	expectLine(t, sc, "SILENT CLOSED")
	expectLine(t, sc, "SLOW CLOSED")
	t.Logf("both cut within %v; stats %+v", time.Since(start), p.Stats())
	waitFor(t, "both counted", 5*time.Second, func() bool { s := p.Stats(); return s.ConnsCut == 2 && s.Conns == 0 && s.BufferedBytes == 0 })
}

// TestBufferBudgetSparesSmallMessages: while large messages in progress
// hold the whole budget, another large one is dropped unread and counted,
// and small requests are still answered.
func TestBufferBudgetSparesSmallMessages(t *testing.T) {
	p, err := control.ListenWith("127.0.0.1", 0, control.Options{BufferBytes: 2 << 20}, nil)
	must(t, err)
	p.Handle(control.MsgPing, func(_ string, b []byte) (control.MsgType, []byte) { return control.MsgPong, b })
	p.Start()
	t.Cleanup(func() { _ = p.Close() })
	start := func(name string, size uint64) net.Conn {
		c, err := net.Dial("tcp", p.Name())
		must(t, err)
		t.Cleanup(func() { _ = c.Close() })
		msg := append(zmtpHello(name), 0x01, 16)
		msg = append(msg, control.EncodeEnvelope(control.Envelope{Type: control.MsgPing, Corr: 1})...)
		msg = append(msg, longFrameHeader(size, false)...)
		msg = append(msg, make([]byte, 1000)...)
		_, err = c.Write(msg)
		must(t, err)
		return c
	}
	start("127.0.0.1:1", 1<<20)
	start("127.0.0.1:2", 1<<20)
	waitFor(t, "2 MiB held", 5*time.Second, func() bool { return p.Stats().BufferedBytes == 2<<20 })
	start("127.0.0.1:3", 1<<20)
	waitFor(t, "the third refused", 5*time.Second, func() bool { return p.Stats().OverBudget == 1 })
	if b := p.Stats().BufferedBytes; b != 2<<20 {
		t.Fatalf("%d bytes held, want the budget of %d", b, 2<<20)
	}
	other := newPlane(t, "127.0.0.1")
	if _, _, err := other.Request(ctxFor(t, 5*time.Second), p.Name(), control.MsgPing, bytes.Repeat([]byte("s"), 60<<10)); err != nil {
		t.Fatalf("a 60 KiB request was not answered while large messages held the budget: %v", err)
	}
}
