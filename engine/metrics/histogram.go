package metrics

import (
	"sort"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Histogram is a latency histogram for the data path, split in Shards like
// the peer counters: client_golang's histogram makes every observation
// update one shared word, which the cores then take turns at. Bounds are
// LatencyBuckets; the sum is kept in nanoseconds, an integer, so adding to
// it is one atomic add rather than a compare-and-swap loop.
type Histogram struct {
	shards [Shards]histShard
}

// histShard keeps, per bucket (the last is +Inf), its count and the sum of
// its observations side by side, so that an observation touches one cache
// line; the histogram's sum is the buckets' sums.
type histShard struct {
	buckets [len(latencyBoundsNanos) + 1]struct {
		count atomic.Uint64
		sum   atomic.Uint64 // nanoseconds
	}
	_ [64 - ((len(latencyBoundsNanos)+1)*16)%64]byte
}

var latencyBoundsNanos = func() [24]int64 {
	var b [24]int64
	for i, s := range LatencyBuckets {
		b[i] = int64(s * 1e9)
	}
	return b
}()

// Observe records d in shard (taken modulo Shards).
func (h *Histogram) Observe(shard int, d time.Duration) {
	s := &h.shards[shard%Shards]
	i := sort.Search(len(latencyBoundsNanos), func(i int) bool { return int64(d) <= latencyBoundsNanos[i] })
	s.buckets[i].count.Add(1)
	s.buckets[i].sum.Add(uint64(max(d, 0)))
}

// Metric returns the histogram as a Prometheus constant histogram of desc
// with labelValues. The shards are read one after the other while counting
// may go on, so a scrape may see an observation's bucket and not yet its
// count: the count reported is the buckets' total, which keeps every scrape
// self-consistent.
func (h *Histogram) Metric(desc *prometheus.Desc, labelValues ...string) prometheus.Metric {
	var buckets [len(latencyBoundsNanos) + 1]uint64
	var sum uint64
	for i := range h.shards {
		s := &h.shards[i]
		for b := range s.buckets {
			buckets[b] += s.buckets[b].count.Load()
			sum += s.buckets[b].sum.Load()
		}
	}
	cum := make(map[float64]uint64, len(LatencyBuckets))
	var n uint64
	for i, bound := range LatencyBuckets {
		n += buckets[i]
		cum[bound] = n
	}
	n += buckets[len(buckets)-1]
	return prometheus.MustNewConstHistogram(desc, n, float64(sum)/1e9, cum, labelValues...)
}

// Count returns how many observations were made.
func (h *Histogram) Count() uint64 {
	var n uint64
	for i := range h.shards {
		for b := range h.shards[i].buckets {
			n += h.shards[i].buckets[b].count.Load()
		}
	}
	return n
}
