package engine

import (
	"testing"
)

// BenchmarkMetricsPerTask is what counting one ended task costs (per-peer
// counters, bytes in flight, the latency histogram): compare it with the
// CPU time of one 64 KiB transfer (kvferry-bench --mode metrics-cost
// measures the whole data path with counting on and off, in one run).
func BenchmarkMetricsPerTask(b *testing.B) {
	m := newEngineMetrics("bench:1", 32)
	seg := &Segment{name: "127.0.0.1:5000"}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		// Each goroutine ends its own tasks, as cores do: records of a
		// slab, so in different shards.
		ts := make([]task, 16)
		for i := range ts {
			ts[i] = task{req: Request{Op: Write, Length: 64 << 10, Segment: seg}, start: monoNow()}
		}
		i := 0
		for pb.Next() {
			t := &ts[i%len(ts)]
			i++
			m.taskEnded(t, Completed)
		}
	})
}
