package rdma_test

import (
	"slices"
	"testing"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport/transporttest"
	"github.com/kvferry/kvferry/internal/fakeverbs"
)

// The published matrix orders NICs by the NUMA node of the memory: memory
// on node 1 prefers fake1 (node 1), memory on node 0 fake0; and the
// device filter keeps only what it names.
func TestMatrixFollowsNUMAAndFilterKeepsNamedDevices(t *testing.T) {
	fakeverbs.NeedFake(t, "it asserts the fake's NUMA placement and device names")
	reg := memory.NewRegistry()
	p := newPair(t, transporttest.NewOwner(reg), true, "")
	defer p.owner.Close()
	defer p.init.Close()
	for _, n := range p.owner.NICs() {
		if want := map[string]int{"fake0": 0, "fake1": 1}[n.Name]; n.Placement.NUMANode != want || n.Placement.PCIAddress == "" {
			t.Fatalf("NIC %s: placement %+v, want NUMA node %d and a PCI address (from the fake's sysfs files)", n.Name, n.Placement, want)
		}
	}
	reg.Watch(p.owner)
	mem, _, err := memory.Alloc(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer memory.Free(mem)
	if _, err := reg.Register([]memory.Range{{Mem: mem, Location: "cpu:1"}}); err != nil {
		t.Fatal(err)
	}
	m := p.owner.Matrix()
	if !slices.Equal(m["cpu:1"], []uint8{1, 0}) || !slices.Equal(m["cpu"], []uint8{0, 1}) {
		t.Fatalf("matrix %v: want cpu:1 -> [1 0], cpu -> [0 1]", m)
	}
	t.Logf("descriptor entry: %s", p.owner.DescriptorAddr())

	only := newPair(t, transporttest.NewOwner(memory.NewRegistry()), true, "=fake1")
	defer only.owner.Close()
	defer only.init.Close()
	if names := only.owner.NICNames(); !slices.Equal(names, []string{"fake1:1"}) {
		t.Fatalf("filter =fake1 kept %v", names)
	}
}
