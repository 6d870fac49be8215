package engine

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/metrics"
	"github.com/kvferry/kvferry/engine/requests"
	"github.com/kvferry/kvferry/engine/transport"
)

// engineMetrics is what the data and control paths count for the metrics
// beyond Stats: per-peer transfers, latencies, refusals by reason, dials.
// Counting costs a few atomics and one histogram observation per task;
// Options.MetricsOff leaves it out (metrics then carry Stats alone).
type engineMetrics struct {
	peers *metrics.PeerTable
	// Transfer latency, submit to final status, by op and size class.
	xfer     [len(metrics.Ops)][len(metrics.SizeClasses)]metrics.Histogram
	xferDesc *prometheus.Desc
	abort    *prometheus.HistogramVec // Abort call to its answer, by outcome
	fence    *prometheus.HistogramVec // Fence call to its answer, by outcome
	rtt      prometheus.Histogram     // heartbeat round trips answered

	refusals   [len(refusalReasons)]atomic.Uint64
	dials      [len(metrics.Transports)][2]atomic.Uint64 // by transport; [0] dialed, [1] failed
	redials    atomic.Uint64                             // dials of a slot whose path had died
	peerDeaths atomic.Uint64

	// rebalanced is when the peer table was last rebalanced (unix nanos).
	rebalanced atomic.Int64
}

// peerRebalanceInterval is how long a labeled peer may stay idle before it
// gives its label up.
const peerRebalanceInterval = 30 * time.Second

// refusalReasons name why we refused a peer's access, as Admit found it.
var refusalReasons = [...]string{
	"aborted", "not_granted", "generation", "fenced", "stale_key", "not_registered",
	"request_table_full", "invalid", "gpu_staging", "other",
}

func refusalReason(err error) int {
	switch {
	case errors.Is(err, transport.ErrAborted):
		return 0
	case errors.Is(err, requests.ErrNotGranted):
		return 1
	case errors.Is(err, requests.ErrGeneration):
		return 2
	case errors.Is(err, transport.ErrFenced):
		return 3
	case errors.Is(err, memory.ErrStaleKey):
		return 4
	case errors.Is(err, memory.ErrNotRegistered), errors.Is(err, memory.ErrOutOfBounds):
		return 5
	case errors.Is(err, requests.ErrFull):
		return 6
	case errors.Is(err, ErrInvalidArg):
		return 7
	case errors.Is(err, errGPUStaging):
		return 8
	}
	return 9
}

// errGPUStaging marks refusals for want of GPU staging or of the driver.
var errGPUStaging = errors.New("GPU staging unavailable")

func newEngineMetrics(name string, maxPeers int) *engineMetrics {
	cl := prometheus.Labels{"engine": name}
	m := &engineMetrics{
		peers: metrics.NewPeerTable(maxPeers),
		xferDesc: prometheus.NewDesc("kvferry_transfer_duration_seconds",
			"Transfers we initiated that completed, from Submit to their final status, by op and size class.",
			[]string{"op", "size"}, cl),
		abort: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvferry_abort_duration_seconds", ConstLabels: cl, Buckets: metrics.LatencyBuckets,
			Help: "Abort calls, from the call to its answer (Safe or not), by outcome.",
		}, []string{"outcome"}),
		fence: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvferry_fence_duration_seconds", ConstLabels: cl, Buckets: metrics.LatencyBuckets,
			Help: "Fence calls, from the call to its answer (Safe or not), by outcome.",
		}, []string{"outcome"}),
		rtt: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "kvferry_heartbeat_rtt_seconds", ConstLabels: cl, Buckets: metrics.LatencyBuckets,
			Help: "Round trips of heartbeat pings peers answered.",
		}),
	}
	for _, o := range []string{"safe", "not_safe"} {
		m.abort.WithLabelValues(o)
		m.fence.WithLabelValues(o)
	}
	m.rebalanced.Store(time.Now().UnixNano())
	return m
}

// monoBase is the origin of task start times: a monotonic clock reading
// kept as nanoseconds since it, so a task holds 8 bytes, not a time.Time.
var monoBase = time.Now()

func monoNow() int64 { return int64(time.Since(monoBase)) }

// transportIndex returns proto's index into metrics.Transports.
func transportIndex(proto string) int32 {
	for i, n := range metrics.Transports {
		if n == proto {
			return int32(i)
		}
	}
	return 0
}

// shard picks the counters' shard of a task: tasks ended at once on
// different cores are different records, most likely in different shards.
func (t *task) shard() int {
	p := uintptr(unsafe.Pointer(t))
	return int((p>>7 ^ p>>12) % metrics.Shards)
}

// taskEnded counts a task that reached its final status st.
func (m *engineMetrics) taskEnded(t *task, st TaskStatus) {
	op := 1
	if t.req.Op == Read {
		op = 0
	}
	status := 1 // failed, and timed out
	switch st {
	case Completed:
		status = 0
	case Canceled:
		status = 2
	case Aborted:
		status = 3
	}
	sh := t.shard()
	slot := metrics.Slot{Shard: sh, Op: op, Transport: int(t.transport)}
	p := m.peers.AcquireCached(t.req.Segment.name, slot, &t.req.Segment.peerStat)
	p.Count(slot, status, t.req.Length)
	p.Release(slot)
	if st == Completed {
		m.xfer[op][metrics.SizeClass(t.req.Length)].Observe(sh, time.Duration(monoNow()-t.start))
	}
}

// observeSafe records an Abort's or a Fence's duration by outcome.
func observeSafe(h *prometheus.HistogramVec, start time.Time, safe bool) {
	o := "safe"
	if !safe {
		o = "not_safe"
	}
	h.WithLabelValues(o).Observe(time.Since(start).Seconds())
}

// Collector returns the engine's metrics as a Prometheus collector: register
// it with a registry of yours (prometheus.MustRegister(e.Collector())) to
// serve them with your process's own. Every series carries the label
// engine="<segment name>", so engines of one process register side by
// side.
func (e *Engine) Collector() prometheus.Collector { return engineCollector{e} }

// MetricsText returns the engine's metrics in the Prometheus text format
// (version 0.0.4), what a /metrics endpoint serves.
func (e *Engine) MetricsText() (string, error) {
	reg := prometheus.NewPedanticRegistry()
	if err := reg.Register(engineCollector{e}); err != nil {
		return "", fmt.Errorf("metrics: %w", err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		return "", fmt.Errorf("metrics: %w", err)
	}
	var buf bytes.Buffer
	enc := expfmt.NewEncoder(&buf, expfmt.NewFormat(expfmt.TypeTextPlain))
	for _, mf := range mfs {
		if err := enc.Encode(mf); err != nil {
			return "", fmt.Errorf("metrics: %w", err)
		}
	}
	return buf.String(), nil
}

// MetricsAddr returns the address the engine's metrics are served at
// (http://addr/metrics), "" when no listener serves them (MetricsAddr unset,
// or its listener failed: that is logged as a warning).
func (e *Engine) MetricsAddr() string { return e.metricsAddr }

// startMetricsListener serves the engine's metrics at Options.MetricsAddr.
// A port in use is not worth failing the engine for (a host process may run
// one engine per GPU with the same environment): it is logged and the
// metrics stay readable through MetricsText.
func (e *Engine) startMetricsListener() {
	if e.opts.MetricsAddr == "" {
		return
	}
	addr, stop, err := metrics.Serve(e.opts.MetricsAddr, e.Collector())
	if err != nil {
		e.log.Warn("kvferry: metrics listener not started; MetricsText still has them", "segment", e.Name(), "addr", e.opts.MetricsAddr, "err", err)
		return
	}
	e.metricsAddr, e.stopMetrics = addr, stop
	e.log.Info("kvferry: metrics served", "segment", e.Name(), "url", "http://"+addr+"/metrics")
}

// engineCollector reads the engine's counters at each scrape: nothing of it
// runs on the data path.
type engineCollector struct{ e *Engine }

// Describe sends nothing: the collector is unchecked, as the series it
// reports (peers, NICs) come and go.
func (engineCollector) Describe(chan<- *prometheus.Desc) {}

// Collect implements prometheus.Collector.
func (c engineCollector) Collect(ch chan<- prometheus.Metric) {
	e := c.e
	cl := prometheus.Labels{"engine": e.Name()}
	emit := func(name string, typ prometheus.ValueType, v float64, labels ...string) {
		// labels alternate names and values.
		var names, values []string
		for i := 0; i+1 < len(labels); i += 2 {
			names = append(names, labels[i])
			values = append(values, labels[i+1])
		}
		d := prometheus.NewDesc(name, metricHelp[name], names, cl)
		ch <- prometheus.MustNewConstMetric(d, typ, v, values...)
	}
	counter := func(name string, v uint64, labels ...string) {
		emit(name, prometheus.CounterValue, float64(v), labels...)
	}
	gauge := func(name string, v float64, labels ...string) {
		emit(name, prometheus.GaugeValue, v, labels...)
	}
	s := e.Stats()
	gauge("kvferry_info", 1, "version", Version)

	// Transfers we initiated.
	if m := e.metrics; m != nil {
		// One scrape of several at once rebalances: a second rebalance
		// right after the first would find every peer idle since.
		now := time.Now().UnixNano()
		if last := m.rebalanced.Load(); now-last >= int64(peerRebalanceInterval) && m.rebalanced.CompareAndSwap(last, now) {
			m.peers.Rebalance()
		}
		byts, tasks := m.peers.Snapshot()
		for _, x := range byts {
			counter("kvferry_transfer_bytes_total", x.Value, "peer", x.Peer, "op", x.Op, "transport", x.Transport)
		}
		for _, x := range tasks {
			counter("kvferry_transfers_total", x.Value, "peer", x.Peer, "op", x.Op, "transport", x.Transport, "status", x.Status)
		}
		for o := range metrics.Ops {
			for c := range metrics.SizeClasses {
				ch <- m.xfer[o][c].Metric(m.xferDesc, metrics.Ops[o], metrics.SizeClasses[c])
			}
		}
		m.abort.Collect(ch)
		m.fence.Collect(ch)
		m.rtt.Collect(ch)
		for i, r := range refusalReasons {
			counter("kvferry_owner_refusals_total", m.refusals[i].Load(), "reason", r)
		}
		for i, tr := range metrics.Transports {
			counter("kvferry_path_dials_total", m.dials[i][0].Load(), "transport", tr, "result", "ok")
			counter("kvferry_path_dials_total", m.dials[i][1].Load(), "transport", tr, "result", "failed")
		}
		counter("kvferry_path_redials_total", m.redials.Load())
		counter("kvferry_peer_deaths_total", m.peerDeaths.Load())
	} else {
		// Without per-task counting the engine-wide totals stand in.
		counter("kvferry_transfer_bytes_total", s.BytesWritten, "peer", metrics.OtherPeer, "op", "write", "transport", "any")
		counter("kvferry_transfer_bytes_total", s.BytesRead, "peer", metrics.OtherPeer, "op", "read", "transport", "any")
	}
	gauge("kvferry_tasks_in_flight", float64(s.TasksInFlight))
	gauge("kvferry_bytes_in_flight", float64(e.bytesInFlight()))
	counter("kvferry_transfer_retries_total", s.Retries)
	counter("kvferry_tcp_paths_idled_out_total", s.PathsIdledOut)
	counter("kvferry_paths_closed_idle_total", s.PathsClosedIdle)
	gauge("kvferry_open_paths", float64(s.OpenPaths))
	counter("kvferry_heartbeats_total", s.Heartbeats)
	if e.meta != nil {
		ms := e.meta.Stats()
		counter("kvferry_metadata_publishes_total", ms.Publishes)
		counter("kvferry_metadata_publish_failures_total", ms.PublishFailures)
		counter("kvferry_metadata_leases_lost_total", ms.LeasesLost)
		counter("kvferry_metadata_watch_events_total", ms.WatchEvents)
		counter("kvferry_metadata_malformed_total", ms.Malformed)
	}

	// Peers' accesses to our memory.
	ts := e.tcp.Stats()
	counter("kvferry_owner_bytes_total", ts.BytesIn, "direction", "in", "transport", "tcp")
	counter("kvferry_owner_bytes_total", ts.BytesOut, "direction", "out", "transport", "tcp")
	if e.shm != nil {
		ss := e.shm.Stats()
		counter("kvferry_owner_bytes_total", ss.BytesIn, "direction", "in", "transport", "shm")
		counter("kvferry_owner_bytes_total", ss.BytesOut, "direction", "out", "transport", "shm")
		for _, v := range []struct {
			via string
			n   uint64
		}{{"shared", ss.SharedSlices}, {"attach", ss.AttachSlices}, {"gpu", ss.GPUSlices}, {"tcp_fallback", ss.FallbackSlices}} {
			counter("kvferry_shm_slices_total", v.n, "via", v.via)
		}
		counter("kvferry_shm_stops_unconfirmed_total", ss.StopsUnconfirmed)
	}
	// Compressed tcp data: raw against compressed bytes, each way, is
	// the ratio compression achieves; refusals are blocks a peer sent
	// that found no decoding room in time or that we rejected.
	counter("kvferry_tcp_compressed_slices_total", s.CompressedSlices)
	counter("kvferry_tcp_compressed_bytes_total", s.CompressedRawOut, "direction", "out", "form", "raw")
	counter("kvferry_tcp_compressed_bytes_total", s.CompressedOut, "direction", "out", "form", "compressed")
	counter("kvferry_tcp_compressed_bytes_total", s.CompressedRawIn, "direction", "in", "form", "raw")
	counter("kvferry_tcp_compressed_bytes_total", s.CompressedIn, "direction", "in", "form", "compressed")
	counter("kvferry_tcp_compressed_refused_total", s.CompressedRefused, "reason", "no_room")
	counter("kvferry_tcp_compressed_refused_total", s.CompressedMalformed, "reason", "malformed")
	counter("kvferry_owner_refusals_in_flight_total", s.RefusedInFlight)
	counter("kvferry_fence_refusals_total", s.FenceRefused)
	counter("kvferry_gpu_staging_refusals_total", s.StagingRefused)

	// Aborts and fences.
	counter("kvferry_aborts_total", s.AbortsSafe, "outcome", "safe")
	counter("kvferry_aborts_total", s.AbortsNotSafe, "outcome", "not_safe")
	counter("kvferry_fences_total", s.FencesSafe, "outcome", "safe")
	counter("kvferry_fences_total", s.FencesNotSafe, "outcome", "not_safe")
	counter("kvferry_abort_acks_total", s.AbortAcks, "result", "matched")
	counter("kvferry_abort_acks_total", s.AcksUnmatched, "result", "unmatched")
	counter("kvferry_abort_resends_total", s.AbortResends)
	counter("kvferry_aborts_received_total", s.AbortsReceived)
	counter("kvferry_abort_acks_sent_total", s.AbortAcksSent)
	counter("kvferry_drains_rechecked_total", s.DrainsRechecked)
	counter("kvferry_aborts_dropped_total", s.AbortsDropped)
	counter("kvferry_fence_acks_total", s.FenceAcks, "result", "matched")
	counter("kvferry_fence_acks_total", s.FenceAcksUnmatched, "result", "unmatched")
	counter("kvferry_fences_received_total", s.FencesReceived)
	gauge("kvferry_fence_epoch", float64(s.FenceEpoch))
	gauge("kvferry_tombstones", float64(s.Tombstones), "side", "owner")
	gauge("kvferry_tombstones", float64(s.InitiatorTombstones), "side", "initiator")
	gauge("kvferry_grants", float64(s.Grants))
	gauge("kvferry_request_states", float64(s.RequestStates))

	// Segments, paths, memory.
	gauge("kvferry_segments_open", float64(s.OpenSegments))
	paths, dead := e.pathCounts()
	for i, tr := range metrics.Transports {
		gauge("kvferry_paths_open", float64(paths[i]), "transport", tr)
	}
	gauge("kvferry_peers_dead", float64(dead))
	regs := e.reg.Regions()
	byLoc := map[string]uint64{}
	for _, r := range regs {
		loc, _, _ := strings.Cut(r.Location, ":")
		if loc == "cuda" {
			loc = "gpu"
		} else {
			loc = "host"
		}
		byLoc[loc] += r.Len
	}
	for _, loc := range []string{"host", "gpu"} {
		gauge("kvferry_registered_bytes", float64(byLoc[loc]), "location", loc)
	}
	gauge("kvferry_registrations", float64(s.Registrations))
	gauge("kvferry_staging_buffers_in_use", float64(s.StagingInUse))

	// Connections and the control plane.
	gauge("kvferry_data_connections", float64(s.DataConns), "transport", "tcp")
	gauge("kvferry_data_connections", float64(s.SHMConns), "transport", "shm")
	gauge("kvferry_control_connections", float64(s.ControlConns), "direction", "in")
	gauge("kvferry_control_connections", float64(s.ControlPeers), "direction", "out")
	counter("kvferry_connections_refused_total", ts.RefusedPerPeer, "plane", "data", "reason", "per_peer_limit")
	counter("kvferry_connections_refused_total", ts.RefusedTotal, "plane", "data", "reason", "limit")
	counter("kvferry_connections_refused_total", s.ControlConnsRefused, "plane", "control", "reason", "limit")
	counter("kvferry_connections_refused_total", s.AuthRefused, "plane", "any", "reason", "authentication")
	counter("kvferry_connections_closed_total", s.IdleClosed, "plane", "data", "reason", "idle")
	counter("kvferry_connections_closed_total", s.FrameTimeouts, "plane", "data", "reason", "frame_timeout")
	counter("kvferry_connections_closed_total", s.ProtocolErrors, "plane", "data", "reason", "malformed")
	counter("kvferry_connections_closed_total", s.ControlConnsCut, "plane", "control", "reason", "malformed_or_timeout")
	counter("kvferry_accept_errors_total", s.AcceptErrors)
	for _, v := range []struct {
		why string
		n   uint64
	}{{"malformed", s.ControlDropped}, {"late", s.ControlLate}, {"over_budget", s.ControlOverBudget}, {"send_failed", s.ControlSendFails}, {"canceled_unbelieved", s.CanceledDropped}} {
		counter("kvferry_control_messages_dropped_total", v.n, "reason", v.why)
	}
	counter("kvferry_events_dropped_total", s.EventsDropped)
	counter("kvferry_notifications_total", s.Notifications)

	// RDMA.
	if e.rdma != nil {
		gauge("kvferry_rdma_nics", float64(s.RDMANICs))
		for nic, n := range s.RDMAPostedByNIC {
			counter("kvferry_rdma_work_requests_total", n, "nic", nic)
		}
		counter("kvferry_rdma_error_completions_total", s.RDMAErrorWCs)
		counter("kvferry_rdma_failovers_total", s.RDMAFailovers)
		counter("kvferry_rdma_stalls_total", s.RDMAStalls)
		counter("kvferry_rdma_fences_total", s.RDMAFences)
		counter("kvferry_rdma_connects_refused_total", s.RDMAConnectsRefused)
		gauge("kvferry_rdma_responder_qps", float64(s.RDMAResponderQPs))
	}
}

// bytesInFlight adds up the lengths of the transfers we initiated that have
// not ended, from the live batches: read at a scrape, it costs the data path
// nothing.
func (e *Engine) bytesInFlight() uint64 {
	e.liveMu.Lock()
	batches := make([]*Batch, 0, len(e.live))
	for b := range e.live {
		if b.running.Load() > 0 {
			batches = append(batches, b)
		}
	}
	e.liveMu.Unlock()
	var n uint64
	for _, b := range batches {
		b.mu.Lock()
		for _, t := range b.tasks {
			if !TaskStatus(t.status.Load()).Final() {
				n += t.req.Length
			}
		}
		b.mu.Unlock()
	}
	return n
}

// pathCounts counts the live paths we hold, by transport, and the open
// segments whose peer is declared dead.
func (e *Engine) pathCounts() (paths [len(metrics.Transports)]int, dead int) {
	e.segMu.Lock()
	segs := make([]*Segment, 0, len(e.segments))
	for _, s := range e.segments {
		segs = append(segs, s)
	}
	e.segMu.Unlock()
	for _, s := range segs {
		if s.dead.Load() {
			dead++
		}
		tr := s.transport.Load()
		s.mu.Lock()
		for _, p := range s.paths {
			if p != nil && !p.ep.Dead() {
				paths[tr]++
			}
		}
		s.mu.Unlock()
	}
	return paths, dead
}

// metricHelp is the HELP text of each series the collector reports.
var metricHelp = map[string]string{
	"kvferry_info":                           "The library's version, as a label; always 1.",
	"kvferry_bytes_in_flight":                "Bytes of transfers we initiated that have not ended.",
	"kvferry_owner_refusals_total":           "Peers' accesses to our memory refused when they asked, by reason.",
	"kvferry_path_dials_total":               "Data paths we dialed to peers, by transport and result.",
	"kvferry_path_redials_total":             "Paths dialed again after the one in their place died (reconnects).",
	"kvferry_peer_deaths_total":              "Peers declared dead for missed heartbeats.",
	"kvferry_tasks_in_flight":                "Transfers we initiated that have not ended.",
	"kvferry_transfer_retries_total":         "Slices posted again on another path after theirs broke.",
	"kvferry_tcp_paths_idled_out_total":      "Our tcp paths an owner closed as idle (their unread slices were posted again).",
	"kvferry_owner_bytes_total":              "Bytes peers moved into (in) and out of (out) our memory through a transport that copies (rdma's are the NIC's, not counted).",
	"kvferry_shm_slices_total":               "Our slices a same-host owner copied, by how it reached our memory.",
	"kvferry_shm_stops_unconfirmed_total":    "Our shm paths stopped without the owner confirming it left our memory.",
	"kvferry_tcp_compressed_slices_total":    "Slices we sent compressed over tcp (our WRITEs and our answers to READs).",
	"kvferry_tcp_compressed_bytes_total":     "Bytes of compressed tcp blocks, sent (out) and received (in), before (raw) and after (compressed) compression.",
	"kvferry_tcp_compressed_refused_total":   "Compressed tcp blocks we turned away: no_room (no decoding room in time), malformed (a block rejected: past the bounds its frame allows, or not decoding to its declared length).",
	"kvferry_owner_refusals_in_flight_total": "Peers' accesses refused after some of their bytes had moved (an abort, fence or unregistration struck mid-slice).",
	"kvferry_fence_refusals_total":           "Peers' and local accesses refused as planned before a fence.",
	"kvferry_gpu_staging_refusals_total":     "Peers' accesses to GPU memory refused for want of staging.",
	"kvferry_aborts_total":                   "Abort calls, by outcome.",
	"kvferry_fences_total":                   "Fence calls, by outcome.",
	"kvferry_abort_acks_total":               "ABORT_ACKs received as owner, by whether they answered an abort.",
	"kvferry_abort_resends_total":            "ABORTs sent again for want of an ACK.",
	"kvferry_aborts_received_total":          "ABORTs received as initiator.",
	"kvferry_abort_acks_sent_total":          "ABORT_ACKs sent as initiator (drained).",
	"kvferry_drains_rechecked_total":         "Aborted requests ACKed cut while a broken rdma path could not confirm their work, then ACKed drained once its reconnect did.",
	"kvferry_aborts_dropped_total":           "ABORTs dropped unanswered for want of room (the owner resends them).",
	"kvferry_fence_acks_total":               "FENCE_ACKs received, by whether they answered a fence.",
	"kvferry_fences_received_total":          "FENCE notices received as initiator.",
	"kvferry_fence_epoch":                    "The epoch of our last fence (0: none yet).",
	"kvferry_tombstones":                     "Aborted request ids remembered, as owner and as initiator.",
	"kvferry_grants":                         "Live grants.",
	"kvferry_request_states":                 "Request ids with owner-side state.",
	"kvferry_segments_open":                  "Segments (peers) open on this engine.",
	"kvferry_paths_open":                     "Live data paths we hold to peers, by transport.",
	"kvferry_peers_dead":                     "Open segments whose peer is declared dead.",
	"kvferry_registered_bytes":               "Registered memory, by location.",
	"kvferry_registrations":                  "Registered ranges.",
	"kvferry_staging_buffers_in_use":         "GPU staging buffers taken.",
	"kvferry_data_connections":               "Data connections peers hold to us, by transport.",
	"kvferry_control_connections":            "Control connections, peers' to us (in) and ours to peers (out).",
	"kvferry_connections_refused_total":      "Connections closed at once, by plane and reason.",
	"kvferry_connections_closed_total":       "Connections we closed, by plane and reason.",
	"kvferry_accept_errors_total":            "Failed accepts on the data port (the loop backs off and goes on).",
	"kvferry_control_messages_dropped_total": "Control messages dropped, by reason.",
	"kvferry_events_dropped_total":           "Events dropped because the queue was full.",
	"kvferry_notifications_total":            "Notifications received and queued.",
	"kvferry_rdma_nics":                      "NIC ports in use.",
	"kvferry_rdma_work_requests_total":       "Work requests posted, by local NIC port.",
	"kvferry_rdma_error_completions_total":   "Completions with an error status.",
	"kvferry_rdma_failovers_total":           "NIC paths that failed under work and were reconnected.",
	"kvferry_rdma_stalls_total":              "NIC paths broken because no work request completed in time.",
	"kvferry_rdma_fences_total":              "Owner-side fences of an initiator's QPs.",
	"kvferry_rdma_connects_refused_total":    "Initiators' connect requests refused at the responder QP cap.",
	"kvferry_rdma_responder_qps":             "QPs made for initiators connected to us.",
	"kvferry_transfer_bytes_total":           "Bytes of transfers we initiated that completed, by peer, op and transport.",
	"kvferry_transfers_total":                "Transfers we initiated that ended, by peer, op, transport and status.",
}

// Version is the library's version, as in kvferry.h's KVF_VERSION_STRING.
const Version = "0.7.0"
