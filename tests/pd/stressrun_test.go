package pd

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/internal/fakeverbs"
)

// fate is when decode aborts a request.
type fate int

const (
	fateNone   fate = iota // not aborted: must complete with its pattern intact
	fateBefore             // aborted before the prefill hears of it
	fateDuring             // aborted while its pages are being written
	fateAfter              // aborted after it completed (a client that left late)
	nfates
)

func (f fate) String() string {
	return [...]string{"none", "before", "during", "after"}[f]
}

// Where corruption was found.
const (
	atCompletion = iota // a request's slots when the prefill reported it completed
	atReuse             // a page's slots just before its next holder took it
	atEnd               // every slot, once decode's engine was closed
	nwhere
)

var whereNames = [nwhere]string{"at completion", "before reuse", "at the end"}

// stressConfig shapes one stress run.
type stressConfig struct {
	requests int // requests in the run
	lanes    int // requests decode keeps in flight
	// A request is layers batches of pages WRITEs of pageSize bytes; the
	// prefill cuts each page into slices of slice bytes over paths
	// connections.
	layers, pages, pageSize int
	slice, paths            int
	poolPages               int           // page indices in decode's pool (each a slot per layer)
	applyDelay              time.Duration // decode's Options.Testing.ApplyDelay
	// unsafe: the protection off: Options.Testing.UnsafeAbort on both
	// sides, or with fence decode's Options.Testing.UnsafeFence.
	unsafe bool
	// fence: the prefill passes no request id (prefillConfig.noRID), and
	// decode protects the pages of a request it gives up with Engine.Fence
	// of its slots instead of Abort (SAFETY.md promise 7).
	fence bool
	// fenceEarly: decode fences a request while it is written without
	// waiting until the prefill planned all of it, so layers it plans
	// after the fence pass (for the row that shows why the others wait).
	fenceEarly bool
	seed       uint64
	// Fates, in percent; the rest are not aborted. Half of the during
	// aborts wait until the request's first page starts landing, the other
	// half a random delay below duringMax.
	before, during, after int
	duringMax             time.Duration
	abortDeadline         time.Duration
	// rdma: over rdma (fakeverbs.Library: the fake, or real devices)
	// instead of tcp; noFence: Options.RDMANoFence on both ends; delayUs:
	// decode's devices place the prefill's WRITEs slowly, this many
	// microseconds per 64 KiB (fakeverbs.SlowPlacement).
	rdma    bool
	noFence bool
	delayUs int
	// fenceGrace is decode's RDMAFenceGrace (0: the default; negative:
	// fence at once, without waiting for a drained ACK).
	fenceGrace time.Duration
	// auth: both ends authenticate with a cluster secret (control plane
	// over CURVE, data connections with their handshake).
	auth bool
	// shm: over the same-host transport instead of tcp.
	shm bool
	// budget, when set, stops the run from starting requests after this
	// long, which fails the test: a run that slows down by orders of
	// magnitude is found out without timing out.
	budget time.Duration
}

// stressResult is what a run found.
type stressResult struct {
	bad, old     [nwhere]uint64 // corrupted bytes; those that are an earlier request's pattern
	notes        []string       // the first corruptions, described
	fates        [nfates]int
	outcomes     [nfates]map[string]int
	aborts       int
	notSafe      int
	abortTimes   []time.Duration
	fences       int             // Fence calls (fence mode)
	fenceNotSafe int             // of them, not Safe
	fenceUnacked int             // of them, returned without the prefill's FENCE_ACK (FenceGrace passed)
	fenceTimes   []time.Duration // each call's time to return
	decode       engine.Stats    // decode's counters after the run, before Close
	prefill      map[string]int64
	elapsed      time.Duration
	bytesMoved   uint64
	corruptPage  int // pages with corruption
	notCompleted int // requests not aborted that ended other than COMPLETED
	decodeEvents map[engine.EventKind]int
}

func (r *stressResult) totalBad() (bad, old uint64) {
	for i := range r.bad {
		bad += r.bad[i]
		old += r.old[i]
	}
	return bad, old
}

// recorder collects a run's findings from its lanes.
type recorder struct {
	mu  sync.Mutex
	res *stressResult
}

func (rc *recorder) corrupt(where, pg int, holderTag uint64, d damage) {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	rc.res.bad[where] += d.bad
	rc.res.old[where] += d.old
	rc.res.corruptPage++
	if len(rc.res.notes) < 8 {
		rc.res.notes = append(rc.res.notes, fmt.Sprintf("%s: page %d (holder %#x): %d bad bytes (%d an earlier request's), first at byte %d: %#016x, want %#016x",
			whereNames[where], pg, holderTag, d.bad, d.old, d.at, d.got, d.exp))
	}
}

// requests is a row's request count: full, or short under -short.
func requests(full, short int) int {
	if testing.Short() {
		return short
	}
	return full
}

// realRequests is how many requests an rdma row runs on real devices.
func realRequests() int { return requests(300, 100) }

// runStress runs decode (this process, the owner of a slot pool) against a
// prefill process and returns what it found. It fails the test for what
// must hold in either mode: every request ends (COMPLETED, or ABORTED when
// aborted), every Abort returns by its deadline, every abort is
// acknowledged, and nothing leaks: goroutines and file descriptors of
// decode (counted here) and of the prefill (counted there), decode's
// registry and request table.
func runStress(t *testing.T, cfg stressConfig) *stressResult {
	t.Helper()
	res := &stressResult{}
	for i := range res.outcomes {
		res.outcomes[i] = map[string]int{}
	}
	rc := &recorder{res: res}

	if cfg.fence && cfg.before != 0 {
		// A writer told of pages after their fence plans its transfers
		// after it, and they pass: that is the normal flow of the next
		// request, not a protected abort.
		t.Fatal("a fence run has no aborts before the prefill hears of the request")
	}
	pcfg := prefillConfig{unsafe: cfg.unsafe && !cfg.fence, slice: cfg.slice, paths: cfg.paths,
		workers: 2 * cfg.lanes, srcSize: cfg.layers * cfg.pages * cfg.pageSize, noFence: cfg.noFence, noRID: cfg.fence, shm: cfg.shm}
	if cfg.auth {
		pcfg.clusterSecret = filepath.Join(t.TempDir(), "cluster.secret")
		if err := os.WriteFile(pcfg.clusterSecret, []byte("pd stress cluster secret, 32 bytes\n"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if cfg.rdma {
		pcfg = rdmaPrefill(t, pcfg)
		if fakeverbs.Real() {
			// Real devices here are soft-RoCE under software emulation,
			// orders of magnitude slower than the fake (an owner fence
			// costs a QP teardown, a retry timeout and a reconnect): fewer
			// requests, and no budget calibrated on the fake.
			cfg.requests = min(cfg.requests, realRequests())
			cfg.budget = 0
		}
	}
	// Leak baseline, before anything of the run exists.
	g0, f0, fdsBefore := leakBaseline(t, pcfg.decodeOptions())

	dopts := pcfg.decodeOptions()
	dopts.Testing = engine.Testing{UnsafeAbort: cfg.unsafe && !cfg.fence, UnsafeFence: cfg.unsafe && cfg.fence, ApplyDelay: cfg.applyDelay}
	dopts.RDMAFenceGrace = cfg.fenceGrace
	d, closeDecode := newDecode(t, dopts)
	// An application takes its events; count them by kind. The channel
	// closes with the engine.
	var decodeEvents map[engine.EventKind]int
	evDone := make(chan struct{})
	go func() {
		defer close(evDone)
		m := map[engine.EventKind]int{}
		for ev := range d.Events() {
			m[ev.Kind]++
		}
		decodeEvents = m
	}()
	mem, freeMem := allocDecode(t, d, cfg.layers*cfg.poolPages*cfg.pageSize)
	pool := newSlotPool(mem, cfg.layers, cfg.poolPages, cfg.pageSize)
	base := d.Stats()

	if cfg.delayUs > 0 {
		fakeverbs.SlowPlacement(t, cfg.delayUs)
	}
	pp := startPrefill(t, pcfg, d.Name())

	r := &stressRun{t: t, cfg: cfg, res: res, rc: rc, d: d, pp: pp, pool: pool, gaveUp: "aborted"}
	if cfg.fence {
		r.gaveUp = "fenced"
	}
	r.start = time.Now()
	var wg sync.WaitGroup
	for range cfg.lanes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.lane()
		}()
	}
	wg.Wait()
	if r.overBudget.Load() {
		started := 0
		for _, n := range res.fates {
			started += n
		}
		t.Errorf("the run stopped at its %v budget having started %d of %d requests", cfg.budget, started, cfg.requests)
	}

	// The aborted requests' outcomes: ABORTED, or COMPLETED when the
	// abort came too late to stop anything (during) or protection was off.
	badEnds := 0
	for _, p := range r.pending {
		o, ok := r.wait(p.rid, p.ch)
		if !ok {
			break
		}
		res.outcomes[p.f][r.label(o)]++
		okStatus := o.status == engine.Aborted.String() ||
			(o.status == engine.Completed.String() && (p.f == fateDuring || cfg.unsafe))
		if cfg.fence {
			// Refused as fenced, or completed before the fence struck (or
			// with the protection off): never another failure.
			okStatus = o.status == engine.Completed.String() || (!cfg.unsafe && o.fencedOnly())
		}
		if !okStatus {
			if badEnds++; badEnds <= 5 {
				t.Errorf("request %d (%s %s): %s", p.rid, r.gaveUp, p.f, o.line)
			}
		}
	}
	if badEnds > 5 {
		t.Errorf("%d %s requests in all ended otherwise than that allows (the first 5 above)", badEnds, r.gaveUp)
	}
	res.elapsed = time.Since(r.start)

	// Every abort is acknowledged (promise 2; on tcp Safe does not wait
	// for it), so the prefill has heard them all before it leaves. An ACK
	// counts only while its abort waits for it, up to the abort's
	// deadline: no later one can. Likewise every fence's notice reaches
	// the prefill, which answers it: within FenceGrace, or later while
	// the fence resends it.
	wantFenceAcks := uint64(res.fences)
	if cfg.unsafe {
		wantFenceAcks = 0 // the unsafe Fence tells no one
	}
	// A fence struck before the prefill planned (fenceEarly) may come
	// before it opened decode's segment at all: it then tells no one, and
	// the counts below are not asserted.
	checkFenceAcks := !cfg.fenceEarly
	waitUntil(cfg.abortDeadline+time.Second, 5*time.Millisecond, func() bool {
		st := d.Stats()
		return st.AbortAcks >= uint64(res.aborts) && (!checkFenceAcks || st.FenceAcks >= wantFenceAcks)
	})
	if st := d.Stats(); st.AbortAcks != uint64(res.aborts) {
		t.Errorf("decode has %d ABORT_ACKs (%d unmatched) for %d aborts, %v after the last", st.AbortAcks, st.AcksUnmatched, res.aborts, cfg.abortDeadline+time.Second)
	}
	if st := d.Stats(); checkFenceAcks && st.FenceAcks != wantFenceAcks {
		t.Errorf("decode has %d FENCE_ACKs (%d unmatched) for %d fences; want %d", st.FenceAcks, st.FenceAcksUnmatched, res.fences, wantFenceAcks)
	}
	res.prefill = pp.finish(t, 30*time.Second)
	res.decode = d.Stats()
	res.bytesMoved = res.decode.OwnerBytesIn

	// Leaks of the prefill, counted there.
	bye := res.prefill
	if bye["inflight"] != 0 || bye["events_dropped"] != 0 {
		t.Errorf("prefill: %d tasks in flight, %d events dropped at the end; want 0 and 0", bye["inflight"], bye["events_dropped"])
	}
	if bye["goroutines_after"] > bye["goroutines_before"] || bye["fds_after"] > bye["fds_before"] {
		t.Errorf("prefill leaked: goroutines %d -> %d, file descriptors %d -> %d",
			bye["goroutines_before"], bye["goroutines_after"], bye["fds_before"], bye["fds_after"])
	}
	if bye["abort_events"] != int64(res.aborts) {
		t.Errorf("prefill got %d EventAborted for %d aborts; want one each", bye["abort_events"], res.aborts)
	}
	if cfg.fence && !cfg.unsafe && checkFenceAcks && bye["fences_received"] < int64(res.fences) {
		t.Errorf("prefill received %d FENCE notices for %d fences; want one each at least", bye["fences_received"], res.fences)
	}

	// Decode's registry and request table: back to the baseline, only
	// tombstones left (one per aborted request id; the unsafe mode keeps
	// none).
	st := res.decode
	wantTombs := int64(res.aborts)
	if cfg.unsafe {
		wantTombs = 0
	}
	if st.Registrations != base.Registrations || st.Grants != 0 || int64(st.RequestStates) != st.Tombstones || st.Tombstones != wantTombs {
		t.Errorf("decode after the run: %d registrations (%d before), %d grants, %d request states, %d tombstones; want %d, 0, only the %d tombstones",
			st.Registrations, base.Registrations, st.Grants, st.RequestStates, st.Tombstones, base.Registrations, wantTombs)
	}
	if st.AbortsSafe != uint64(res.aborts-res.notSafe) || st.AbortsNotSafe != uint64(res.notSafe) {
		t.Errorf("decode counted %d safe and %d unsafe aborts; the calls saw %d and %d", st.AbortsSafe, st.AbortsNotSafe, res.aborts-res.notSafe, res.notSafe)
	}
	if st.FencesSafe != uint64(res.fences-res.fenceNotSafe) || st.FencesNotSafe != uint64(res.fenceNotSafe) {
		t.Errorf("decode counted %d safe and %d unsafe fences; the calls saw %d and %d", st.FencesSafe, st.FencesNotSafe, res.fences-res.fenceNotSafe, res.fenceNotSafe)
	}

	// Close cuts every connection and returns once no goroutine of the
	// engine remains, so no write can land after it: the last check.
	if err := closeDecode(); err != nil {
		t.Errorf("decode close: %v", err)
	}
	<-evDone
	res.decodeEvents = decodeEvents
	for pg := range pool.state {
		if dmg := pool.check(pg); dmg.bad > 0 {
			rc.corrupt(atEnd, pg, pool.state[pg].cur.tag, dmg)
		}
	}
	if err := freeMem(); err != nil {
		t.Error(err)
	}

	// Decode's leaks, counted here against the baseline.
	g, f := settled(g0, f0, 3*time.Second)
	if g > g0 {
		buf := make([]byte, 1<<20)
		buf = buf[:runtime.Stack(buf, true)]
		t.Errorf("decode goroutines: %d before the run, %d after\n%s", g0, g, buf)
	}
	if f > f0 {
		_, fdsAfter, _ := processFDs()
		t.Errorf("decode file descriptors: %d before the run, %d after\nbefore:\n%s\nafter:\n%s",
			f0, f, strings.Join(fdsBefore, "\n"), strings.Join(fdsAfter, "\n"))
	}
	res.log(t, cfg)
	return res
}

// log reports a run.
func (r *stressResult) log(t *testing.T, cfg stressConfig) {
	t.Helper()
	bad, old := r.totalBad()
	pct := func(times []time.Duration, p float64) time.Duration {
		if len(times) == 0 {
			return 0
		}
		lat := slices.Clone(times)
		slices.Sort(lat)
		return lat[min(len(lat)-1, int(p*float64(len(lat))))]
	}
	n := 0 // requests started: all, unless the run stopped early
	for _, k := range r.fates {
		n += k
	}
	t.Logf("%d requests in %v (%.0f/s), %d MiB landed at decode; %d lanes, %d layers x %d pages of %d KiB, slices of %d KiB over %d paths, apply delay %v, unsafe %v, fence (no request ids) %v",
		n, r.elapsed.Round(time.Millisecond), float64(n)/r.elapsed.Seconds(), r.bytesMoved>>20,
		cfg.lanes, cfg.layers, cfg.pages, cfg.pageSize>>10, cfg.slice>>10, cfg.paths, cfg.applyDelay, cfg.unsafe, cfg.fence)
	if cfg.rdma {
		st := r.decode
		t.Logf("  over rdma (real devices %v, no fence %v, placement slowed %d us per 64 KiB): decode fences %d (pending %d), error completions %d, failovers %d",
			fakeverbs.Real(), cfg.noFence, cfg.delayUs, st.RDMAFences, st.RDMAFencesPending, st.RDMAErrorWCs, st.RDMAFailovers)
	}
	for f := range nfates {
		t.Logf("  fate %-6s %5d requests, outcomes %v", fate(f), r.fates[f], r.outcomes[f])
	}
	st := r.decode
	if !cfg.fence {
		t.Logf("  %d aborts (%d not safe), call to return p50 %v p99 %v max %v; %d requests not aborted did not complete", r.aborts, r.notSafe,
			pct(r.abortTimes, 0.5), pct(r.abortTimes, 0.99), pct(r.abortTimes, 1), r.notCompleted)
	} else {
		t.Logf("  %d fences (%d not safe, %d returned without the prefill's FENCE_ACK), call to return p50 %v p99 %v max %v; %d requests not given up did not complete",
			r.fences, r.fenceNotSafe, r.fenceUnacked, pct(r.fenceTimes, 0.5), pct(r.fenceTimes, 0.99), pct(r.fenceTimes, 1), r.notCompleted)
		t.Logf("  decode: fence epoch %d, safe %d not safe %d, FENCE_ACKs %d (unmatched %d), accesses refused as fenced at admission %d; prefill: tasks fenced %d, their bytes not landed %d KiB, FENCE notices received %d",
			st.FenceEpoch, st.FencesSafe, st.FencesNotSafe, st.FenceAcks, st.FenceAcksUnmatched, st.FenceRefused,
			r.prefill["tasks_fenced"], r.prefill["bytes_fenced"]>>10, r.prefill["fences_received"])
	}
	t.Logf("  decode: refused %d (in flight %d), ABORT_ACKs %d (unmatched %d), resends %d, tombstones %d, request states %d",
		st.OwnerRefused, st.RefusedInFlight, st.AbortAcks, st.AcksUnmatched, st.AbortResends, st.Tombstones, st.RequestStates)
	t.Logf("  decode events %v (dropped %d); prefill: %v", r.decodeEvents, st.EventsDropped, r.prefill)
	t.Logf("  corrupted bytes %d (%d of them an earlier request's pattern), found by %d page checks: %s %d, %s %d, %s %d",
		bad, old, r.corruptPage, whereNames[0], r.bad[0], whereNames[1], r.bad[1], whereNames[2], r.bad[2])
	for _, n := range r.notes {
		t.Logf("    %s", n)
	}
}
