package fence

import (
	"sync/atomic"
	"testing"
)

// The cost of the fence guard on the data path: every chunk of every tcp
// and local access, on every connection, takes the table's one mutex twice
// and inserts into and deletes from one shared map, fence or no fence
// (Admit wraps every non-rdma access). The benchmarks compare a chunk's
// Enter/Leave through the fence guard with the inner guard alone, from
// GOMAXPROCS goroutines, each its own access (as connections are).
func BenchmarkGuardEnterLeaveParallel(b *testing.B) {
	tb := New(0)
	var next atomic.Uint64
	b.RunParallel(func(pb *testing.PB) {
		i := next.Add(1)
		g := tb.Guard(nopGuard{}, 0, i<<20, 1<<20)
		for pb.Next() {
			if err := g.Enter(); err != nil {
				b.Fatal(err)
			}
			g.Leave()
		}
	})
}

func BenchmarkInnerGuardOnlyParallel(b *testing.B) {
	b.RunParallel(func(pb *testing.PB) {
		var g nopGuard
		for pb.Next() {
			if err := g.Enter(); err != nil {
				b.Fatal(err)
			}
			g.Leave()
		}
	})
}
