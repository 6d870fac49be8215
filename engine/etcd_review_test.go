package engine_test

// Hostile review of the etcd metadata store: outages, Close, leaks.

import (
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/engine/metadata/etcdtest"
)

// REGRESSION. Close of an engine whose store is down returns (the lease
// revocation is bounded); 30 s is a hang detector, not a timing claim.
func TestReviewCloseReturnsWithTheEtcdStoreDown(t *testing.T) {
	srv := etcdtest.Start(t)
	url := srv.URL("close-down")
	e, err := engine.New(engine.Options{IgnoreEnv: true, Protocol: "tcp", Metadata: url})
	if err != nil {
		t.Fatal(err)
	}
	other := newEngineWith(t, engine.Options{Metadata: url})
	_ = openSegment(t, e, other.Name())
	srv.Kill()
	done := make(chan error, 1)
	go func() { done <- e.Close() }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("Close hangs with the etcd store down")
	}
}

// REGRESSION. Engines with a store, opened, used and closed, with the
// store up and with it down at Close, leave no goroutine or file
// descriptor behind (watch, keepalive, gRPC connections).
func TestReviewEtcdEnginesLeakNothing(t *testing.T) {
	srv := etcdtest.Start(t)
	url := srv.URL("leaks")
	cycle := func(down bool) func() {
		return func() {
			if down {
				srv.Restart()
			}
			a, err := engine.New(engine.Options{IgnoreEnv: true, Protocol: "tcp", Metadata: url})
			if err != nil {
				t.Fatal(err)
			}
			b, err := engine.New(engine.Options{IgnoreEnv: true, Protocol: "tcp", Metadata: url})
			if err != nil {
				t.Fatal(err)
			}
			dst := alloc(t, b, 1<<16)
			src := alloc(t, a, 1<<16)
			seg := openSegment(t, a, b.Name())
			transfer(t, a, 10*time.Second, write(src, seg, engine.AddrOf(dst), len(src)))
			_ = a.FreeBuffer(engine.AddrOf(src))
			_ = b.FreeBuffer(engine.AddrOf(dst))
			if down {
				srv.Kill()
			}
			_ = a.Close()
			_ = b.Close()
		}
	}
	t.Run("store up", func(t *testing.T) { requireNoLeaks(t, cycle(false)) })
	srv.Kill()
	t.Run("store down at close", func(t *testing.T) { requireNoLeaks(t, cycle(true)) })
}
