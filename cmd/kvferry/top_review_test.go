package main

import (
	"strings"
	"testing"
	"time"
)

// kvferry top prints what arbitrary HTTP endpoints send straight to the
// terminal. Label values may hold any UTF-8, control characters included:
// an endpoint (or a peer name that reached a label) with ESC sequences
// could retitle, clear or rewrite the operator's terminal. What top prints
// of an endpoint's text must carry no control characters.
func TestTopPrintsNoControlCharactersAnEndpointSent(t *testing.T) {
	const esc = "\x1b]0;owned\x07\x1b[2J"
	text := "# TYPE kvferry_info gauge\n" +
		"kvferry_info{engine=\"a:1" + esc + "\",version=\"0.7.0" + esc + "\"} 1\n" +
		"# TYPE kvferry_transfers_total counter\n" +
		"kvferry_transfers_total{engine=\"a:1" + esc + "\",op=\"write\",peer=\"p" + esc + "\",status=\"completed\",transport=\"tcp\"} 3\n"
	cur := mustSample(t, time.Now(), text)
	var b strings.Builder
	renderEndpoint(&b, "http://x/metrics", nil, cur)
	out := b.String()
	for i, r := range out {
		if r < 0x20 && r != '\n' && r != '\t' || r == 0x7f {
			t.Fatalf("output holds control character %#x at %d:\n%q", r, i, out)
		}
	}
}

// Latencies past the last finite bucket (a transfer that took minutes)
// land in the +Inf bucket. PromQL's histogram_quantile then answers the
// last finite bound, and top's quantile says it does the same; top must
// not print an infinite or negative duration.
func TestTopLatencyPastTheLastBucketShowsTheLastFiniteBound(t *testing.T) {
	text := `# TYPE kvferry_info gauge
kvferry_info{engine="a:1",version="0.7.0"} 1
# TYPE kvferry_transfer_duration_seconds histogram
kvferry_transfer_duration_seconds_bucket{engine="a:1",op="write",size="gt_16MiB",le="41.94304"} 0
kvferry_transfer_duration_seconds_bucket{engine="a:1",op="write",size="gt_16MiB",le="83.88608"} 0
kvferry_transfer_duration_seconds_bucket{engine="a:1",op="write",size="gt_16MiB",le="+Inf"} 10
kvferry_transfer_duration_seconds_sum{engine="a:1",op="write",size="gt_16MiB"} 1200
kvferry_transfer_duration_seconds_count{engine="a:1",op="write",size="gt_16MiB"} 10
`
	cur := mustSample(t, time.Now(), text)
	var b strings.Builder
	renderEndpoint(&b, "http://x/metrics", nil, cur)
	line := lineWith(b.String(), "write latency")
	if !strings.Contains(line, "p50 83.89s") || !strings.Contains(line, "p99 83.89s") {
		t.Errorf("latency line for transfers past the last bucket: %q; want p50 and p99 at the last finite bound, 83.89s", line)
	}
}
