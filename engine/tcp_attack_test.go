package engine_test

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/engine/transport/tcp"
	"github.com/kvferry/kvferry/internal/childproc"
)

// dataFrame is a tcp data-plane frame header (see engine/transport/tcp's
// wire.go): magic "KF", version 1, type, sequence, payload length, key,
// address.
func dataFrame(typ uint8, seq uint64, length uint32, key, addr uint64) []byte {
	b := make([]byte, tcp.HeaderSize)
	binary.LittleEndian.PutUint16(b[0:], 0x464b)
	b[2], b[3] = 1, typ
	binary.LittleEndian.PutUint64(b[8:], seq)
	binary.LittleEndian.PutUint32(b[28:], length)
	binary.LittleEndian.PutUint64(b[32:], key)
	binary.LittleEndian.PutUint64(b[40:], addr)
	return b
}

// dataFlood is the attacker process: count connections from 127.0.0.2 to
// the target's data port, each saying HELLO and then nothing, and one more
// that starts a 1 MiB WRITE and sends a byte every 100 ms. It reports how
// many of the idle ones the target closed at once, then waits for stdin to
// close, reporting when the slow one was cut.
func dataFlood(target, countStr string) error {
	n, err := strconv.Atoi(countStr)
	if err != nil {
		return err
	}
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.2")}, Timeout: 5 * time.Second}
	hello := append(dataFrame(1, 0, uint32(len("flood:1")), 0, 0), "flood:1"...)
	var conns []net.Conn
	for i := 0; i < n; i++ {
		c, err := d.Dial("tcp", target)
		if err != nil {
			return fmt.Errorf("connection %d: %w", i, err)
		}
		_, _ = c.Write(hello) // a refused one may already be closed
		conns = append(conns, c)
	}
	slow, err := net.Dial("tcp", target)
	if err != nil {
		return err
	}
	if _, err := slow.Write(append(hello, dataFrame(3, 1, 1<<20, 1, 4096)...)); err != nil {
		return err
	}
	cut := make(chan time.Duration, 1)
	go func() {
		start := time.Now()
		for {
			if _, err := slow.Write([]byte{0}); err != nil {
				cut <- time.Since(start)
				return
			}
			time.Sleep(100 * time.Millisecond) // the attack is to be slow
		}
	}()
	closed := 0
	for _, c := range conns {
		// A refused connection is closed before its HELLO is read; a
		// kept one answers HELLO_ACK.
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		var ack [tcp.HeaderSize]byte
		if _, err := io.ReadFull(c, ack[:]); err != nil || ack[3] != 2 {
			closed++
		}
	}
	fmt.Printf("OPENED %d CLOSED %d\n", len(conns), closed)
	fmt.Printf("SLOW CUT AFTER %v\n", (<-cut).Round(time.Millisecond))
	_, _ = io.Copy(io.Discard, os.Stdin)
	return nil
}

// TestDataPortFloodFromAnotherProcessIsBounded: a second process opens
// 3000 data connections that say HELLO and stay idle (they used to hold
// 3000 fds, 3000 goroutines and 74 MB for good), and one WRITE sent at 10
// bytes a second (it used to stay open for as long as it took). The owner
// keeps at most TCPMaxConnsPerPeer of them from that address, closes the
// idle ones after TCPIdleTimeout and the slow one by its frame deadline,
// and its fds and goroutines come back.
func TestDataPortFloodFromAnotherProcessIsBounded(t *testing.T) {
	const n, perPeer = 3000, 256
	victim := newEngineWith(t, engine.Options{IgnoreEnv: true, Protocol: "tcp",
		TCPMaxConnsPerPeer: perPeer, TCPIdleTimeout: 3 * time.Second, TCPFrameTimeout: time.Second})
	data, ok := victim.Descriptor().Transport("tcp")
	if !ok {
		t.Fatal("the victim has no tcp data address")
	}
	fds0, _ := countFDs(t)
	g0 := runtime.NumGoroutine()
	attacker := childproc.Start(t, childproc.Config{Name: "the attacker",
		Env: []string{helperEnv + "=data-flood", spoofTargetEnv + "=" + data, spoofCountEnv + "=" + strconv.Itoa(n)}})
	// The attack takes its time (3000 dials, a frame deadline): the
	// deadline only keeps a hung attacker from hanging the test.
	line := func() string { t.Helper(); return attacker.Line(t, 5*time.Minute) }
	opened := line()
	s := victim.Stats()
	t.Logf("attacker: %s; victim: %d data connections, %d refused", opened, s.DataConns, s.ConnsRefused)
	if want := fmt.Sprintf("OPENED %d CLOSED %d", n, n-perPeer); opened != want {
		t.Fatalf("attacker saw %q, want %q (%d kept from its address)", opened, want, perPeer)
	}
	if s.ConnsRefused != n-perPeer {
		t.Fatalf("%d connections refused, want %d", s.ConnsRefused, n-perPeer)
	}
	slow := line()
	t.Logf("attacker: %s", slow)
	if !strings.HasPrefix(slow, "SLOW CUT AFTER") {
		t.Fatalf("attacker: %q", slow)
	}
	// Should the owner keep a connection past its deadlines, the report
	// names the counters and where the owner's goroutines stand.
	deadline := time.Now().Add(30 * time.Second)
	for {
		s := victim.Stats()
		if s.DataConns == 0 && s.IdleClosed >= perPeer && s.FrameTimeouts >= 1 {
			break
		}
		if time.Now().After(deadline) {
			_ = pprof.Lookup("goroutine").WriteTo(os.Stderr, 1)
			t.Fatalf("the idle connections closed: not within 30s: %d data connections open, %d closed idle, %d frame timeouts",
				s.DataConns, s.IdleClosed, s.FrameTimeouts)
		}
		time.Sleep(time.Millisecond)
	}
	waitFor(t, 10*time.Second, "fds and goroutines back", func() bool {
		fds, _ := countFDs(t)
		return fds <= fds0+5 && runtime.NumGoroutine() <= g0+10
	})
	fds, _ := countFDs(t)
	t.Logf("fds %d -> %d, goroutines %d -> %d; stats %+v", fds0, fds, g0, runtime.NumGoroutine(), victim.Stats())
}
