package tcp_test

import (
	"context"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/kvcodec"
	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/engine/transport/tcp"
	"github.com/kvferry/kvferry/engine/transport/transporttest"
)

// TestConformance runs the transport suite over loopback TCP: one transport
// listens for the owner, another dials it for the initiator.
func TestConformance(t *testing.T) {
	transporttest.Run(t, conformancePair(tcp.Options{}, tcp.Options{}))
}

// conformancePair is the suite's factory for an owner's transport with
// ownerOpts and an initiator's with initiatorOpts.
func conformancePair(ownerOpts, initiatorOpts tcp.Options) transporttest.Factory {
	return func(t *testing.T, owner transport.Owner) transport.Endpoint {
		ownerSide := tcp.New(ownerOpts)
		addr, err := ownerSide.Listen(owner)
		if err != nil {
			t.Fatalf("listen: %v", err)
		}
		initiatorSide := tcp.New(initiatorOpts)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		ep, err := initiatorSide.Dial(ctx, addr, "initiator:1")
		if err != nil {
			_ = ownerSide.Close()
			t.Fatalf("dial %s: %v", addr, err)
		}
		// Cleanups run last first: the owner's side closes first, so a
		// path left stuck by a failed subtest is cut rather than waited for.
		t.Cleanup(func() { _ = ep.Close() })
		t.Cleanup(func() { _ = initiatorSide.Close() })
		t.Cleanup(func() { _ = ownerSide.Close() })
		return ep
	}
}

// TestConformanceCompressed runs the suite with both sides compressing
// every slice the codec takes, so WRITEs and READ answers whose blocks
// shrink go as WRITE_Z and READ_DATA_Z under the same rows.
func TestConformanceCompressed(t *testing.T) {
	enc, err := kvcodec.NewEncoder(kvcodec.CodecHuff0)
	if err != nil {
		t.Fatal(err)
	}
	opts := tcp.Options{Compressor: enc, CompressMin: 1}
	transporttest.Run(t, conformancePair(opts, opts))
}
