package control_test

// The ZMQ control plane over loopback: requests and replies, peer names,
// nobody listening, Close.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/control"
)

func TestPlaneRequestReply(t *testing.T) {
	a, b := newPlane(t, "127.0.0.1"), newPlane(t, "127.0.0.1")
	if _, _, err := net.SplitHostPort(a.Name()); err != nil || !strings.HasPrefix(a.Name(), "127.0.0.1:") {
		t.Fatalf("Name() = %q, want 127.0.0.1:port", a.Name())
	}
	ctx := ctxFor(t, 10*time.Second)

	t.Run("ping", func(t *testing.T) {
		typ, body, err := a.Request(ctx, b.Name(), control.MsgPing, []byte("hello"))
		if err != nil || typ != control.MsgPong || string(body) != "hello" {
			t.Fatalf("Request = %v, %q, %v; want PONG hello", typ, body, err)
		}
		if from, _ := b.from.Load().(string); from != a.Name() {
			t.Fatalf("handler saw the request from %q, want the requester's segment name %q", from, a.Name())
		}
	})
	t.Run("empty body", func(t *testing.T) {
		typ, body, err := a.Request(ctx, b.Name(), control.MsgPing, nil)
		if err != nil || typ != control.MsgPong || len(body) != 0 {
			t.Fatalf("Request = %v, %q, %v", typ, body, err)
		}
	})
	t.Run("descriptor", func(t *testing.T) {
		typ, body, err := a.Request(ctx, b.Name(), control.MsgGetDescriptor, nil)
		if err != nil || typ != control.MsgDescriptor {
			t.Fatalf("Request = %v, %v", typ, err)
		}
		d, err := control.DecodeDescriptor(body)
		if err != nil || d.Name != b.Name() {
			t.Fatalf("descriptor %+v, %v", d, err)
		}
	})
	t.Run("compressed both ways", func(t *testing.T) {
		big := bytes.Repeat([]byte("0123456789abcdef"), 1<<16) // 1 MiB, compresses
		typ, body, err := a.Request(ctx, b.Name(), control.MsgPing, big)
		if err != nil || typ != control.MsgPong || !bytes.Equal(body, big) {
			t.Fatalf("Request of %d compressible bytes = %v, %d bytes, %v", len(big), typ, len(body), err)
		}
		rnd := make([]byte, 1<<20) // does not compress
		r := rand.New(rand.NewPCG(1, 2))
		for i := range rnd {
			rnd[i] = byte(r.Uint32())
		}
		typ, body, err = a.Request(ctx, b.Name(), control.MsgPing, rnd)
		if err != nil || typ != control.MsgPong || !bytes.Equal(body, rnd) {
			t.Fatalf("Request of %d random bytes = %v, %d bytes, %v", len(rnd), typ, len(body), err)
		}
	})
	t.Run("body of exactly MaxBody", func(t *testing.T) {
		rnd := make([]byte, control.MaxBody)
		r := rand.New(rand.NewPCG(3, 4))
		for i := range rnd {
			rnd[i] = byte(r.Uint32())
		}
		typ, body, err := a.Request(ctx, b.Name(), control.MsgPing, rnd)
		if err != nil || typ != control.MsgPong || !bytes.Equal(body, rnd) {
			t.Fatalf("Request of MaxBody random bytes = %v, %d bytes, %v", typ, len(body), err)
		}
	})
	t.Run("no handler", func(t *testing.T) {
		_, _, err := a.Request(ctx, b.Name(), control.MsgPong, nil)
		if !errors.Is(err, control.ErrRemote) {
			t.Fatalf("Request of a type without handler: %v, want ErrRemote", err)
		}
	})
	t.Run("to itself", func(t *testing.T) {
		typ, body, err := a.Request(ctx, a.Name(), control.MsgPing, []byte("me"))
		if err != nil || typ != control.MsgPong || string(body) != "me" {
			t.Fatalf("Request to self = %v, %q, %v", typ, body, err)
		}
	})
	t.Run("concurrent", func(t *testing.T) {
		var wg sync.WaitGroup
		errs := make(chan error, 64)
		for g := range 32 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range 20 {
					want := fmt.Sprintf("g%d-i%d", g, i)
					typ, body, err := a.Request(ctx, b.Name(), control.MsgPing, []byte(want))
					if err != nil || typ != control.MsgPong || string(body) != want {
						errs <- fmt.Errorf("request %s: %v %q %v", want, typ, body, err)
						return
					}
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
	})
	for _, p := range []*testPlane{a, b} {
		if s := p.Stats(); s.Malformed != 0 || s.Unmatched != 0 || s.SendFails != 0 {
			t.Errorf("%s: stats %+v after clean traffic", p.Name(), s)
		}
	}
}

func TestPlaneRequestBadPeerName(t *testing.T) {
	a := newPlane(t, "127.0.0.1")
	start := time.Now()
	_, _, err := a.Request(ctxFor(t, 5*time.Second), "no-port-here", control.MsgPing, nil)
	if err == nil || time.Since(start) > time.Second {
		t.Fatalf("Request to a name without a port: %v after %v, want a prompt error", err, time.Since(start))
	}
}

func TestPlaneRequestNobodyListening(t *testing.T) {
	a := newPlane(t, "127.0.0.1")
	peer := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	const deadline = 300 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), deadline)
	defer cancel()
	start := time.Now()
	_, _, err := a.Request(ctx, peer, control.MsgPing, []byte("anyone?"))
	took := time.Since(start)
	if !errors.Is(err, control.ErrUnreachable) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Request to %s with nobody listening: %v, want ErrUnreachable and DeadlineExceeded", peer, err)
	}
	if took < deadline-10*time.Millisecond || took > deadline+2*time.Second {
		t.Fatalf("Request returned after %v, want about its deadline %v", took, deadline)
	}
	// The plane is still usable, for other peers and to return by a
	// cancelled context too.
	b := newPlane(t, "127.0.0.1")
	if _, _, err := a.Request(ctxFor(t, 5*time.Second), b.Name(), control.MsgPing, nil); err != nil {
		t.Fatalf("Request after a timed-out one: %v", err)
	}
	cctx, ccancel := context.WithCancel(context.Background())
	wctx := newWaitingCtx(cctx)
	go func() { <-wctx.waiting; ccancel() }() // cancel once the Request waits for its reply
	if _, _, err := a.Request(wctx, peer, control.MsgPing, nil); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled Request: %v, want context.Canceled", err)
	}
}

func TestPlaneClose(t *testing.T) {
	lc := &logCounter{}
	a, err := control.Listen("127.0.0.1", 0, slog.New(lc))
	must(t, err)
	a.Start()
	peer := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	res := make(chan error, 1)
	wctx := newWaitingCtx(context.Background()) // no deadline: only Close ends it
	go func() {
		_, _, err := a.Request(wctx, peer, control.MsgPing, nil)
		res <- err
	}()
	<-wctx.waiting // the Request is queued and waits for its reply
	done := make(chan error, 1)
	go func() { done <- a.Close() }()
	select {
	case err := <-done:
		must(t, err)
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not return")
	}
	select {
	case err := <-res:
		if !errors.Is(err, control.ErrClosed) {
			t.Fatalf("Request in flight at Close: %v, want ErrClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Request in flight at Close did not return")
	}
	if _, _, err := a.Request(context.Background(), peer, control.MsgPing, nil); !errors.Is(err, control.ErrClosed) {
		t.Fatalf("Request after Close: %v, want ErrClosed", err)
	}
	if err := a.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

func TestPlaneIPv6Name(t *testing.T) {
	l, err := net.Listen("tcp6", "[::1]:0")
	if err != nil {
		t.Skipf("IPv6 loopback ::1 unavailable on this host (%v); cannot test \"[::1]:port\" names", err)
	}
	_ = l.Close()
	b := newPlane(t, "::1")
	host, port, err := net.SplitHostPort(b.Name())
	if err != nil || host != "::1" || port == "0" || !strings.HasPrefix(b.Name(), "[::1]:") {
		t.Fatalf("Name() = %q, want \"[::1]:port\"", b.Name())
	}
	ctx := ctxFor(t, 10*time.Second)
	a6 := newPlane(t, "::1")
	typ, body, err := a6.Request(ctx, b.Name(), control.MsgPing, []byte("v6"))
	if err != nil || typ != control.MsgPong || string(body) != "v6" {
		t.Fatalf("IPv6 to IPv6 Request = %v, %q, %v", typ, body, err)
	}
	if from, _ := b.from.Load().(string); from != a6.Name() {
		t.Fatalf("handler saw %q, want %q", from, a6.Name())
	}
	a4 := newPlane(t, "127.0.0.1")
	typ, body, err = a4.Request(ctx, b.Name(), control.MsgPing, []byte("v4->v6"))
	if err != nil || typ != control.MsgPong || string(body) != "v4->v6" {
		t.Fatalf("IPv4 plane to IPv6 peer Request = %v, %q, %v", typ, body, err)
	}
}
