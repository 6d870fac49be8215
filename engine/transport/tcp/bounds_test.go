package tcp_test

// What a peer can make a tcp owner hold is bounded: connections per address
// and in total, idle connections, frames sent too slowly; and a slow but
// honest link above MinRate is never cut, large slices included.

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/engine/transport/tcp"
	"github.com/kvferry/kvferry/engine/transport/transporttest"
)

// The owner accepts at most MaxConnsPerPeer connections from one IP address
// and MaxConns in all; one past either is closed before it is served, and
// counted. Closing a connection frees its place.
func TestDataConnectionsAreCappedPerAddressAndInTotal(t *testing.T) {
	srv, addr := ownerWith(t, tcp.Options{MaxConnsPerPeer: 3, MaxConns: 5}, nil)
	var first []*net.TCPConn
	for i := range 3 {
		c := dialFrom(t, addr, "127.0.0.1")
		if err := sayHello(c, "a:1"); err != nil {
			t.Fatalf("connection %d from 127.0.0.1: %v", i+1, err)
		}
		first = append(first, c)
	}
	c := dialFrom(t, addr, "127.0.0.1")
	if err := sayHello(c, "a:1"); err == nil {
		t.Fatal("a fourth connection from 127.0.0.1 was served, with MaxConnsPerPeer 3")
	}
	if st := srv.Stats(); st.RefusedPerPeer != 1 || st.Conns != 3 {
		t.Fatalf("stats %+v, want 1 refused per peer and 3 open", st)
	}

	// Another address gets in, up to the total.
	for i := range 2 {
		if err := sayHello(dialFrom(t, addr, "127.0.0.2"), "b:1"); err != nil {
			t.Fatalf("connection %d from 127.0.0.2: %v", i+1, err)
		}
	}
	if err := sayHello(dialFrom(t, addr, "127.0.0.3"), "c:1"); err == nil {
		t.Fatal("a sixth connection was served, with MaxConns 5")
	}
	if st := srv.Stats(); st.RefusedTotal != 1 || st.Conns != 5 {
		t.Fatalf("stats %+v, want 1 refused in total and 5 open", st)
	}

	_ = first[0].Close()
	waitFor(t, 5*time.Second, "the closed connection counted out", func() bool { return srv.Stats().Conns == 4 })
	if err := sayHello(dialFrom(t, addr, "127.0.0.1"), "a:1"); err != nil {
		t.Fatalf("after one of its connections closed, 127.0.0.1 is still refused: %v", err)
	}
}

// A connection that said HELLO and then sends nothing is closed after
// IdleTimeout, and counted; its place is given back.
func TestIdleConnectionIsClosed(t *testing.T) {
	const idle = 200 * time.Millisecond
	srv, addr := ownerWith(t, tcp.Options{IdleTimeout: idle}, nil)
	c := dialFrom(t, addr, "")
	if err := sayHello(c, "idle:1"); err != nil {
		t.Fatal(err)
	}
	took := requireClosed(t, c, 10*time.Second, "an idle connection")
	if took < idle/2 {
		t.Errorf("closed after %v, before its idle timeout of %v", took, idle)
	}
	waitFor(t, 5*time.Second, "the idle connection counted", func() bool {
		st := srv.Stats()
		return st.IdleClosed == 1 && st.Conns == 0
	})
}

// A request that takes the owner longer than IdleTimeout (held at
// admission, or slow to copy) is not idleness: it completes, and the
// connection serves the next one. The owner waits for the first WRITE (its
// idle deadline armed), then both WRITEs come in one write, so it never
// waits between them: only the request in progress could look idle. (With
// a 50 ms idle timeout and the second WRITE sent after the first one's
// answer, a client slower than 50 ms under load failed the test.)
func TestRequestInProgressIsNotIdle(t *testing.T) {
	const idle = 500 * time.Millisecond
	const size = 1 << 20 // copied in two chunks at least
	for _, slow := range []string{"admission", "copy"} {
		t.Run(slow, func(t *testing.T) {
			mem := make([]byte, size)
			reg := memory.NewRegistry()
			regs, err := reg.Register([]memory.Range{{Mem: mem}})
			if err != nil {
				t.Fatal(err)
			}
			owner := transporttest.NewOwner(reg)
			srv, addr := ownerWith(t, tcp.Options{IdleTimeout: idle}, owner)
			c := dialFrom(t, addr, "")
			if err := sayHello(c, "slow:1"); err != nil {
				t.Fatal(err)
			}
			writeFrame := func(seq uint64) []byte {
				return append(rawFrame(3, seq, size, regs[0].Key, memory.AddrOf(mem)), make([]byte, size)...)
			}
			var release func()
			if slow == "admission" {
				release = owner.Hold()
			} else {
				var once sync.Once
				owner.OnEnter(func() { once.Do(func() { time.Sleep(4 * idle) }) }) // the first chunk's copy outlasts the idle timeout
			}
			stream := append(writeFrame(1), writeFrame(2)...)
			go func() { _, _ = c.Write(stream) }()
			if release != nil {
				waitFor(t, 5*time.Second, "the WRITE held at admission", func() bool { return owner.Waiting.Load() == 1 })
				time.Sleep(4 * idle) // the request stays in progress past the idle timeout
				release()
			}
			for seq := uint64(1); seq <= 2; seq++ {
				_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
				var ack [tcp.HeaderSize]byte
				if _, err := io.ReadFull(c, ack[:]); err != nil {
					t.Fatalf("WRITE %d: no answer: %v (stats %+v)", seq, err, srv.Stats())
				}
				if ack[3] != 4 || binary.LittleEndian.Uint32(ack[4:]) != 0 || binary.LittleEndian.Uint64(ack[8:]) != seq {
					t.Fatalf("WRITE %d answered %x", seq, ack)
				}
			}
			if st := srv.Stats(); st.IdleClosed != 0 || st.FrameTimeouts != 0 {
				t.Fatalf("stats %+v: a connection with a request in progress was timed out", st)
			}
		})
	}
}

// trickle writes b to c one byte every gap until it is written or c
// fails.
func trickle(c net.Conn, b []byte, gap time.Duration) {
	for i := range b {
		if _, err := c.Write(b[i : i+1]); err != nil {
			return
		}
		time.Sleep(gap) // the pace of a slow sender, not a synchronization
	}
}

// A frame must arrive within FrameTimeout plus its length at MinRate, from
// the first wait for it: one sent a byte at a time (header or payload,
// admitted or refused), or a HELLO sent so, has its connection closed and
// counted.
func TestSlowFramesAreCut(t *testing.T) {
	const frameTimeout = 300 * time.Millisecond
	mem := make([]byte, 4096)
	reg := memory.NewRegistry()
	regs, err := reg.Register([]memory.Range{{Mem: mem}})
	if err != nil {
		t.Fatal(err)
	}
	admitted := rawFrame(3, 1, 4096, regs[0].Key, memory.AddrOf(mem))
	refused := rawFrame(3, 1, 4096, regs[0].Key+1, memory.AddrOf(mem))
	for _, tc := range []struct {
		name     string
		hello    bool   // say HELLO first
		whole    []byte // sent at once
		trickled []byte // then a byte every 50 ms
	}{
		{"HELLO", false, nil, helloFrame("slow:1")},
		{"WRITE header", true, nil, admitted},
		{"admitted WRITE payload", true, admitted, make([]byte, 4096)},
		{"refused WRITE payload", true, refused, make([]byte, 4096)},
		{"READ header", true, nil, rawFrame(5, 1, 4096, regs[0].Key, memory.AddrOf(mem))},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv, addr := ownerWith(t, tcp.Options{FrameTimeout: frameTimeout, HandshakeTimeout: frameTimeout, MinRate: 1 << 20},
				transporttest.NewOwner(reg))
			c := dialFrom(t, addr, "")
			if tc.hello {
				if err := sayHello(c, "slow:1"); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := c.Write(tc.whole); err != nil {
				t.Fatal(err)
			}
			go trickle(c, tc.trickled, 50*time.Millisecond)
			took := requireClosed(t, c, 10*time.Second, "a connection trickling a frame")
			if took < frameTimeout/2 {
				t.Errorf("closed after %v, before the frame's deadline of about %v", took, frameTimeout)
			}
			waitFor(t, 5*time.Second, "the slow frame counted", func() bool {
				st := srv.Stats()
				return st.FrameTimeouts == 1 && st.Conns == 0 && st.ProtocolErrors == 0
			})
		})
	}
}

// A frame that arrives slower than FrameTimeout alone allows, but at more
// than MinRate, is served: the deadline grows with the frame's length.
func TestSlowLinkAboveMinRatePasses(t *testing.T) {
	const size = 256 << 10
	mem := make([]byte, size)
	reg := memory.NewRegistry()
	regs, err := reg.Register([]memory.Range{{Mem: mem}})
	if err != nil {
		t.Fatal(err)
	}
	// The deadline is 200 ms + 256 KiB at 256 KiB/s, about 1.2 s; the
	// payload takes about 320 ms (16 KiB every 20 ms, 800 KiB/s).
	srv, addr := ownerWith(t, tcp.Options{FrameTimeout: 200 * time.Millisecond, MinRate: 256 << 10}, transporttest.NewOwner(reg))
	c := dialFrom(t, addr, "")
	if err := sayHello(c, "slowlink:1"); err != nil {
		t.Fatal(err)
	}
	payload := make([]byte, size)
	for i := range payload {
		payload[i] = 0x3c
	}
	start := time.Now()
	if _, err := c.Write(rawFrame(3, 1, size, regs[0].Key, memory.AddrOf(mem))); err != nil {
		t.Fatal(err)
	}
	for off := 0; off < size; off += 16 << 10 {
		time.Sleep(20 * time.Millisecond) // the pace of the link
		if _, err := c.Write(payload[off : off+16<<10]); err != nil {
			t.Fatalf("after %v: %v (stats %+v)", time.Since(start), err, srv.Stats())
		}
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	var ack [tcp.HeaderSize]byte
	if _, err := io.ReadFull(c, ack[:]); err != nil {
		t.Fatalf("no WRITE_ACK after %v: %v (stats %+v)", time.Since(start), err, srv.Stats())
	}
	if ack[3] != 4 || binary.LittleEndian.Uint32(ack[4:]) != 0 || binary.LittleEndian.Uint64(ack[56:]) != size {
		t.Fatalf("WRITE answered %x", ack)
	}
	t.Logf("a %d KiB frame at about 800 KiB/s took %v", size>>10, time.Since(start))
	if mem[0] != 0x3c || mem[size-1] != 0x3c {
		t.Fatal("the payload did not land")
	}
}

// shapedProxy relays connections to target, pacing the direction named by
// upstream (initiator -> owner when true, owner -> initiator otherwise) to
// rate bytes per second; its sockets on that direction have small buffers,
// so the sender's writes wait for the link as on a real slow one.
func shapedProxy(t *testing.T, target string, rate int, upstream bool) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	done := make(chan struct{})
	t.Cleanup(func() {
		close(done)
		_ = ln.Close()
		mu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	paced := func(dst, src *net.TCPConn) {
		_ = src.SetReadBuffer(64 << 10)
		_ = dst.SetWriteBuffer(64 << 10)
		buf := make([]byte, 32<<10)
		start, total := time.Now(), 0
		for {
			n, err := src.Read(buf)
			if n > 0 {
				if _, werr := dst.Write(buf[:n]); werr != nil {
					break
				}
				total += n
				// The link's pace: a shaper, not a synchronization.
				if ahead := time.Until(start.Add(time.Duration(int64(total) * int64(time.Second) / int64(rate)))); ahead > 0 {
					select {
					case <-time.After(ahead):
					case <-done:
						return
					}
				}
			}
			if err != nil {
				break
			}
		}
		_ = dst.CloseWrite()
	}
	plain := func(dst, src *net.TCPConn) {
		_, _ = io.Copy(dst, src)
		_ = dst.CloseWrite()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			nc, err := ln.Accept()
			if err != nil {
				return
			}
			oc, err := net.Dial("tcp", target)
			if err != nil {
				_ = nc.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, nc, oc)
			mu.Unlock()
			in, out := nc.(*net.TCPConn), oc.(*net.TCPConn)
			up, down := plain, paced
			if upstream {
				up, down = paced, plain
			}
			wg.Add(2)
			go func() { defer wg.Done(); up(out, in) }()
			go func() { defer wg.Done(); down(in, out) }()
		}
	}()
	return ln.Addr().String()
}

// The owner lets a frame take FrameTimeout plus its length at MinRate
// (tcp.Options: "a 64 MiB one 74 s", "a link slower than MinRate needs it
// lowered"), but every socket write of a frame, the initiator's WRITE and
// the owner's READ answer, is bounded by IOTimeout whatever its length, so
// a large slice on a link well above MinRate is cut. Scaled 1/10 from the
// defaults (FrameTimeout 10 s, IOTimeout 30 s, MinRate 1 MiB/s, a 64 MiB
// slice on a 1.2 MiB/s link: 53 s, inside its 74 s frame budget): here
// FrameTimeout 1 s, IOTimeout 3 s, MinRate 10 MiB/s, a 64 MiB slice on a
// 12 MiB/s link.
func TestLargeSliceOnLinkAboveMinRateCompletes(t *testing.T) {
	if testing.Short() {
		t.Skip("moves 64 MiB over a shaped link")
	}
	const size = 64 << 20
	const minRate, linkRate = 10 << 20, 12 << 20
	opts := tcp.Options{FrameTimeout: time.Second, MinRate: minRate, IOTimeout: 3 * time.Second}
	for _, op := range []transport.Op{transport.Write, transport.Read} {
		t.Run(op.String(), func(t *testing.T) {
			ownerMem, _, err := memory.Alloc(size)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = memory.Free(ownerMem) })
			localMem, _, err := memory.Alloc(size)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = memory.Free(localMem) })
			for i := range ownerMem {
				ownerMem[i], localMem[i] = 1, 2
			}
			ownerReg, oregion, lregion := transporttest.Register(t, ownerMem, localMem)
			srv, addr := ownerWith(t, opts, transporttest.NewOwner(ownerReg))
			proxy := shapedProxy(t, addr, linkRate, op == transport.Write)
			init := tcp.New(opts)
			t.Cleanup(func() { _ = init.Close() })
			ep, err := init.Dial(context.Background(), proxy, "slowlink:1")
			if err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			start := time.Now()
			ep.Post([]*transport.Slice{{Op: op, Local: localMem, LocalReg: lregion, Key: oregion.Key,
				Remote: memory.AddrOf(ownerMem), Done: func(_ *transport.Slice, err error) { done <- err }}})
			var werr error
			select {
			case werr = <-done:
			case <-time.After(60 * time.Second):
				t.Fatal("the slice never ended")
			}
			took := time.Since(start)
			if werr != nil {
				t.Fatalf("a %d MiB %s on a %d MiB/s link (MinRate %d MiB/s, frame budget %v) failed after %v: %v (owner stats %+v)",
					size>>20, op, linkRate>>20, minRate>>20, opts.FrameTimeout+time.Duration(size/minRate)*time.Second,
					took.Round(10*time.Millisecond), werr, srv.Stats())
			}
			if op == transport.Write && ownerMem[size-1] != 2 || op == transport.Read && localMem[size-1] != 1 {
				t.Fatal("the slice completed but its last byte did not move")
			}
			t.Logf("a %d MiB %s took %v", size>>20, op, took.Round(10*time.Millisecond))
		})
	}
}
