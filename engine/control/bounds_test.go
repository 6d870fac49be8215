package control_test

// What a peer, or a second process without credentials, can make a control
// plane spend is bounded: buffers, connections, queued replies, file
// descriptors; and such a peer does not starve the plane's own requests.

import (
	"bytes"
	"crypto/rand"
	"fmt"
	"log/slog"
	"net"
	"os"
	"runtime/debug"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/control"
)

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
