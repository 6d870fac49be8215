package transporttest

import (
	"testing"

	"github.com/kvferry/kvferry/engine/memory"
)

// Register registers owned in a new owner registry and local in a new
// initiator registry, failing tb when either is refused. It returns the
// owner's registry (for NewOwner) and the two regions.
func Register(tb testing.TB, owned, local []byte) (ownerReg *memory.Registry, ownerRegion, localRegion *memory.Region) {
	tb.Helper()
	ownerReg = memory.NewRegistry()
	oregs, err := ownerReg.Register([]memory.Range{{Mem: owned}})
	if err != nil {
		tb.Fatal(err)
	}
	lregs, err := memory.NewRegistry().Register([]memory.Range{{Mem: local}})
	if err != nil {
		tb.Fatal(err)
	}
	return ownerReg, oregs[0], lregs[0]
}
