package control_test

// The attacker's side of the bounds tests: the test binary run again as a
// child process (attackerEnv names the attack), its modes' helpers, and what
// the tests measure of the target (resident memory, open descriptors).

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"
)

const attackerEnv = "KVFERRY_CONTROL_ATTACKER"

// attacks are the attacker modes, by the name attackerEnv carries, run by
// TestAttackerProcess in the child process.
var attacks = map[string]func(target string) error{
	"multipart":   attackMultipart,
	"conns":       attackConns,
	"stall":       attackStall,
	"unread":      attackUnread,
	"budget-hold": attackBudgetHold,
	"flood":       attackFlood,
	"claim":       attackClaim,
	"zombie":      attackZombie,
	"hangup":      attackHangup,
}

// TestAttackerProcess is the attacker when the test binary runs as a child
// (attackerEnv set); as a test of its own it does nothing.
func TestAttackerProcess(t *testing.T) {
	mode := os.Getenv(attackerEnv)
	if mode == "" {
		t.Skip("the attacker side of the bounds tests; runs only as their child process")
	}
	target := os.Getenv("KVFERRY_CONTROL_TARGET")
	attack, ok := attacks[mode]
	if !ok {
		attack = func(string) error { return fmt.Errorf("unknown attack %q", mode) }
	}
	err := attack(target)
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

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil {
		return v
	}
	return def
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

// longFrameHeader is the header of a ZMTP frame of n bytes (long form).
func longFrameHeader(n uint64, more bool) []byte {
	flags := byte(0x02)
	if more {
		flags |= 0x01
	}
	return binary.BigEndian.AppendUint64([]byte{flags}, n)
}

// rss returns the process's resident set (VmRSS) in bytes.
func rss(t *testing.T) uint64 { return procStatusBytes(t, "VmRSS") }

// peakRSS returns the process's peak resident set (VmHWM) in bytes.
func peakRSS(t *testing.T) uint64 { return procStatusBytes(t, "VmHWM") }

// procStatusBytes returns field of /proc/self/status (a size in kB) in bytes.
func procStatusBytes(t *testing.T, field string) uint64 {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	must(t, err)
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, field+":") {
			kb, err := strconv.ParseUint(strings.Fields(l)[1], 10, 64)
			must(t, err)
			return kb << 10
		}
	}
	t.Fatalf("no %s in /proc/self/status", field)
	return 0
}

// openFDs counts the process's open file descriptors.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	must(t, err)
	return len(ents)
}
