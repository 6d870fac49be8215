package tcp_test

import (
	"context"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/engine/transport/tcp"
	"github.com/kvferry/kvferry/engine/transport/transporttest"
)

// TestConformance runs the transport suite over loopback TCP: one transport
// listens for the owner, another dials it for the initiator.
func TestConformance(t *testing.T) {
	transporttest.Run(t, func(t *testing.T, owner transport.Owner) transport.Endpoint {
		ownerSide := tcp.New(tcp.Options{})
		addr, err := ownerSide.Listen(owner)
		if err != nil {
			t.Fatalf("listen: %v", err)
		}
		t.Cleanup(func() { _ = ownerSide.Close() })
		initiatorSide := tcp.New(tcp.Options{})
		t.Cleanup(func() { _ = initiatorSide.Close() })
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		ep, err := initiatorSide.Dial(ctx, addr, "initiator:1")
		if err != nil {
			t.Fatalf("dial %s: %v", addr, err)
		}
		t.Cleanup(func() { _ = ep.Close() })
		return ep
	})
}
