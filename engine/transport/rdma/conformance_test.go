package rdma_test

import (
	"context"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/engine/transport/rdma"
	"github.com/kvferry/kvferry/engine/transport/transporttest"
)

// TestConformance runs the transport suite over the fake libibverbs: two
// transports in this process, their QPs connected through the fake fabric,
// memory registered on every fake NIC through the registries' watchers.
// With KVFERRY_TEST_RDMA=1 it runs on this host's RDMA devices instead,
// every local NIC pair connected over loopback.
func TestConformance(t *testing.T) {
	testLibrary(t)
	transporttest.Run(t, func(t *testing.T, owner transport.Owner) transport.Endpoint {
		o := owner.(*transporttest.Owner)
		p := newPair(t, owner, true, "")
		o.Registry.Watch(p.owner)
		o.Initiator.Watch(p.init)
		o.Progress = func() int64 { return int64(p.init.Stats().Completed) }
		o.Concurrent = true // slices stripe across NIC pairs
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		ep, err := p.init.Dial(ctx, "owner:1", initiatorName)
		if err != nil {
			_ = p.owner.Close()
			_ = p.init.Close()
			t.Fatalf("dial: %v", err)
		}
		t.Cleanup(func() { _ = ep.Close() })
		t.Cleanup(func() { _ = p.init.Close() })
		t.Cleanup(func() { _ = p.owner.Close() })
		return ep
	})
}

var _ transport.Fencer = (*rdma.Transport)(nil)
var _ transport.Drainer = (*rdma.Endpoint)(nil)
