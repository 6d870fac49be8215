package shm_test

import (
	"context"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/engine/transport/shm"
	"github.com/kvferry/kvferry/engine/transport/tcp"
	"github.com/kvferry/kvferry/engine/transport/transporttest"
)

// TestConformanceByCrossMemoryAttach runs the transport suite over the
// same-host transport with private memory: the owner reaches the
// initiator's buffers by process_vm_readv/writev.
func TestConformanceByCrossMemoryAttach(t *testing.T) {
	f, stats := pair(t, shm.Options{})
	transporttest.Run(t, f)
	if st := stats(); st.AttachSlices == 0 || st.SharedSlices != 0 || st.FallbackSlices != 0 {
		t.Errorf("slices by attach %d, shared %d, over tcp %d: want all by attach", st.AttachSlices, st.SharedSlices, st.FallbackSlices)
	}
}

// TestConformanceBySharedBuffers runs the suite with shareable buffers, as
// an engine allocates them: the owner copies through views of them.
func TestConformanceBySharedBuffers(t *testing.T) {
	f, stats := pair(t, shm.Options{})
	transporttest.RunShared(t, f)
	if st := stats(); st.SharedSlices == 0 || st.AttachSlices != 0 || st.FallbackSlices != 0 {
		t.Errorf("slices shared %d, by attach %d, over tcp %d: want all shared", st.SharedSlices, st.AttachSlices, st.FallbackSlices)
	}
}

// TestConformanceOverTheTCPFallback runs the suite where the owner cannot
// reach private memory (no cross-memory attach): every slice goes over the
// tcp path.
func TestConformanceOverTheTCPFallback(t *testing.T) {
	f, stats := pair(t, shm.Options{NoAttach: true})
	transporttest.Run(t, f)
	if st := stats(); st.FallbackSlices == 0 || st.AttachSlices != 0 || st.SharedSlices != 0 {
		t.Errorf("slices over tcp %d, by attach %d, shared %d: want all over tcp", st.FallbackSlices, st.AttachSlices, st.SharedSlices)
	}
}

// pair is the suite's factory: an owner's shm and tcp transports, and an
// initiator's shm transport (with initiatorOpts) dialing them, watching the
// initiator's registry as an engine does. stats sums the initiators'
// counters over the run.
func pair(t *testing.T, initiatorOpts shm.Options) (transporttest.Factory, func() shm.Stats) {
	var total shm.Stats
	f := func(t *testing.T, owner transport.Owner) transport.Endpoint {
		ownerSide, err := shm.New(shm.Options{})
		if err != nil {
			t.Fatalf("new: %v", err)
		}
		addr, err := ownerSide.Listen(owner)
		if err != nil {
			t.Fatalf("listen: %v", err)
		}
		ownerTCP := tcp.New(tcp.Options{})
		tcpAddr, err := ownerTCP.Listen(owner)
		if err != nil {
			t.Fatalf("listen tcp: %v", err)
		}
		initiatorSide, err := shm.New(initiatorOpts)
		if err != nil {
			t.Fatalf("new: %v", err)
		}
		initiatorTCP := tcp.New(tcp.Options{})
		if o, ok := owner.(*transporttest.Owner); ok && o.Initiator != nil {
			o.Initiator.Watch(initiatorSide)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		ep, err := initiatorSide.DialVia(ctx, addr, "initiator:1", func(ctx context.Context) (transport.Endpoint, error) {
			return initiatorTCP.Dial(ctx, tcpAddr, "initiator:1")
		})
		if err != nil {
			t.Fatalf("dial %s: %v", addr, err)
		}
		t.Cleanup(func() {
			st := initiatorSide.Stats()
			total.AttachSlices += st.AttachSlices
			total.SharedSlices += st.SharedSlices
			total.FallbackSlices += st.FallbackSlices
		})
		t.Cleanup(func() { _ = ep.Close() })
		t.Cleanup(func() { _ = initiatorTCP.Close() })
		t.Cleanup(func() { _ = initiatorSide.Close() })
		t.Cleanup(func() { _ = ownerTCP.Close() })
		t.Cleanup(func() { _ = ownerSide.Close() })
		return ep
	}
	return f, func() shm.Stats { return total }
}
