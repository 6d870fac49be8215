package rdma_test

import (
	"context"
	"fmt"
	"os"
	"testing"

	"github.com/kvferry/kvferry/internal/fakeverbs"

	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/engine/transport/rdma"
)

func TestMain(m *testing.M) {
	cleanup := fakeverbs.UseFabric()
	// fake0 on NUMA node 0, fake1 on node 1: the preference tests see
	// a two-socket machine.
	_ = os.Setenv("FAKEVERBS_NUMA", "0,1")
	// A small max MR size: registrations are split into 4 MiB pieces, so
	// slices that cross a piece boundary become several work requests.
	_ = os.Setenv("FAKEVERBS_MAX_MR_SIZE", "4194304")
	code := m.Run()
	cleanup()
	if n := transport.IllegalTransitions(); n > 0 && code == 0 {
		fmt.Fprintf(os.Stderr, "FAIL: %d slice state moves the state table refuses\n", n)
		code = 1
	}
	os.Exit(code)
}

func needFake(t testing.TB) string { return fakeverbs.Path(t) }

// testLibrary is the libibverbs the conformance suite runs on: the fake,
// or with KVFERRY_TEST_RDMA=1 the system's, on this host's real devices.
func testLibrary(t testing.TB) string {
	t.Helper()
	return fakeverbs.Library(t)
}

// pairOf makes an owner and an initiator transport over the fake provider,
// whose handshakes reach each other directly (the engine carries them on
// its control plane).
type pairOf struct {
	owner, init *rdma.Transport
}

const initiatorName = "initiator:1"

func newPair(t testing.TB, owner transport.Owner, fence bool, devices string) *pairOf {
	t.Helper()
	lib := testLibrary(t)
	if devices == "" {
		devices = fakeverbs.Devices("") // KVFERRY_RDMA_DEVICES on real devices
	}
	p := &pairOf{}
	var err error
	p.owner, err = rdma.New(rdma.Options{
		Library: lib, Devices: devices, Fence: fence,
		Exchange: func(ctx context.Context, peer string, body []byte) ([]byte, error) {
			return nil, fmt.Errorf("the owner dials nobody")
		},
	})
	if err != nil {
		t.Fatalf("owner transport: %v", err)
	}
	if _, err := p.owner.Listen(owner); err != nil {
		t.Fatalf("listen: %v", err)
	}
	p.init, err = rdma.New(rdma.Options{
		Library: lib, Devices: devices,
		Exchange: func(ctx context.Context, peer string, body []byte) ([]byte, error) {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			return p.owner.Serve(initiatorName, body)
		},
	})
	if err != nil {
		_ = p.owner.Close()
		t.Fatalf("initiator transport: %v", err)
	}
	return p
}
