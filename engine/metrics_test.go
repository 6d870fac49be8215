package engine_test

import (
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kvferry/kvferry/engine"
)

// scrape is one parse of an engine's metrics text.
type scrape map[string]*dto.MetricFamily

// parseMetrics parses text with the Prometheus text parser, failing the
// test when it does not parse.
func parseMetrics(t testing.TB, text string) scrape {
	t.Helper()
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(strings.NewReader(text))
	if err != nil {
		t.Fatalf("metrics text does not parse: %v\n%s", err, text)
	}
	return mfs
}

func metricsOf(t testing.TB, e *engine.Engine) scrape {
	t.Helper()
	text, err := e.MetricsText()
	if err != nil {
		t.Fatalf("MetricsText: %v", err)
	}
	return parseMetrics(t, text)
}

// matching returns name's series whose labels include labels (alternate
// names and values; labels not named are not looked at).
func (s scrape) matching(name string, labels ...string) []*dto.Metric {
	mf := s[name]
	if mf == nil {
		return nil
	}
	var out []*dto.Metric
next:
	for _, m := range mf.Metric {
		for i := 0; i+1 < len(labels); i += 2 {
			found := false
			for _, lp := range m.Label {
				if lp.GetName() == labels[i] && lp.GetValue() == labels[i+1] {
					found = true
				}
			}
			if !found {
				continue next
			}
		}
		out = append(out, m)
	}
	return out
}

// valueOf is a counter's or gauge's value, or a histogram's count.
func valueOf(m *dto.Metric) float64 {
	switch {
	case m.Counter != nil:
		return m.Counter.GetValue()
	case m.Gauge != nil:
		return m.Gauge.GetValue()
	case m.Histogram != nil:
		return float64(m.Histogram.GetSampleCount())
	}
	return 0
}

// value returns the value of the first series name{labels...}, and
// whether there is one.
func (s scrape) value(name string, labels ...string) (float64, bool) {
	ms := s.matching(name, labels...)
	if len(ms) == 0 {
		return 0, false
	}
	return valueOf(ms[0]), true
}

// sum adds the values of every series of name matching labels.
func (s scrape) sum(name string, labels ...string) float64 {
	var total float64
	for _, m := range s.matching(name, labels...) {
		total += valueOf(m)
	}
	return total
}

// labelValues returns the distinct values label takes across name's series.
func (s scrape) labelValues(name, label string) map[string]bool {
	out := map[string]bool{}
	if mf := s[name]; mf != nil {
		for _, m := range mf.Metric {
			for _, lp := range m.Label {
				if lp.GetName() == label {
					out[lp.GetValue()] = true
				}
			}
		}
	}
	return out
}

func (s scrape) require(t testing.TB, want float64, name string, labels ...string) {
	t.Helper()
	got, ok := s.value(name, labels...)
	if !ok || got != want {
		t.Errorf("%s%v = %v (present %v), want %v", name, labels, got, ok, want)
	}
}

func TestMetricsCountTransfersByPeerOpAndTransportWithTheirBytes(t *testing.T) {
	p := newAbortPair(t, engine.Options{}, 4<<20)
	fillByte(p.src, 0x5A)
	for range 3 {
		transfer(t, p.init, 10*time.Second, write(p.src, p.seg, engine.AddrOf(p.dst), 4<<20))
	}
	transfer(t, p.init, 10*time.Second, read(p.src[:64<<10], p.seg, engine.AddrOf(p.dst), 64<<10))

	m := metricsOf(t, p.init)
	peer := p.owner.Name()
	m.require(t, 12<<20, "kvferry_transfer_bytes_total", "peer", peer, "op", "write", "transport", "tcp")
	m.require(t, 64<<10, "kvferry_transfer_bytes_total", "peer", peer, "op", "read", "transport", "tcp")
	m.require(t, 3, "kvferry_transfers_total", "peer", peer, "op", "write", "transport", "tcp", "status", "completed")
	m.require(t, 1, "kvferry_transfers_total", "peer", peer, "op", "read", "transport", "tcp", "status", "completed")
	m.require(t, 3, "kvferry_transfer_duration_seconds", "op", "write", "size", "le_16MiB")
	m.require(t, 1, "kvferry_transfer_duration_seconds", "op", "read", "size", "le_64KiB")
	m.require(t, 0, "kvferry_transfer_duration_seconds", "op", "write", "size", "le_64KiB")
	m.require(t, 0, "kvferry_tasks_in_flight")
	m.require(t, 0, "kvferry_bytes_in_flight")
	m.require(t, 1, "kvferry_segments_open")
	m.require(t, 1, "kvferry_info", "version", engine.Version)
	if got := m.labelValues("kvferry_transfers_total", "engine"); !got[p.init.Name()] || len(got) != 1 {
		t.Errorf("engine labels = %v, want only %s", got, p.init.Name())
	}
	if paths, _ := m.value("kvferry_paths_open", "transport", "tcp"); paths < 1 {
		t.Errorf("kvferry_paths_open{tcp} = %v, want at least 1", paths)
	}
	if ok := m.sum("kvferry_path_dials_total", "transport", "tcp", "result", "ok"); ok < 1 {
		t.Errorf("kvferry_path_dials_total{tcp,ok} = %v, want at least 1", ok)
	}

	// The owner counts the same bytes coming in and going out.
	o := metricsOf(t, p.owner)
	o.require(t, 12<<20, "kvferry_owner_bytes_total", "direction", "in", "transport", "tcp")
	o.require(t, 64<<10, "kvferry_owner_bytes_total", "direction", "out", "transport", "tcp")
	o.require(t, 4<<20, "kvferry_registered_bytes", "location", "host")
	o.require(t, 0, "kvferry_owner_refusals_total", "reason", "aborted")
}

func TestMetricsCountAbortsAndTheOwnersRefusalsByReason(t *testing.T) {
	p := newAbortPair(t, engine.Options{}, 1<<20)
	other := newEngineWith(t, engine.Options{})
	src := alloc(t, other, 1<<20)
	oseg := openSegment(t, other, p.owner.Name())

	const rid = 77
	req := write(p.src, p.seg, engine.AddrOf(p.dst), 1<<20)
	req.RequestID = rid
	transfer(t, p.init, 10*time.Second, req)
	p.requireSafeAbort(t, rid)

	// Another initiator, not named in the abort, writes for the aborted
	// request: the owner refuses it, as aborted.
	late := write(src, oseg, engine.AddrOf(p.dst), 1<<20)
	late.RequestID = rid
	res, _ := other.Transfer(testCtx(t, 10*time.Second), []engine.Request{late})
	if res[0].Status != engine.Aborted {
		t.Fatalf("late write status = %v (%v), want ABORTED", res[0].Status, res[0].Err)
	}

	o := metricsOf(t, p.owner)
	o.require(t, 1, "kvferry_aborts_total", "outcome", "safe")
	o.require(t, 0, "kvferry_aborts_total", "outcome", "not_safe")
	o.require(t, 1, "kvferry_abort_duration_seconds", "outcome", "safe")
	o.require(t, 1, "kvferry_owner_refusals_total", "reason", "aborted")
	o.require(t, 0, "kvferry_owner_refusals_total", "reason", "stale_key")
	o.require(t, 1, "kvferry_tombstones", "side", "owner")

	m := metricsOf(t, other)
	m.require(t, 1, "kvferry_transfers_total", "peer", p.owner.Name(), "op", "write", "status", "aborted")
	if _, ok := m.value("kvferry_transfer_bytes_total", "peer", p.owner.Name()); ok {
		t.Error("an aborted write counted bytes")
	}
	// The owner resends its ABORT when the ACK is slower than 10 ms (a
	// loaded machine): the initiator counts each copy it heard and answers
	// each, so the count is 1 plus the resends that arrived.
	i := metricsOf(t, p.init)
	heard, _ := i.value("kvferry_aborts_received_total")
	acked, _ := i.value("kvferry_abort_acks_sent_total")
	if resends := p.owner.Stats().AbortResends; heard < 1 || heard > float64(1+resends) || acked != heard {
		t.Errorf("initiator heard %v ABORTs and sent %v ACKs; the owner sent 1 and resent %d", heard, acked, resends)
	}
}

func TestMetricsCountFencesAndTheirDuration(t *testing.T) {
	p := newAbortPair(t, engine.Options{}, 1<<20)
	transfer(t, p.init, 10*time.Second, write(p.src, p.seg, engine.AddrOf(p.dst), 1<<20))
	res, err := p.owner.Fence(testCtx(t, 10*time.Second), []engine.FenceRange{{Addr: engine.AddrOf(p.dst), Len: 1 << 20}})
	if err != nil || !res.Safe {
		t.Fatalf("fence = %+v, %v; want safe", res, err)
	}
	o := metricsOf(t, p.owner)
	o.require(t, 1, "kvferry_fences_total", "outcome", "safe")
	o.require(t, 1, "kvferry_fence_duration_seconds", "outcome", "safe")
	o.require(t, 1, "kvferry_fence_epoch")

	// The initiator's next write, planned before it heard of the fence or
	// after, is refused or resynced; either way no byte of it counts as
	// completed unless it really completed.
	before := metricsOf(t, p.init).sum("kvferry_transfer_bytes_total")
	r, _ := p.init.Transfer(testCtx(t, 10*time.Second), []engine.Request{write(p.src, p.seg, engine.AddrOf(p.dst), 1<<20)})
	after := metricsOf(t, p.init).sum("kvferry_transfer_bytes_total")
	want := before
	if r[0].Status == engine.Completed {
		want += 1 << 20
	}
	if after != want {
		t.Errorf("bytes after a write that ended %v = %v, want %v", r[0].Status, after, want)
	}
}

func TestMetricsCountAPeerThatDiesAndTheTransfersItFails(t *testing.T) {
	opts := engine.Options{HeartbeatInterval: 20 * time.Millisecond, HeartbeatMisses: 2}
	p := newAbortPair(t, opts, 1<<20)
	transfer(t, p.init, 10*time.Second, write(p.src, p.seg, engine.AddrOf(p.dst), 1<<20))
	waitFor(t, 10*time.Second, "a heartbeat answered", func() bool {
		v, _ := metricsOf(t, p.init).value("kvferry_heartbeat_rtt_seconds")
		return v >= 1
	})
	if err := p.owner.Close(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the peer declared dead", func() bool {
		v, _ := metricsOf(t, p.init).value("kvferry_peer_deaths_total")
		return v == 1
	})
	res, _ := p.init.Transfer(testCtx(t, 10*time.Second), []engine.Request{write(p.src, p.seg, engine.AddrOf(p.dst), 1<<20)})
	if res[0].Status == engine.Completed {
		t.Fatal("a write to a closed peer completed")
	}
	m := metricsOf(t, p.init)
	m.require(t, 1, "kvferry_peers_dead")
	m.require(t, 1, "kvferry_transfers_total", "peer", p.owner.Name(), "op", "write", "status", "completed")
	m.require(t, 1<<20, "kvferry_transfer_bytes_total", "peer", p.owner.Name(), "op", "write")
	if failed := m.sum("kvferry_transfers_total", "status", "failed"); failed != 1 {
		t.Errorf("failed transfers = %v, want 1", failed)
	}
}

func TestMetricsKeepPeerLabelsBoundedAndCountTheRestAsOther(t *testing.T) {
	const owners = 4
	init := newEngineWith(t, engine.Options{MetricsPeers: 2})
	src := alloc(t, init, 64<<10)
	var total float64
	labeled := map[string]bool{}
	for i := range owners {
		o := newEngineWith(t, engine.Options{})
		dst := alloc(t, o, 64<<10)
		seg := openSegment(t, init, o.Name())
		for range i + 1 {
			transfer(t, init, 10*time.Second, write(src, seg, engine.AddrOf(dst), 64<<10))
			total += 64 << 10
		}
		if i < 2 {
			labeled[o.Name()] = true // the first two take the free labels
		}
	}
	m := metricsOf(t, init)
	peers := m.labelValues("kvferry_transfer_bytes_total", "peer")
	if len(peers) != 3 || !peers["other"] {
		t.Fatalf("peer labels = %v, want two peers and other", peers)
	}
	for name := range labeled {
		if !peers[name] {
			t.Errorf("peer %s lost its label: %v", name, peers)
		}
	}
	// Peers 3 and 4 wrote 3 and 4 times under other; nothing is lost.
	m.require(t, 7*64<<10, "kvferry_transfer_bytes_total", "peer", "other")
	if got := m.sum("kvferry_transfer_bytes_total"); got != total {
		t.Errorf("bytes over all peers = %v, want %v", got, total)
	}
}

func TestMetricsOffKeepsTheEngineTotals(t *testing.T) {
	p := newAbortPair(t, engine.Options{MetricsOff: true}, 1<<20)
	transfer(t, p.init, 10*time.Second, write(p.src, p.seg, engine.AddrOf(p.dst), 1<<20))
	m := metricsOf(t, p.init)
	m.require(t, 1<<20, "kvferry_transfer_bytes_total", "peer", "other", "op", "write", "transport", "any")
	if _, ok := m["kvferry_transfer_duration_seconds"]; ok {
		t.Error("latency histogram present with metrics off")
	}
}

func TestMetricsListenerServesEveryEngineOfTheProcessAndClosesWithTheLast(t *testing.T) {
	a := newEngineWith(t, engine.Options{MetricsAddr: "127.0.0.1:0"})
	b := newEngineWith(t, engine.Options{MetricsAddr: "127.0.0.1:0"})
	// Asking for the address the listener got shares it too.
	c := newEngineWith(t, engine.Options{MetricsAddr: a.MetricsAddr()})
	if a.MetricsAddr() == "" || a.MetricsAddr() != b.MetricsAddr() || c.MetricsAddr() != a.MetricsAddr() {
		t.Fatalf("metrics addresses %q and %q: want one shared listener", a.MetricsAddr(), b.MetricsAddr())
	}
	url := "http://" + a.MetricsAddr() + "/metrics"
	body := httpGet(t, url)
	m := parseMetrics(t, body)
	engines := m.labelValues("kvferry_info", "engine")
	if !engines[a.Name()] || !engines[b.Name()] || !engines[c.Name()] || len(engines) != 3 {
		t.Fatalf("engines served = %v, want %s, %s and %s", engines, a.Name(), b.Name(), c.Name())
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	m = parseMetrics(t, httpGet(t, url))
	if engines := m.labelValues("kvferry_info", "engine"); engines[a.Name()] || !engines[b.Name()] {
		t.Fatalf("after closing %s, engines served = %v", a.Name(), engines)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if resp, err := http.Get(url); err == nil {
		resp.Body.Close()
		t.Fatalf("the listener still answers after its last engine closed: %s", resp.Status)
	}
}

func TestMetricsListenerOnAPortInUseLeavesTheEngineRunning(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	var logs bytes.Buffer
	var mu sync.Mutex
	b := newEngineWith(t, engine.Options{MetricsAddr: taken.Addr().String(), Logger: slog.New(slog.NewTextHandler(lockedWriter{&mu, &logs}, nil))})
	if b.MetricsAddr() != "" {
		t.Fatalf("listener on %s, which another socket holds: got %q, want none", taken.Addr(), b.MetricsAddr())
	}
	mu.Lock()
	defer mu.Unlock()
	if !strings.Contains(logs.String(), "metrics listener not started") || !strings.Contains(logs.String(), taken.Addr().String()) {
		t.Errorf("no warning naming the address: %s", logs.String())
	}
	if _, err := b.MetricsText(); err != nil {
		t.Errorf("MetricsText without a listener: %v", err)
	}
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

func httpGet(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("GET %s: %s, %v", url, resp.Status, err)
	}
	return string(b)
}

func TestTraceRequestLogsOneRequestOnBothSides(t *testing.T) {
	const traced, untraced = 4242, 4243
	var mu sync.Mutex
	var logs bytes.Buffer
	logger := slog.New(slog.NewTextHandler(lockedWriter{&mu, &logs}, &slog.HandlerOptions{Level: slog.LevelDebug}))
	p := newAbortPair(t, engine.Options{TraceRequest: traced, Logger: logger}, 1<<20)
	for _, rid := range []uint64{traced, untraced} {
		req := write(p.src, p.seg, engine.AddrOf(p.dst), 1<<20)
		req.RequestID = rid
		transfer(t, p.init, 10*time.Second, req)
	}
	p.requireSafeAbort(t, traced)
	// Safe comes from the owner's own guard; the initiator's drained ACK
	// follows.
	waitFor(t, 10*time.Second, "the ABORT_ACK", func() bool {
		return p.owner.Stats().AbortAcks == 1 && p.init.Stats().AbortAcksSent == 1
	})
	mu.Lock()
	text := logs.String()
	mu.Unlock()
	for _, want := range []string{"trace: transfer submitted", "trace: peer access", "trace: transfer ended",
		"trace: ABORT received", "trace: ABORT_ACK sent", "trace: ABORT_ACK received", "trace: abort answered"} {
		line := grepLine(text, want)
		if line == "" {
			t.Errorf("no %q line in the log", want)
			continue
		}
		if !strings.Contains(line, fmt.Sprintf("request=%d", traced)) {
			t.Errorf("%q line names another request: %s", want, line)
		}
	}
	if strings.Contains(text, fmt.Sprintf("request=%d", untraced)) {
		t.Errorf("the untraced request %d was logged:\n%s", untraced, text)
	}
	if line := grepLine(text, "trace: transfer ended"); !strings.Contains(line, "transport=tcp") || !strings.Contains(line, "segment="+p.owner.Name()) {
		t.Errorf("the end line does not name the transport and the peer: %s", line)
	}
}

func grepLine(text, s string) string {
	for _, l := range strings.Split(text, "\n") {
		if strings.Contains(l, s) {
			return l
		}
	}
	return ""
}

func TestMetricsShowWhatIsInFlightWhileItIs(t *testing.T) {
	// The owner holds each WRITE a while after admitting it, so the
	// transfer is certainly in flight when the test looks.
	owner := newEngineWith(t, engine.Options{Testing: engine.Testing{ApplyDelay: time.Second}})
	init := newEngineWith(t, engine.Options{})
	dst := alloc(t, owner, 3<<20)
	src := alloc(t, init, 3<<20)
	seg := openSegment(t, init, owner.Name())
	b, err := init.AllocateBatch(2)
	if err != nil {
		t.Fatal(err)
	}
	reqs := []engine.Request{write(src[:1<<20], seg, engine.AddrOf(dst), 1<<20), write(src[1<<20:], seg, engine.AddrOf(dst)+1<<20, 2<<20)}
	if err := b.Submit(testCtx(t, 10*time.Second), reqs); err != nil {
		t.Fatal(err)
	}
	m := metricsOf(t, init)
	m.require(t, 2, "kvferry_tasks_in_flight")
	m.require(t, 3<<20, "kvferry_bytes_in_flight")
	if err := b.Wait(testCtx(t, 10*time.Second)); err != nil {
		t.Fatal(err)
	}
	m = metricsOf(t, init)
	m.require(t, 0, "kvferry_tasks_in_flight")
	m.require(t, 0, "kvferry_bytes_in_flight")
	m.require(t, 3<<20, "kvferry_transfer_bytes_total", "peer", owner.Name(), "op", "write", "transport", "tcp")
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
}

func TestMetricsTextWhileTheEngineClosesAndAfter(t *testing.T) {
	p := newAbortPair(t, engine.Options{MetricsAddr: "127.0.0.1:0"}, 1<<20)
	transfer(t, p.init, 10*time.Second, write(p.src, p.seg, engine.AddrOf(p.dst), 1<<20))
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				if text, err := p.init.MetricsText(); err == nil {
					parseMetrics(t, text)
				}
			}
		}()
	}
	if err := p.init.Close(); err != nil {
		t.Error(err)
	}
	close(stop)
	wg.Wait()
	text, err := p.init.MetricsText()
	if err != nil {
		t.Fatalf("MetricsText after Close: %v", err)
	}
	m := parseMetrics(t, text)
	m.require(t, 1<<20, "kvferry_transfer_bytes_total", "peer", p.owner.Name(), "op", "write", "transport", "tcp")
	m.require(t, 0, "kvferry_segments_open")
}
