package memory

import (
	"math"
	"testing"
)

// Keys are never reused within a registry, also past 2^32 registrations:
// a key that came back would let a transfer planned against memory that
// changed hands land in it.
func TestKeysAreNotReusedPastTwoToTheThirtyTwoRegistrations(t *testing.T) {
	g := NewRegistry()
	mem := make([]byte, 4096)
	register := func() Key {
		regs, err := g.Register([]Range{{Mem: mem}})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := g.Unregister([]uint64{regs[0].Addr}); err != nil {
			t.Fatal(err)
		}
		return regs[0].Key
	}
	first := register()
	g.next.Store(math.MaxUint32) // as if 2^32 - 1 registrations had happened
	seen := map[Key]bool{first: true}
	for i := 0; i < 3; i++ {
		k := register()
		if seen[k] {
			t.Fatalf("key %#x handed out again after %d registrations", uint64(k), uint64(math.MaxUint32)+uint64(i)+1)
		}
		seen[k] = true
	}
}
