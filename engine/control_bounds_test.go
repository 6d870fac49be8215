package engine_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/control"
)

const (
	spoofTargetEnv = "KVFERRY_TEST_SPOOF_TARGET" // the victim's segment name
	spoofCountEnv  = "KVFERRY_TEST_SPOOF_COUNT"  // ABORTs to send, each from a new made-up name
)

// spoofAborts is the attacker process: count ABORTs, each on a new
// connection that names itself after a peer that does not exist and closes
// right after the ABORT, so the connection is gone when the ACK is due. It
// speaks ZMTP on a raw socket to close as early as TCP allows.
func spoofAborts(target, countStr string) error {
	count, err := strconv.Atoi(countStr)
	if err != nil {
		return fmt.Errorf("%s=%q", spoofCountEnv, countStr)
	}
	for i := 0; i < count; i++ {
		c, err := net.Dial("tcp", target)
		if err != nil {
			return err
		}
		name := fmt.Sprintf("10.255.%d.%d:9", i/250, i%250+1)
		env := control.EncodeEnvelope(control.Envelope{Type: control.MsgAbort, Corr: uint64(i + 1)})
		body := control.AbortMsg{RequestID: uint64(i + 1), Generation: 1}.Encode()
		if _, err := c.Write(zmtpHello(name)); err != nil {
			return err
		}
		// Wait for the victim's greeting and READY, so that it takes the
		// ABORT below as a message of a complete handshake.
		if err := readHello(c); err != nil {
			return err
		}
		var msg []byte
		msg = append(msg, 0x01, byte(len(env)))
		msg = append(msg, env...)
		msg = append(msg, 0x00, byte(len(body)))
		msg = append(msg, body...)
		if _, err := c.Write(msg); err != nil {
			return err
		}
		_ = c.Close()
	}
	return nil
}

// readHello reads a ZMTP 3 greeting and the READY command after it.
func readHello(c net.Conn) error {
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	defer func() { _ = c.SetReadDeadline(time.Time{}) }()
	buf := make([]byte, 64+2)
	if _, err := io.ReadFull(c, buf); err != nil {
		return fmt.Errorf("greeting: %w", err)
	}
	size := int(buf[65])
	if buf[64] != 0x04 {
		return fmt.Errorf("want a short READY command after the greeting, got flags %#x", buf[64])
	}
	_, err := io.ReadFull(c, make([]byte, size))
	return err
}

// zmtpHello is a ZMTP 3.0 NULL greeting and a READY as a DEALER named name.
func zmtpHello(name string) []byte {
	g := make([]byte, 64)
	g[0], g[9], g[10] = 0xff, 0x7f, 3
	copy(g[12:], "NULL")
	ready := append([]byte{5}, "READY"...)
	for _, p := range [][2]string{{"Socket-Type", "DEALER"}, {"Identity", name}} {
		ready = append(ready, byte(len(p[0])))
		ready = append(ready, p[0]...)
		ready = binary.BigEndian.AppendUint32(ready, uint32(len(p[1])))
		ready = append(ready, p[1]...)
	}
	return append(append(g, 0x04, byte(len(ready))), ready...)
}

// TestAbortsFromMadeUpSendersOpenNoSockets: a second process sends 300
// ABORTs, each from a sender name it made up and then goes away. Each
// ABORT_ACK used to dial the made-up name and keep that socket for ever
// (1,100 ABORTs cost 989 fds, until no segment could be opened); now an ACK
// goes over a connection that exists or is dropped.
func TestAbortsFromMadeUpSendersOpenNoSockets(t *testing.T) {
	const n = 300
	victim := newEngine(t)
	other := newEngine(t)
	before, _ := countFDs(t)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"=spoof-aborts", spoofTargetEnv+"="+victim.Name(), spoofCountEnv+"="+strconv.Itoa(n))
	cmd.Stderr = os.Stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("attacker process: %v", err)
	}
	waitFor(t, 30*time.Second, "every ABORT answered", func() bool {
		s := victim.Stats()
		return s.AbortsReceived == n && s.AbortAcksSent == n
	})
	// The control plane runs sends in order: once a segment opened after
	// the ACKs answers, every ACK before it was sent or dropped.
	seg, err := victim.OpenSegment(context.Background(), other.Name())
	if err != nil {
		t.Fatalf("open a segment after the attack: %v", err)
	}
	_ = victim.CloseSegment(seg)
	after, names := countFDs(t)
	s := victim.Stats()
	t.Logf("fds %d -> %d; control peers %d, sends dropped %d", before, after, s.ControlPeers, s.ControlSendFails)
	if after-before > 20 {
		t.Fatalf("%d ABORTs from made-up senders left %d more fds open:\n%v", n, after-before, names[max(0, len(names)-10):])
	}
	if s.ControlPeers > 1 {
		t.Fatalf("the victim holds %d control connections after the attack, want at most 1 (the segment it opened)", s.ControlPeers)
	}
}
