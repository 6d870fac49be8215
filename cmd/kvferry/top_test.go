package main

import (
	"bytes"
	"context"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
)

func mustSample(t *testing.T, at time.Time, text string) *sample {
	t.Helper()
	mfs, err := parseText(strings.NewReader(text))
	if err != nil {
		t.Fatalf("parse: %v", err)
	}
	return &sample{at: at, mfs: mfs}
}

const topScrape1 = `# TYPE kvferry_info gauge
kvferry_info{engine="a:1",version="0.7.0"} 1
# TYPE kvferry_transfer_bytes_total counter
kvferry_transfer_bytes_total{engine="a:1",op="write",peer="b:2",transport="tcp"} 1e9
# TYPE kvferry_transfers_total counter
kvferry_transfers_total{engine="a:1",op="write",peer="b:2",status="completed",transport="tcp"} 1000
kvferry_transfers_total{engine="a:1",op="write",peer="b:2",status="failed",transport="tcp"} 1
# TYPE kvferry_transfer_duration_seconds histogram
kvferry_transfer_duration_seconds_bucket{engine="a:1",op="write",size="le_1MiB",le="0.001"} 500
kvferry_transfer_duration_seconds_bucket{engine="a:1",op="write",size="le_1MiB",le="0.002"} 1000
kvferry_transfer_duration_seconds_bucket{engine="a:1",op="write",size="le_1MiB",le="+Inf"} 1000
kvferry_transfer_duration_seconds_sum{engine="a:1",op="write",size="le_1MiB"} 1
kvferry_transfer_duration_seconds_count{engine="a:1",op="write",size="le_1MiB"} 1000
# TYPE kvferry_owner_refusals_total counter
kvferry_owner_refusals_total{engine="a:1",reason="aborted"} 2
`

// Two seconds later: 3e9 more bytes, 3000 more transfers (of which 4 more
// failed), the new ones all between 2 and 4 ms, 5 more refusals.
const topScrape2 = `# TYPE kvferry_info gauge
kvferry_info{engine="a:1",version="0.7.0"} 1
# TYPE kvferry_transfer_bytes_total counter
kvferry_transfer_bytes_total{engine="a:1",op="write",peer="b:2",transport="tcp"} 4e9
# TYPE kvferry_transfers_total counter
kvferry_transfers_total{engine="a:1",op="write",peer="b:2",status="completed",transport="tcp"} 3996
kvferry_transfers_total{engine="a:1",op="write",peer="b:2",status="failed",transport="tcp"} 5
# TYPE kvferry_transfer_duration_seconds histogram
kvferry_transfer_duration_seconds_bucket{engine="a:1",op="write",size="le_1MiB",le="0.001"} 500
kvferry_transfer_duration_seconds_bucket{engine="a:1",op="write",size="le_1MiB",le="0.002"} 1000
kvferry_transfer_duration_seconds_bucket{engine="a:1",op="write",size="le_1MiB",le="0.004"} 3996
kvferry_transfer_duration_seconds_bucket{engine="a:1",op="write",size="le_1MiB",le="+Inf"} 3996
kvferry_transfer_duration_seconds_sum{engine="a:1",op="write",size="le_1MiB"} 10
kvferry_transfer_duration_seconds_count{engine="a:1",op="write",size="le_1MiB"} 3996
# TYPE kvferry_owner_refusals_total counter
kvferry_owner_refusals_total{engine="a:1",reason="aborted"} 7
`

func TestTopShowsRatesOverTheIntervalAndItsLatencyPercentiles(t *testing.T) {
	t0 := time.Unix(1000, 0)
	s1 := mustSample(t, t0, topScrape1)
	s2 := mustSample(t, t0.Add(2*time.Second), topScrape2)
	var b strings.Builder
	renderEndpoint(&b, "http://x/metrics", s1, s2)
	out := b.String()
	// 3e9 bytes in 2 s: 1500 MB/s; 3000 transfers: 1500/s; 4 failed: 2/s.
	line := lineWith(out, "b:2")
	for _, want := range []string{"write", "tcp", "1500.0", "1500.0", "2.0"} {
		if !strings.Contains(line, want) {
			t.Errorf("peer line %q lacks %q\n%s", line, want, out)
		}
	}
	// The interval's 2996 observations all lie in (2 ms, 4 ms]: p50 is
	// about 3 ms, not the 1 ms of the run's start.
	lat := lineWith(out, "write latency")
	if !strings.Contains(lat, "p50 3.0ms") || !strings.Contains(lat, "n=2996") {
		t.Errorf("latency line %q: want p50 3.0ms over n=2996", lat)
	}
	if ref := lineWith(out, "refused"); !strings.Contains(ref, "aborted 7 (+5)") {
		t.Errorf("refusals line %q: want aborted 7 (+5)", ref)
	}

	// A first frame has no rates yet, and says so with dashes.
	b.Reset()
	renderEndpoint(&b, "http://x/metrics", nil, s1)
	if line := lineWith(b.String(), "b:2"); !strings.Contains(line, "-") || strings.Contains(line, "1500") {
		t.Errorf("first frame peer line %q: want no rate", line)
	}
}

func TestQuantileInterpolatesWithinABucketAsPromQLDoes(t *testing.T) {
	bounds := []float64{1, 2, 4}
	cum := []float64{10, 20, 40}
	for _, c := range []struct{ q, want float64 }{{0.25, 1}, {0.5, 2}, {0.75, 3}, {1, 4}} {
		if got := quantile(c.q, bounds, cum, 40); math.Abs(got-c.want) > 1e-9 {
			t.Errorf("quantile(%v) = %v, want %v", c.q, got, c.want)
		}
	}
	if !math.IsNaN(quantile(0.5, bounds, []float64{0, 0, 0}, 0)) {
		t.Error("quantile of nothing is not NaN")
	}
}

func TestTopReadsALiveEngineAndReportsAnUnreachableOne(t *testing.T) {
	opts := engine.Options{IgnoreEnv: true, Protocol: "tcp", MetricsAddr: "127.0.0.1:0"}
	owner, err := engine.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	defer owner.Close()
	init, err := engine.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	defer init.Close()
	dst, err := owner.AllocBuffer(1<<20, "cpu")
	if err != nil {
		t.Fatal(err)
	}
	src, err := init.AllocBuffer(1<<20, "cpu")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	seg, err := init.OpenSegment(ctx, owner.Name())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := init.Transfer(ctx, []engine.Request{{Op: engine.Write, Local: engine.AddrOf(src), Segment: seg, Remote: engine.AddrOf(dst), Length: 1 << 20}}); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := runTop(&out, []string{"--count", "1", "--interval", "100ms", init.MetricsAddr(), "127.0.0.1:1"}); err != nil {
		t.Fatalf("top: %v\n%s", err, out.String())
	}
	text := out.String()
	for _, want := range []string{"engine " + init.Name(), "engine " + owner.Name(), owner.Name() + "  write  tcp", "http://127.0.0.1:1/metrics: "} {
		if !strings.Contains(text, want) {
			t.Errorf("top output lacks %q:\n%s", want, text)
		}
	}
}

func lineWith(text, s string) string {
	for _, l := range strings.Split(text, "\n") {
		if strings.Contains(l, s) {
			return l
		}
	}
	return ""
}
