package main

import (
	"strings"
	"testing"
	"time"
)

// FuzzTopRender parses two arbitrary texts, as kvferry top reads them from
// arbitrary HTTP endpoints, and renders them as two frames (the second with
// the first as its previous scrape): nothing an endpoint sends may panic
// top. Texts that do not parse are rendered as the scrape error they are.
func FuzzTopRender(f *testing.F) {
	f.Add(topScrape1, topScrape2)
	f.Add(topScrape2, topScrape1)
	f.Add("", topScrape1)
	f.Add(`# TYPE kvferry_info gauge
kvferry_info{engine="e"} 1
# TYPE kvferry_transfer_duration_seconds histogram
kvferry_transfer_duration_seconds_bucket{engine="e",op="write",size="le_64KiB",le="+Inf"} 3
kvferry_transfer_duration_seconds_count{engine="e",op="write",size="le_64KiB"} 3
`, `# TYPE kvferry_info gauge
kvferry_info{engine="e"} 1
# TYPE kvferry_transfer_duration_seconds histogram
kvferry_transfer_duration_seconds_bucket{engine="e",op="write",size="le_64KiB",le="0.1"} 1
kvferry_transfer_duration_seconds_bucket{engine="e",op="write",size="le_64KiB",le="0.2"} 1
kvferry_transfer_duration_seconds_count{engine="e",op="write",size="le_64KiB"} NaN
`)
	f.Fuzz(func(t *testing.T, a, b string) {
		at := time.Unix(1000, 0)
		mk := func(text string, at time.Time) *sample {
			s := &sample{at: at}
			s.mfs, s.err = parseText(strings.NewReader(text))
			return s
		}
		prev, cur := mk(a, at), mk(b, at.Add(time.Second))
		var out strings.Builder
		renderEndpoint(&out, "http://x/metrics", nil, prev)
		renderEndpoint(&out, "http://x/metrics", prev, cur)
		renderEndpoint(&out, "http://x/metrics", cur, cur) // zero interval
		for i, r := range out.String() {
			if r < 0x20 && r != '\n' || r == 0x7f || r >= 0x80 && r < 0xa0 {
				t.Fatalf("control character %#x at %d of top's output", r, i)
			}
		}
	})
}
