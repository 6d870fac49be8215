package tcp_test

import (
	"context"
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
			ownerReg := memory.NewRegistry()
			oregs, err := ownerReg.Register([]memory.Range{{Mem: ownerMem}})
			if err != nil {
				t.Fatal(err)
			}
			lregs, err := memory.NewRegistry().Register([]memory.Range{{Mem: localMem}})
			if err != nil {
				t.Fatal(err)
			}
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
			ep.Post([]*transport.Slice{{Op: op, Local: localMem, LocalReg: lregs[0], Key: oregs[0].Key,
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
