package local_test

import (
	"context"
	"testing"

	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/engine/transport/local"
	"github.com/kvferry/kvferry/engine/transport/transporttest"
)

// TestConformance runs the transport suite over the local transport.
func TestConformance(t *testing.T) {
	transporttest.Run(t, func(t *testing.T, owner transport.Owner) transport.Endpoint {
		tr := local.New(owner, "self")
		t.Cleanup(func() { _ = tr.Close() })
		ep, err := tr.Dial(context.Background(), "", "self")
		if err != nil {
			t.Fatalf("dial: %v", err)
		}
		t.Cleanup(func() { _ = ep.Close() })
		return ep
	})
}
