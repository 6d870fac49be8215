package engine

import (
	"fmt"
	"strconv"
	"strings"
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

// A thousand peers make at most MetricsPeers+1 peer label values in what an
// engine serves, every byte counted, and labels moving between them leave
// the text valid and still bounded.
func TestAThousandPeersStayWithinTheLabelBoundInTheEnginesText(t *testing.T) {
	e, err := New(Options{IgnoreEnv: true, Protocol: "tcp", MetricsPeers: 16})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	const peers = 1000
	segs := make([]*Segment, peers)
	countAll := func() {
		for i, seg := range segs {
			tk := &task{req: Request{Op: Write, Length: uint64(1000 + i), Segment: seg}, start: monoNow()}
			e.metrics.taskEnded(tk, Completed)
		}
	}
	for i := range segs {
		segs[i] = &Segment{name: fmt.Sprintf("10.1.%d.%d:7000", i/250, i%250)}
	}
	for range 3 {
		countAll()
	}
	labels, total := peerBytes(t, e)
	if len(labels) > 17 || !labels["other"] {
		t.Fatalf("%d peer label values for %d peers (MetricsPeers 16): %v", len(labels), peers, labels)
	}
	want := 0.0
	for i := range peers {
		want += 3 * float64(1000+i)
	}
	if total != want {
		t.Fatalf("bytes over every label = %v, want %v", total, want)
	}

	// Only the last 500 stay busy: the idle labeled peers give their
	// labels up to them.
	segs = segs[500:]
	e.metrics.peers.Rebalance()
	countAll()
	e.metrics.peers.Rebalance()
	countAll()
	labels, _ = peerBytes(t, e)
	if len(labels) > 17 {
		t.Fatalf("%d peer label values after labels moved: %v", len(labels), labels)
	}
	for name := range labels {
		if name != "other" && name < "10.1.2." {
			t.Errorf("idle peer %s kept its label", name)
		}
	}
}

// peerBytes parses the engine's text: the peer label values of
// kvferry_transfer_bytes_total, and the sum of its series.
func peerBytes(t *testing.T, e *Engine) (map[string]bool, float64) {
	t.Helper()
	text, err := e.MetricsText()
	if err != nil {
		t.Fatal(err)
	}
	labels := map[string]bool{}
	var total float64
	for _, line := range strings.Split(text, "\n") {
		if !strings.HasPrefix(line, "kvferry_transfer_bytes_total{") {
			continue
		}
		i := strings.Index(line, `peer="`)
		labels[line[i+6:i+6+strings.Index(line[i+6:], `"`)]] = true
		v, err := strconv.ParseFloat(line[strings.LastIndex(line, " ")+1:], 64)
		if err != nil {
			t.Fatal(err)
		}
		total += v
	}
	return labels, total
}
