package engine_test

import (
	"bytes"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kvferry/kvferry/engine"
)

// Each engine's text is one complete exposition (it declares its
// families), so two cannot simply be appended; the header says so and
// names the ways to serve several engines on one page. Through one
// registry, as a Go host does, both are served and the page parses.
func TestTwoEnginesServedTogetherThroughOneRegistryParse(t *testing.T) {
	a := newEngineWith(t, engine.Options{})
	b := newEngineWith(t, engine.Options{})
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(a.Collector(), b.Collector())
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatalf("gather two engines: %v", err)
	}
	var buf bytes.Buffer
	enc := expfmt.NewEncoder(&buf, expfmt.NewFormat(expfmt.TypeTextPlain))
	for _, mf := range mfs {
		if err := enc.Encode(mf); err != nil {
			t.Fatal(err)
		}
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(buf.String()))
	if err != nil {
		t.Fatalf("two engines served through one registry do not parse: %v", err)
	}
	engines := scrape(fams).labelValues("kvferry_info", "engine")
	if !engines[a.Name()] || !engines[b.Name()] {
		t.Fatalf("engines on the page: %v, want %s and %s", engines, a.Name(), b.Name())
	}
}

// Options.TraceRequest: "logged at debug level, on both sides: submitted,
// each peer access admitted or refused, ended (status, time, cause),
// aborted, ACKed". The initiator's side of an abort (the owner's ABORT
// received, the tasks drained, the ACK sent) is not traced: the
// initiator's log says nothing of the traced request once it ended.
func TestTraceRequestLogsTheAbortOnTheInitiatorSide(t *testing.T) {
	const traced = 4242
	var mu sync.Mutex
	var initLogs bytes.Buffer
	initLogger := slog.New(slog.NewTextHandler(lockedWriter{&mu, &initLogs}, &slog.HandlerOptions{Level: slog.LevelDebug}))
	owner := newEngineWith(t, engine.Options{TraceRequest: traced})
	init := newEngineWith(t, engine.Options{TraceRequest: traced, Logger: initLogger})
	dst := alloc(t, owner, 1<<20)
	src := alloc(t, init, 1<<20)
	seg := openSegment(t, init, owner.Name())
	req := write(src, seg, engine.AddrOf(dst), 1<<20)
	req.RequestID = traced
	transfer(t, init, 10*time.Second, req)
	res, err := owner.Abort(testCtx(t, 5*time.Second), traced, []string{init.Name()})
	if err != nil || !res.Safe {
		t.Fatalf("abort = %+v, %v; want safe", res, err)
	}
	waitFor(t, 10*time.Second, "the initiator's ABORT_ACK", func() bool { return init.Stats().AbortAcksSent > 0 })
	mu.Lock()
	text := initLogs.String()
	mu.Unlock()
	for _, l := range strings.Split(text, "\n") {
		if strings.Contains(l, "trace:") && strings.Contains(strings.ToLower(l), "abort") && strings.Contains(l, fmt.Sprintf("request=%d", traced)) {
			return
		}
	}
	t.Errorf("the initiator's log has no trace line of the traced request's abort:\n%s", text)
}
