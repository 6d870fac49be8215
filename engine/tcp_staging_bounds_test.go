package engine_test

import (
	"encoding/binary"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/engine/transport/tcp"
)

// stagingBudget is what this test lets one peer address make an owner pin
// in host staging buffers at once: the size of the staging pool
// (stagePoolMax, engine/gpu.go). Without that cap only TCPMaxConnsPerPeer x
// 64 MiB (64 GiB) would bound it.
const stagingBudget = 256 << 20

// A peer without credentials (it needs only the descriptor, which the
// control plane gives anyone) opens a few data connections and on each
// asks a 64 MiB READ of GPU memory that it never reads: the owner takes a
// host staging buffer for each (page-locked when the driver allows) and
// keeps it while the answer waits on the full socket, for IOTimeout. The
// connection caps bound the connections, not this memory; README: "What a
// peer without credentials can make an owner spend is bounded".
func TestPeerCannotPinUnboundedStagingMemory(t *testing.T) {
	const size, conns = 64 << 20, 8
	owner := newEngineWith(t, gpuOpts(t, engine.Options{}))
	_, g := gpuAlloc(t, 0, size)
	if _, err := owner.RegisterMemory(g, "*"); err != nil {
		t.Fatal(err)
	}
	// Before the GPU memory is freed: unregistering waits for the staging
	// copies under way (a READ may be between its staging buffer and its
	// copy when the test ends).
	t.Cleanup(func() { _ = owner.UnregisterMemory(engine.AddrOf(g)) })
	desc := owner.Descriptor()
	var addr string
	for _, tr := range desc.Transports {
		if tr.Name == "tcp" {
			addr = tr.Addr
		}
	}
	var key uint64
	for _, b := range desc.Buffers {
		if b.Addr == engine.AddrOf(g) {
			key = b.Key
		}
	}
	if addr == "" || key == 0 {
		t.Fatalf("descriptor %+v: no tcp address or GPU buffer", desc)
	}
	hello := func(name string) []byte {
		b := make([]byte, 64)
		binary.LittleEndian.PutUint16(b[0:], 0x464b)
		b[2], b[3] = 1, 1
		binary.LittleEndian.PutUint32(b[28:], uint32(len(name)))
		return append(b, name...)
	}
	readFrame := func() []byte {
		b := make([]byte, 64)
		binary.LittleEndian.PutUint16(b[0:], 0x464b)
		b[2], b[3] = 1, 5
		binary.LittleEndian.PutUint64(b[8:], 1)
		binary.LittleEndian.PutUint32(b[28:], size)
		binary.LittleEndian.PutUint64(b[32:], key)
		binary.LittleEndian.PutUint64(b[40:], engine.AddrOf(g))
		return b
	}
	for i := range conns {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close() })
		_ = c.(*net.TCPConn).SetReadBuffer(4 << 10) // and never read
		if _, err := c.Write(append(hello(fmt.Sprintf("greedy:%d", i+1)), readFrame()...)); err != nil {
			t.Fatal(err)
		}
	}
	// Each READ is either staged (and held) or refused.
	if !waitUntil(20*time.Second, func() bool {
		st := owner.Stats()
		return st.StagingInUse+int64(st.OwnerRefused) >= conns
	}) {
		t.Fatalf("the READs were neither staged nor refused: %+v", owner.Stats())
	}
	if held := owner.Stats().StagingInUse * size; held > stagingBudget {
		t.Fatalf("one peer that reads nothing holds %d MiB of the owner's staging memory (%d READs of %d MiB on %d connections), over %d MiB; with TCPMaxConnsPerPeer %d it could hold %d GiB",
			held>>20, held/size, size>>20, conns, stagingBudget>>20, tcp.DefaultMaxConnsPerPeer, tcp.DefaultMaxConnsPerPeer*size>>30)
	}
}
