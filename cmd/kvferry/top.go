package main

// kvferry top: a live view of engines' metrics endpoints, refreshed every
// interval, in plain text (ANSI only to clear a terminal), so that it works
// over ssh and in a pipe.

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"golang.org/x/sys/unix"
)

func runTop(w io.Writer, args []string) error {
	fs := flag.NewFlagSet("top", flag.ContinueOnError)
	fs.SetOutput(w)
	interval := fs.Duration("interval", time.Second, "refresh period")
	count := fs.Int("count", 0, "frames to print, then exit (0: until interrupted)")
	fs.Usage = func() {
		fmt.Fprintf(w, "usage: kvferry top [--interval 1s] [--count N] ENDPOINT...\n\n"+
			"A live view of engines' metrics: ENDPOINT is host:port (an engine's\n"+
			"KVFERRY_METRICS_ADDR) or a URL of a /metrics that includes kvferry's series\n"+
			"(a serving process's own). Rates are over the last interval; latency\n"+
			"percentiles too once two frames were taken.\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() == 0 {
		fs.Usage()
		return errors.New("top: name at least one endpoint")
	}
	if *interval < 100*time.Millisecond {
		return fmt.Errorf("top: --interval %v: at least 100ms", *interval)
	}
	urls := make([]string, fs.NArg())
	for i, a := range fs.Args() {
		urls[i] = endpointURL(a)
	}
	clear := isTerminal(w)
	client := &http.Client{Timeout: max(*interval, 2*time.Second)}
	var prev []*sample
	for frame := 1; ; frame++ {
		cur := make([]*sample, len(urls))
		for i, u := range urls {
			cur[i] = scrapeEndpoint(client, u)
		}
		var b strings.Builder
		fmt.Fprintf(&b, "kvferry top  %s  every %v\n", time.Now().Format("15:04:05"), *interval)
		for i, s := range cur {
			var p *sample
			if prev != nil {
				p = prev[i]
			}
			renderEndpoint(&b, urls[i], p, s)
		}
		if clear {
			io.WriteString(w, "\x1b[H\x1b[2J")
		} else if frame > 1 {
			io.WriteString(w, "\n")
		}
		io.WriteString(w, b.String())
		if *count > 0 && frame >= *count {
			return nil
		}
		prev = cur
		time.Sleep(*interval)
	}
}

// clean makes what an endpoint sent safe to print: control characters
// (an ESC sequence could retitle, clear or rewrite the operator's terminal)
// become '?'.
func clean(s string) string {
	return strings.Map(func(r rune) rune {
		if r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0) {
			return '?'
		}
		return r
	}, s)
}

func endpointURL(a string) string {
	if strings.Contains(a, "://") {
		return a
	}
	return "http://" + a + "/metrics"
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

// sample is one scrape of one endpoint.
type sample struct {
	at  time.Time
	mfs map[string]*dto.MetricFamily
	err error
}

func scrapeEndpoint(c *http.Client, url string) *sample {
	s := &sample{at: time.Now()}
	ctx, cancel := context.WithTimeout(context.Background(), c.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		s.err = err
		return s
	}
	resp, err := c.Do(req)
	if err != nil {
		s.err = err
		return s
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		s.err = fmt.Errorf("%s", resp.Status)
		return s
	}
	s.mfs, s.err = parseText(io.LimitReader(resp.Body, 64<<20))
	return s
}

func parseText(r io.Reader) (map[string]*dto.MetricFamily, error) {
	p := expfmt.NewTextParser(model.UTF8Validation)
	return p.TextToMetricFamilies(r)
}

// series is one metric's series, keyed by its labels.
type series struct {
	labels map[string]string
	value  float64
	hist   *dto.Histogram
}

// engines splits a scrape's kvferry series by their engine label.
func (s *sample) series(name string) []series {
	if s == nil || s.mfs == nil {
		return nil
	}
	mf := s.mfs[name]
	if mf == nil {
		return nil
	}
	out := make([]series, 0, len(mf.Metric))
	for _, m := range mf.Metric {
		x := series{labels: map[string]string{}}
		for _, lp := range m.Label {
			x.labels[lp.GetName()] = clean(lp.GetValue())
		}
		switch {
		case m.Counter != nil:
			x.value = m.Counter.GetValue()
		case m.Gauge != nil:
			x.value = m.Gauge.GetValue()
		case m.Histogram != nil:
			x.hist = m.Histogram
			x.value = float64(m.Histogram.GetSampleCount())
		}
		out = append(out, x)
	}
	return out
}

func labelKey(l map[string]string, names ...string) string {
	parts := make([]string, len(names))
	for i, n := range names {
		parts[i] = l[n]
	}
	return strings.Join(parts, "\x00")
}

// sumBy adds name's series of engine by the labels named.
func (s *sample) sumBy(name, engine string, by ...string) map[string]float64 {
	out := map[string]float64{}
	for _, x := range s.series(name) {
		if x.labels["engine"] != engine {
			continue
		}
		out[labelKey(x.labels, by...)] += x.value
	}
	return out
}

func (s *sample) engines() []string {
	seen := map[string]bool{}
	for _, x := range s.series("kvferry_info") {
		seen[x.labels["engine"]] = true
	}
	out := make([]string, 0, len(seen))
	for e := range seen {
		out = append(out, e)
	}
	sort.Strings(out)
	return out
}

// rate is (cur-prev)/seconds per key; without prev it is NaN (no rate yet).
func rate(cur, prev map[string]float64, secs float64) map[string]float64 {
	out := map[string]float64{}
	for k, v := range cur {
		if prev == nil || secs <= 0 {
			out[k] = math.NaN()
			continue
		}
		d := v - prev[k]
		if d < 0 { // a counter reset: the engine restarted
			d = v
		}
		out[k] = d / secs
	}
	return out
}

// histDelta merges engine's series of a histogram matching match, less
// prev's (the interval's observations); with no prev, since the start.
func histDelta(cur, prev *sample, name, engine string, match func(map[string]string) bool) (bounds []float64, counts []float64, total float64) {
	acc := func(s *sample, sign float64) {
		for _, x := range s.series(name) {
			if x.labels["engine"] != engine || x.hist == nil || !match(x.labels) {
				continue
			}
			if bounds == nil {
				for _, b := range x.hist.Bucket {
					bounds = append(bounds, b.GetUpperBound())
				}
				counts = make([]float64, len(bounds))
			}
			for i, b := range x.hist.Bucket {
				if i < len(counts) {
					counts[i] += sign * float64(b.GetCumulativeCount())
				}
			}
			total += sign * float64(x.hist.GetSampleCount())
		}
	}
	acc(cur, 1)
	if prev != nil && prev.mfs != nil {
		acc(prev, -1)
	}
	return bounds, counts, total
}

// quantile estimates the q-quantile from cumulative bucket counts, as
// PromQL's histogram_quantile does (linear within a bucket); NaN without
// observations.
func quantile(q float64, bounds, cum []float64, total float64) float64 {
	if total <= 0 || len(bounds) == 0 {
		return math.NaN()
	}
	rank := q * total
	lower, below := 0.0, 0.0
	for i, b := range bounds {
		if math.IsInf(b, 1) {
			// Past the last finite bound nothing says how far: PromQL
			// answers that bound, and so does top.
			return lower
		}
		if cum[i] >= rank {
			in := cum[i] - below
			if in <= 0 {
				return b
			}
			return lower + (b-lower)*(rank-below)/in
		}
		lower, below = b, cum[i]
	}
	return bounds[len(bounds)-1] // beyond the last bound: say the last bound
}

func fmtRate(v float64, unit string) string {
	if math.IsNaN(v) {
		return "-"
	}
	if unit == "" {
		return fmt.Sprintf("%.1f", v)
	}
	return fmt.Sprintf("%.1f %s", v, unit)
}

func fmtDur(sec float64) string {
	if math.IsNaN(sec) {
		return "-"
	}
	d := time.Duration(sec * float64(time.Second))
	switch {
	case d < time.Millisecond:
		return fmt.Sprintf("%dµs", d.Microseconds())
	case d < time.Second:
		return fmt.Sprintf("%.1fms", float64(d.Microseconds())/1000)
	}
	return fmt.Sprintf("%.2fs", d.Seconds())
}

func renderEndpoint(b *strings.Builder, url string, prev, cur *sample) {
	if cur.err != nil {
		fmt.Fprintf(b, "\n%s: %s\n", clean(url), clean(cur.err.Error()))
		return
	}
	engines := cur.engines()
	if len(engines) == 0 {
		fmt.Fprintf(b, "\n%s: no kvferry series\n", clean(url))
		return
	}
	secs := 0.0
	if prev != nil && prev.err == nil && prev.mfs != nil {
		secs = cur.at.Sub(prev.at).Seconds()
	} else {
		prev = nil
	}
	for _, eng := range engines {
		g := func(name string, by ...string) map[string]float64 { return cur.sumBy(name, eng, by...) }
		one := func(name string) float64 { return g(name)[""] }
		var version string
		for _, x := range cur.series("kvferry_info") {
			if x.labels["engine"] == eng {
				version = x.labels["version"]
			}
		}
		paths := g("kvferry_paths_open", "transport")
		var ps []string
		for _, tr := range []string{"tcp", "rdma", "shm", "local"} {
			if paths[tr] > 0 {
				ps = append(ps, fmt.Sprintf("%s %.0f", tr, paths[tr]))
			}
		}
		fmt.Fprintf(b, "\nengine %s  (%s, kvferry %s)\n", eng, clean(url), version)
		fmt.Fprintf(b, "  in flight: %.0f transfers, %s   segments %.0f (dead %.0f)   paths: %s\n",
			one("kvferry_tasks_in_flight"), fmtBytes(one("kvferry_bytes_in_flight")), one("kvferry_segments_open"),
			one("kvferry_peers_dead"), orDash(strings.Join(ps, ", ")))

		// Per peer, as initiator.
		var pb, pt map[string]float64
		if prev != nil {
			pb = prev.sumBy("kvferry_transfer_bytes_total", eng, "peer", "op", "transport")
			pt = prev.sumBy("kvferry_transfers_total", eng, "peer", "op", "transport")
		}
		bytesRate := rate(g("kvferry_transfer_bytes_total", "peer", "op", "transport"), pb, secs)
		tasks := g("kvferry_transfers_total", "peer", "op", "transport")
		taskRate := rate(tasks, pt, secs)
		var failedPrev map[string]float64
		if prev != nil {
			failedPrev = prev.sumByFailed(eng)
		}
		failed := rate(cur.sumByFailed(eng), failedPrev, secs)
		keys := make([]string, 0, len(tasks))
		for k := range tasks {
			keys = append(keys, k)
		}
		sort.Slice(keys, func(i, j int) bool {
			ri, rj := bytesRate[keys[i]], bytesRate[keys[j]]
			if ri != rj && !math.IsNaN(ri) && !math.IsNaN(rj) {
				return ri > rj
			}
			return keys[i] < keys[j]
		})
		tw := tabwriter.NewWriter(b, 2, 8, 2, ' ', 0)
		fmt.Fprintln(tw, "  PEER\tOP\tTRANSPORT\tMB/s\ttransfers/s\tnot completed/s\t")
		for _, k := range keys {
			f := strings.Split(k, "\x00")
			fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%s\t%s\t\n", f[0], f[1], f[2], fmtRate(bytesRate[k]/1e6, ""), fmtRate(taskRate[k], ""), fmtRate(failed[k], ""))
		}
		if len(keys) == 0 {
			fmt.Fprintln(tw, "  (no transfers initiated)\t\t\t\t\t\t")
		}
		tw.Flush()

		// As owner.
		var po map[string]float64
		if prev != nil {
			po = prev.sumBy("kvferry_owner_bytes_total", eng, "direction", "transport")
		}
		own := rate(g("kvferry_owner_bytes_total", "direction", "transport"), po, secs)
		okeys := sortedKeys(own)
		var owned []string
		for _, k := range okeys {
			f := strings.Split(k, "\x00")
			owned = append(owned, fmt.Sprintf("%s %s %s MB/s", f[1], f[0], fmtRate(own[k]/1e6, "")))
		}
		fmt.Fprintf(b, "  as owner: %s\n", orDash(strings.Join(owned, ", ")))

		// Latencies over the interval (since the start in the first frame).
		lat := func(name string, match func(map[string]string) bool) string {
			bounds, cum, total := histDelta(cur, prev, name, eng, match)
			if total <= 0 {
				return "-"
			}
			return fmt.Sprintf("p50 %s p99 %s (n=%.0f)", fmtDur(quantile(0.5, bounds, cum, total)), fmtDur(quantile(0.99, bounds, cum, total)), total)
		}
		for _, op := range []string{"write", "read"} {
			var parts []string
			for _, size := range []string{"le_64KiB", "le_1MiB", "le_16MiB", "gt_16MiB"} {
				l := lat("kvferry_transfer_duration_seconds", func(m map[string]string) bool { return m["op"] == op && m["size"] == size })
				if l != "-" {
					parts = append(parts, strings.TrimPrefix(size, "le_")+": "+l)
				}
			}
			if len(parts) > 0 {
				fmt.Fprintf(b, "  %s latency: %s\n", op, strings.Join(parts, "; "))
			}
		}
		all := func(map[string]string) bool { return true }
		fmt.Fprintf(b, "  abort→safe: %s   fence→safe: %s   heartbeat rtt: %s\n",
			lat("kvferry_abort_duration_seconds", all), lat("kvferry_fence_duration_seconds", all), lat("kvferry_heartbeat_rtt_seconds", all))
		aborts := g("kvferry_aborts_total", "outcome")
		fences := g("kvferry_fences_total", "outcome")
		fmt.Fprintf(b, "  aborts: %.0f safe, %.0f not safe   fences: %.0f safe, %.0f not safe   retries %.0f   redials %.0f\n",
			aborts["safe"], aborts["not_safe"], fences["safe"], fences["not_safe"], one("kvferry_transfer_retries_total"), one("kvferry_path_redials_total"))

		// Refusals: totals, and what the interval added.
		var rp map[string]float64
		if prev != nil {
			rp = prev.sumBy("kvferry_owner_refusals_total", eng, "reason")
		}
		refused := g("kvferry_owner_refusals_total", "reason")
		var rs []string
		for _, k := range sortedKeys(refused) {
			if refused[k] == 0 {
				continue
			}
			s := fmt.Sprintf("%s %.0f", k, refused[k])
			if rp != nil && refused[k] > rp[k] {
				s += fmt.Sprintf(" (+%.0f)", refused[k]-rp[k])
			}
			rs = append(rs, s)
		}
		fmt.Fprintf(b, "  refused: %s\n", orDash(strings.Join(rs, ", ")))
	}
}

// sumByFailed adds, per peer, op and transport, the transfers of engine
// that did not complete.
func (s *sample) sumByFailed(engine string) map[string]float64 {
	out := map[string]float64{}
	for _, x := range s.series("kvferry_transfers_total") {
		if x.labels["engine"] != engine {
			continue
		}
		k := labelKey(x.labels, "peer", "op", "transport")
		if x.labels["status"] != "completed" {
			out[k] += x.value
		} else if _, ok := out[k]; !ok {
			out[k] = 0
		}
	}
	return out
}

func sortedKeys(m map[string]float64) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func fmtBytes(v float64) string {
	switch {
	case v >= 1<<30:
		return fmt.Sprintf("%.1f GiB", v/(1<<30))
	case v >= 1<<20:
		return fmt.Sprintf("%.1f MiB", v/(1<<20))
	case v >= 1<<10:
		return fmt.Sprintf("%.1f KiB", v/(1<<10))
	}
	return fmt.Sprintf("%.0f B", v)
}
