package rdma

// The rkey release protocol, over the fake provider with the two
// transports' handshakes wired to each other directly.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/engine/transport/transporttest"
	"github.com/kvferry/kvferry/internal/fakeverbs"
)

const releaseTestInitiator = "initiator:1"

type releaseEnv struct {
	owner, init *Transport
	ep          *Endpoint
	ownerReg    *memory.Registry
	initReg     *memory.Registry
}

// newReleaseEnv connects an initiator to an owner over the fake; hook, when
// set, sees every control message first and may answer it itself.
func newReleaseEnv(t *testing.T, hook func(ctx context.Context, body []byte, serve func() ([]byte, error)) ([]byte, error)) *releaseEnv {
	t.Helper()
	lib := fakeverbs.Library(t)
	devs := fakeverbs.Devices("")
	env := &releaseEnv{ownerReg: memory.NewRegistry(), initReg: memory.NewRegistry()}
	o := transporttest.NewOwner(env.ownerReg)
	var err error
	env.owner, err = New(Options{Library: lib, Devices: devs, Fence: true,
		Exchange: func(context.Context, string, []byte) ([]byte, error) {
			return nil, errors.New("the owner dials nobody")
		}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = env.owner.Close() })
	if _, err := env.owner.Listen(o); err != nil {
		t.Fatal(err)
	}
	env.init, err = New(Options{Library: lib, Devices: devs,
		Exchange: func(ctx context.Context, peer string, body []byte) ([]byte, error) {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			serve := func() ([]byte, error) { return env.owner.Serve(releaseTestInitiator, body) }
			if hook != nil {
				return hook(ctx, body, serve)
			}
			return serve()
		}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = env.init.Close() })
	env.ownerReg.Watch(env.owner)
	env.initReg.Watch(env.init)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ep, err := env.init.Dial(ctx, "owner:1", releaseTestInitiator)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ep.Close() })
	env.ep = ep.(*Endpoint)
	return env
}

func (env *releaseEnv) region(t *testing.T, reg *memory.Registry, n int) (*memory.Region, []byte) {
	t.Helper()
	mem, _, err := memory.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = memory.Free(mem) })
	regs, err := reg.Register([]memory.Range{{Mem: mem, Location: "cpu"}})
	if err != nil {
		t.Fatal(err)
	}
	return regs[0], mem
}

type testSlice struct {
	transport.Slice
	once sync.Once
	done chan struct{}
	err  error
}

func (env *releaseEnv) write(local *memory.Region, lmem []byte, remote *memory.Region, n int, rid uint64) *testSlice {
	s := &testSlice{done: make(chan struct{})}
	s.Op = transport.Write
	s.Local = lmem[:n:n]
	s.LocalReg = local
	s.Key = remote.Key
	s.Remote = remote.Addr
	s.RequestID = rid
	s.Done = func(_ *transport.Slice, err error) {
		s.once.Do(func() { s.err = err; close(s.done) })
	}
	s.Reset()
	return s
}

func waitUntil(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	// Polling a condition, not synchronizing: the sleep only paces it.
	for deadline := time.Now().Add(d); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
	}
}

// A keys request the initiator gave up on (here a Cancel of its slice; a
// lost reply, a request timeout, a new key epoch or a malformed reply do
// the same) was admitted by the owner, which recorded a hold for the path.
// The initiator never cached the answer, yet it must release that request
// id like any other: otherwise the owner counts the initiator as a holder
// of it until the path's connection closes, every abort of it needs the
// initiator's ACK or a fence (cutting all its other transfers), and such
// holds pile up to the per-initiator cut.
func TestRDMAAbandonedKeysRequestIsReleased(t *testing.T) {
	const leaked, other = 7, 8
	asked := make(chan struct{})
	env := newReleaseEnv(t, func(ctx context.Context, body []byte, serve func() ([]byte, error)) ([]byte, error) {
		if len(body) > 0 && body[0] == kindKeys {
			if m, err := decodeKeys(body); err == nil && m.RequestID == leaked {
				rep, err := serve() // the owner admits it and records the hold
				if err != nil {
					return rep, err
				}
				close(asked)
				<-ctx.Done() // the reply is slow: the initiator gives up first
				return nil, ctx.Err()
			}
		}
		return serve()
	})
	lreg, lmem := env.region(t, env.initReg, 1<<20)
	oreg, _ := env.region(t, env.ownerReg, 1<<20)

	s := env.write(lreg, lmem, oreg, 64<<10, leaked)
	env.ep.Post([]*transport.Slice{&s.Slice})
	select {
	case <-asked:
	case <-time.After(10 * time.Second):
		t.Fatal("no keys request")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := env.ep.Cancel(ctx, []*transport.Slice{&s.Slice}); err != nil {
		t.Fatalf("cancel: %v", err)
	}
	<-s.done
	if !errors.Is(s.err, transport.ErrCanceled) {
		t.Fatalf("canceled slice ended with %v", s.err)
	}

	// Another request id on the same path: used, then released.
	s2 := env.write(lreg, lmem, oreg, 64<<10, other)
	env.ep.Post([]*transport.Slice{&s2.Slice})
	<-s2.done
	if s2.err != nil {
		t.Fatal(s2.err)
	}
	waitUntil(t, 15*time.Second, fmt.Sprintf("request %d released by the path", other), func() bool {
		return len(env.owner.Holders(other)) == 0
	})
	if h := env.owner.Holders(leaked); slices.Contains(h, releaseTestInitiator) {
		t.Fatalf("request %d (abandoned keys request, older than %d) is still held by %v after the path released %d: "+
			"the hold is never released while the connection lives (owner holders %d, releases %d)",
			leaked, other, h, other, env.owner.Stats().Holders, env.owner.Stats().Releases)
	}
}
