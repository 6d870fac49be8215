package main

// --mode abort: abort latency (Abort called -> returned Safe) with WRITE
// traffic in flight: how long an owner waits before it may reuse the memory
// of an aborted request (docs/SAFETY.md says what a safe abort promises).
// The owner (decode) is the engine whose memory the initiator (prefill) writes;
// it aborts request ids that are in flight and times each call. A same-run
// baseline, an owner -> initiator Notify round trip, sits next to it so the
// latency can be read as a ratio: absolute figures on these machines vary by
// more than the effect under study.
//
// One process (default): both engines here, TCP on --host. With
// --two-process the initiator runs as a child process of this binary
// ("--mode abort --segment OWNER"), which announces each request it starts
// and ends with Notify, since the owner otherwise cannot know which request
// ids are in flight.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvferry/kvferry/engine"
)

// errAbortFail marks a run whose aborts were not all Safe or whose requests
// ended otherwise than COMPLETED or ABORTED: main exits 1 on it.
var errAbortFail = errors.New("abort benchmark failed")

// Request ids: traffic thread th uses (th+1)<<40 | seq; the idle-abort
// baseline uses idleRidBase | k, which no transfer ever carries.
const (
	ridThreadShift = 40
	idleRidBase    = 1 << 62
)

// Two-process announcements (Notify data; the request id is the Notify's).
const (
	annHello = "hello" // the initiator is ready and its traffic starts
	annBye   = "bye"   // its traffic stopped
	annStart = 'S'     // 'S', thread: request id is now in flight
	annEnd   = 'E'     // 'E', thread: request id's Transfer returned
)

// slotTable tells the aborter which request id each traffic thread has in
// flight (0: none), and which it already aborted, so it never picks one
// twice. Filled directly in one process, from announcements in two.
type slotTable struct {
	cur, aborted []atomic.Uint64
}

func newSlotTable(n int) *slotTable {
	return &slotTable{cur: make([]atomic.Uint64, n), aborted: make([]atomic.Uint64, n)}
}

// pick returns a request id in flight and not yet aborted, chosen with rng,
// polling until one is or until stop; ok is false at stop.
func (s *slotTable) pick(rng *rand.Rand, stop <-chan struct{}) (rid uint64, ok bool) {
	cand := make([]int, 0, len(s.cur))
	for {
		cand = cand[:0]
		for i := range s.cur {
			if r := s.cur[i].Load(); r != 0 && r != s.aborted[i].Load() {
				cand = append(cand, i)
			}
		}
		if len(cand) > 0 {
			i := cand[rng.IntN(len(cand))]
			rid = s.cur[i].Load()
			if rid != 0 {
				s.aborted[i].Store(rid)
				return rid, true
			}
			continue
		}
		select {
		case <-stop:
			return 0, false
		case <-time.After(100 * time.Microsecond):
		}
	}
}

// trafficResult counts one traffic thread's requests by outcome.
type trafficResult struct {
	requests, completed, aborted, other uint64
	bytes                               uint64   // sum of TaskResult.Transferred: a lower bound
	firstErr                            error    // the first outcome that was neither COMPLETED nor ABORTED
	struck                              []uint64 // request ids that ended with ABORTED tasks
}

// runTraffic keeps --rate MB/s of WRITEs going from e's local memory into
// the owner's slots until stop: --threads threads, each writing requests of
// --block-size bytes, cut into --batch-size pieces submitted as one batch
// (like per-layer KV writes), into a slot of its own, each request with a
// new request id. announce is told when a request starts and ends. Pacing
// counts the bytes a request moved, so an aborted request is followed at
// once by the next.
func runTraffic(c config, e *engine.Engine, seg *engine.Segment, local, remote uint64, stop time.Time,
	announce func(th int, rid uint64, starting bool)) []trafficResult {
	results := make([]trafficResult, c.threads)
	perThread := c.rate * 1e6 / float64(c.threads) // bytes per second
	var wg sync.WaitGroup
	for th := 0; th < c.threads; th++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := &results[th]
			reqs := threadRequests(c, th, local, seg, remote)
			pace := newPacer(perThread, stop)
			for seq := uint64(1); pace.due(); seq++ {
				rid := uint64(th+1)<<ridThreadShift | seq
				for i := range reqs {
					reqs[i].RequestID = rid
				}
				announce(th, rid, true)
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				res, err := e.Transfer(ctx, reqs)
				cancel()
				announce(th, rid, false)
				r.requests++
				var moved uint64
				struck, bad := false, res == nil
				for _, t := range res {
					moved += t.Transferred
					switch t.Status {
					case engine.Completed:
					case engine.Aborted:
						struck = true
					default:
						bad = true
						if r.firstErr == nil {
							r.firstErr = fmt.Errorf("request %#x: task %s: %w", rid, t.Status, t.Err)
						}
					}
				}
				r.bytes += moved
				switch {
				case err == nil:
					r.completed++
				case bad || !struck:
					r.other++
					if r.firstErr == nil {
						r.firstErr = fmt.Errorf("request %#x: %w", rid, err)
					}
				default:
					r.aborted++
					r.struck = append(r.struck, rid)
				}
				pace.spent(moved)
			}
		}()
	}
	wg.Wait()
	return results
}

// sumTraffic adds up the threads' results.
func sumTraffic(rs []trafficResult) trafficResult {
	var s trafficResult
	for _, r := range rs {
		s.requests += r.requests
		s.completed += r.completed
		s.aborted += r.aborted
		s.other += r.other
		s.bytes += r.bytes
		s.struck = append(s.struck, r.struck...)
		if s.firstErr == nil {
			s.firstErr = r.firstErr
		}
	}
	return s
}

// abortRec is one timed abort.
type abortRec struct {
	rid  uint64
	lat  time.Duration
	safe bool
}

// latencies is a set of timings with the percentiles the report prints.
type latencies []time.Duration

func (l latencies) pct(p float64) time.Duration {
	if len(l) == 0 {
		return 0
	}
	s := append(latencies(nil), l...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[min(len(s)-1, int(p*float64(len(s))))]
}

func (l latencies) String() string {
	return fmt.Sprintf("n=%d p50=%dus p90=%dus p99=%dus max=%dus", len(l),
		l.pct(0.50).Microseconds(), l.pct(0.90).Microseconds(), l.pct(0.99).Microseconds(), l.pct(1).Microseconds())
}

// drainEvents empties e's event queue until Close closes it, so that
// notifications are never refused as busy; it counts EventAborted.
func drainEvents(e *engine.Engine, aborted *atomic.Uint64) {
	for ev := range e.Events() {
		if ev.Kind == engine.EventAborted {
			aborted.Add(1)
		}
	}
}

// verdict prints and returns the failures of an abort or fence run
// (errAbortFail), or nil when there were none.
func verdict(bench string, fails []error) error {
	if err := errors.Join(fails...); err != nil {
		fmt.Printf("FAIL: %s benchmark: %v\n", bench, err)
		return fmt.Errorf("%w: %w", errAbortFail, err)
	}
	return nil
}

// runAbort is --mode abort: the owner side and the report, with the
// initiator in this process or (--two-process) in a child. With --segment
// it is that child instead.
func runAbort(c config) error {
	if c.segment != "" {
		return runAbortInitiator(c)
	}
	size := c.threads * c.blockSize
	owner, slotBuf, err := c.newEngine(size)
	if err != nil {
		return err
	}
	defer owner.Close()
	slots := newSlotTable(c.threads)
	dur := time.Duration(c.duration * float64(time.Second))
	procs := 1
	if c.twoProcess {
		procs = 2
	}
	fmt.Printf("kvferry-bench: mode=abort processes=%d owner=%s request=%d pieces=%d threads=%d paths=%d rate=%gMB/s abort-interval=%s duration=%gs seed=%d\n",
		procs, owner.Name(), c.blockSize, min(c.batchSize, c.blockSize), c.threads, c.pathCount, c.rate, c.abortEvery, c.duration, c.seed)

	var (
		initName   string
		trafficEnd = make(chan struct{}) // closed when the initiator's traffic stopped
		traffic    []trafficResult
		initEvents atomic.Uint64
		child      *exec.Cmd
		childDone  = make(chan error, 1)
		reaped     bool // the child process was waited for
	)
	before := owner.Stats()
	start := time.Now()
	if !c.twoProcess {
		prefill, src, err := c.newEngine(size)
		if err != nil {
			return err
		}
		defer prefill.Close()
		fill(src, 0, c.seed)
		seg, err := prefill.OpenSegment(context.Background(), owner.Name())
		if err != nil {
			return err
		}
		go drainEvents(prefill, &initEvents)
		initName = prefill.Name()
		before = owner.Stats()
		start = time.Now()
		go func() {
			defer close(trafficEnd)
			traffic = runTraffic(c, prefill, seg, engine.AddrOf(src), engine.AddrOf(slotBuf), start.Add(dur),
				func(th int, rid uint64, starting bool) {
					if starting {
						slots.cur[th].Store(rid)
					} else {
						slots.cur[th].CompareAndSwap(rid, 0)
					}
				})
		}()
	} else {
		exe, err := os.Executable()
		if err != nil {
			return err
		}
		child = exec.Command(exe, "--mode", "abort", "--segment", owner.Name(), "--host", c.host,
			"--threads", strconv.Itoa(c.threads), "--paths", strconv.Itoa(c.pathCount),
			"--block-size", strconv.Itoa(c.blockSize), "--batch-size", strconv.Itoa(c.batchSize),
			"--slice-size", strconv.Itoa(c.sliceSize), "--rate", strconv.FormatFloat(c.rate, 'g', -1, 64),
			"--duration", strconv.FormatFloat(c.duration, 'g', -1, 64), "--seed", strconv.FormatUint(c.seed, 10),
			"--protocol", c.proto)
		child.Stdout, child.Stderr = os.Stdout, os.Stderr
		if err := child.Start(); err != nil {
			return fmt.Errorf("start the initiator process: %w", err)
		}
		go func() { childDone <- child.Wait() }()
		defer func() {
			if !reaped {
				_ = child.Process.Kill()
				<-childDone
			}
		}()
		hello := make(chan string, 1)
		go ownerAnnouncements(owner, slots, hello, trafficEnd)
		select {
		case initName = <-hello:
		case err := <-childDone:
			reaped = true
			return fmt.Errorf("the initiator process ended before it started: %v", err)
		case <-time.After(30 * time.Second):
			return errors.New("the initiator process did not announce itself within 30 s")
		}
		before = owner.Stats()
		start = time.Now()
	}

	// The owner opens the initiator's segment for the Notify baseline.
	ctx := context.Background()
	initSeg, err := owner.OpenSegment(ctx, initName)
	if err != nil {
		return fmt.Errorf("owner opens the initiator's segment: %w", err)
	}
	initiators := []string{initName}
	rng := rand.New(rand.NewPCG(c.seed, 0xab047))
	stopAborts := make(chan struct{})
	var stopOnce sync.Once
	stopNow := func() { stopOnce.Do(func() { close(stopAborts) }) }
	timer := time.AfterFunc(dur, stopNow)
	defer timer.Stop()
	go func() {
		// In two processes the child's "bye" ends the aborts too.
		select {
		case <-trafficEnd:
			stopNow()
		case <-stopAborts:
		}
	}()
	var (
		recs                []abortRec
		notifyLat, idleLat  latencies
		notifyBusy, notSafe int
		firstNotSafe        error
		idleK               uint64
	)
	abortOnce := func(rid uint64) (time.Duration, bool, error) {
		actx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		t0 := time.Now()
		res, err := owner.Abort(actx, rid, initiators)
		lat := time.Since(t0)
		if err != nil {
			return lat, false, err
		}
		return lat, res.Safe, res.Reason
	}
loop:
	for {
		wait := c.abortEvery/2 + time.Duration(rng.Int64N(int64(c.abortEvery)))
		select {
		case <-stopAborts:
			break loop
		case <-time.After(wait):
		}
		// Baseline 1: a control-plane round trip of the same engines
		// under the same load (before the abort, so that it does not
		// queue behind the ABORT and ABORT_ACK the abort causes).
		nctx, cancel := context.WithTimeout(ctx, time.Second)
		t0 := time.Now()
		err := owner.Notify(nctx, initSeg, 0, []byte("ping"))
		nlat := time.Since(t0)
		cancel()
		switch {
		case err == nil:
			notifyLat = append(notifyLat, nlat)
		case errors.Is(err, engine.ErrBusy):
			notifyBusy++
		default:
			return fmt.Errorf("notify baseline: %w", err)
		}
		// Baseline 2: the same Abort call for a request id nothing
		// carries: its fixed cost, without copies to wait for.
		idleK++
		lat, safe, err := abortOnce(idleRidBase | idleK)
		idleLat = append(idleLat, lat)
		if !safe {
			notSafe++
			if firstNotSafe == nil {
				firstNotSafe = fmt.Errorf("idle abort of request %#x: %v", idleRidBase|idleK, err)
			}
		}
		rid, ok := slots.pick(rng, stopAborts)
		if !ok {
			break
		}
		lat, safe, err = abortOnce(rid)
		recs = append(recs, abortRec{rid: rid, lat: lat, safe: safe})
		if !safe {
			notSafe++
			if firstNotSafe == nil {
				firstNotSafe = fmt.Errorf("abort of request %#x: %v", rid, err)
			}
		}
	}
	var childErr error
	if !c.twoProcess {
		<-trafficEnd
	} else {
		select {
		case <-trafficEnd:
		case childErr = <-childDone:
			reaped = true
			if childErr == nil {
				childErr = errors.New("the initiator process exited without its bye")
			}
		case <-time.After(dur + 30*time.Second):
			childErr = errors.New("no bye from the initiator process 30 s after the run's end")
		}
	}
	elapsed := time.Since(start)
	if c.twoProcess && !reaped {
		select {
		case childErr = <-childDone:
			reaped = true
		case <-time.After(30 * time.Second):
			childErr = errors.New("the initiator process did not exit within 30 s of its bye")
		}
	}
	after := owner.Stats()

	// The report.
	var all, struck, late latencies
	struckSet := map[uint64]bool{}
	tr := sumTraffic(traffic)
	for _, rid := range tr.struck {
		struckSet[rid] = true
	}
	safe := 0
	for _, r := range recs {
		all = append(all, r.lat)
		if r.safe {
			safe++
		}
		if struckSet[r.rid] {
			struck = append(struck, r.lat)
		} else {
			late = append(late, r.lat)
		}
	}
	bytesIn := after.OwnerBytesIn - before.OwnerBytesIn
	mbps := float64(bytesIn) / elapsed.Seconds() / 1e6
	ratio := func(a, b time.Duration) string {
		if b <= 0 {
			return "n/a"
		}
		return fmt.Sprintf("%.2f", float64(a)/float64(b))
	}
	fmt.Printf("abort latency (Abort call -> return, 1 s deadline, a request id in flight): %s\n", all)
	if !c.twoProcess {
		fmt.Printf("  of which the request ended with ABORTED tasks (struck in flight): %s\n", struck)
		fmt.Printf("  of which the request completed anyway (abort came after its last byte): %s\n", late)
	}
	fmt.Printf("baseline Notify round trip (owner -> initiator NOTIFY, NOTIFY_ACK; same run, before each abort): %s (busy %d)\n", notifyLat, notifyBusy)
	fmt.Printf("idle abort (same call, request id with no transfer): %s\n", idleLat)
	fmt.Printf("ratio abort/notify: p50 %s, p99 %s\n", ratio(all.pct(0.5), notifyLat.pct(0.5)), ratio(all.pct(0.99), notifyLat.pct(0.99)))
	fmt.Printf("background WRITEs: %.0f MB/s achieved (owner bytes in), target %g MB/s\n", mbps, c.rate)
	fmt.Printf("owner: aborts safe %d, not safe %d, refused %d, refused in flight %d, ABORT_ACKs %d, unmatched ACKs %d, resends %d\n",
		after.AbortsSafe-before.AbortsSafe, after.AbortsNotSafe-before.AbortsNotSafe,
		after.OwnerRefused-before.OwnerRefused, after.RefusedInFlight-before.RefusedInFlight,
		after.AbortAcks-before.AbortAcks, after.AcksUnmatched-before.AcksUnmatched, after.AbortResends-before.AbortResends)
	if !c.twoProcess {
		fmt.Printf("initiator: requests %d, completed %d, ended ABORTED %d, other %d; EventAborted %d\n",
			tr.requests, tr.completed, tr.aborted, tr.other, initEvents.Load())
	}
	struckN, struckP99 := "na", "na" // two processes: the outcomes stay in the child
	if !c.twoProcess {
		struckN, struckP99 = strconv.Itoa(len(struck)), strconv.FormatInt(struck.pct(0.99).Microseconds(), 10)
	}
	bar := "met"
	if all.pct(0.99) > 2*time.Millisecond {
		bar = "NOT met"
	}
	fmt.Printf("bar p99 <= 2 ms: %s (informational)\n", bar)
	fmt.Printf("RESULT mode=abort processes=%d aborts=%d safe=%d abort_p50_us=%d abort_p90_us=%d abort_p99_us=%d abort_max_us=%d "+
		"struck=%s struck_p99_us=%s notify_p50_us=%d notify_p99_us=%d idle_abort_p50_us=%d idle_abort_p99_us=%d "+
		"ratio_p50=%s ratio_p99=%s bg_mbps=%.0f target_mbps=%g refused=%d refused_in_flight=%d seconds=%.2f\n",
		procs, len(recs), safe, all.pct(0.5).Microseconds(), all.pct(0.9).Microseconds(), all.pct(0.99).Microseconds(),
		all.pct(1).Microseconds(), struckN, struckP99,
		notifyLat.pct(0.5).Microseconds(), notifyLat.pct(0.99).Microseconds(),
		idleLat.pct(0.5).Microseconds(), idleLat.pct(0.99).Microseconds(),
		ratio(all.pct(0.5), notifyLat.pct(0.5)), ratio(all.pct(0.99), notifyLat.pct(0.99)), mbps, c.rate,
		after.OwnerRefused-before.OwnerRefused, after.RefusedInFlight-before.RefusedInFlight, elapsed.Seconds())

	var fails []error
	if notSafe > 0 {
		fails = append(fails, fmt.Errorf("%d aborts not Safe; first: %w", notSafe, firstNotSafe))
	}
	if tr.other > 0 {
		fails = append(fails, fmt.Errorf("%d requests ended neither COMPLETED nor ABORTED; first: %w", tr.other, tr.firstErr))
	}
	if childErr != nil {
		fails = append(fails, fmt.Errorf("initiator process: %w", childErr))
	}
	if len(recs) == 0 {
		fails = append(fails, errors.New("no abort was measured"))
	}
	return verdict("abort", fails)
}

// ownerAnnouncements follows the two-process initiator's announcements on
// the owner's event queue: which request ids are in flight, its name
// (hello) and the end of its traffic (bye). It runs until Close.
func ownerAnnouncements(owner *engine.Engine, slots *slotTable, hello chan<- string, bye chan<- struct{}) {
	said := false
	for ev := range owner.Events() {
		if ev.Kind != engine.EventNotify {
			continue
		}
		switch d := ev.Data; {
		case string(d) == annHello:
			hello <- ev.Peer
		case string(d) == annBye:
			if !said {
				said = true
				close(bye)
			}
		case len(d) == 2 && int(d[1]) < len(slots.cur):
			if d[0] == annStart {
				slots.cur[d[1]].Store(ev.RequestID)
			} else if d[0] == annEnd {
				slots.cur[d[1]].CompareAndSwap(ev.RequestID, 0)
			}
		}
	}
}

// runAbortInitiator is the child of --mode abort --two-process: it writes
// into the owner's slots, announcing each request, for --duration seconds,
// and prints its requests by outcome. It exits non-zero (errAbortFail) when
// one ended otherwise than COMPLETED or ABORTED.
func runAbortInitiator(c config) error {
	if c.threads > 255 {
		return errors.New("--two-process: at most 255 threads")
	}
	size := c.threads * c.blockSize
	e, src, err := c.newEngine(size)
	if err != nil {
		return err
	}
	defer e.Close()
	fill(src, 0, c.seed)
	ctx := context.Background()
	seg, err := e.OpenSegment(ctx, c.segment)
	if err != nil {
		return err
	}
	bufs := seg.Descriptor().Buffers
	if len(bufs) == 0 || bufs[0].Len < uint64(size) {
		return fmt.Errorf("segment %s has no buffer of %d bytes", c.segment, size)
	}
	var events atomic.Uint64
	go drainEvents(e, &events)
	// announce sends one announcement, retrying while the owner's queue is
	// full: a lost start would hide a request from the aborter.
	announce := func(rid uint64, data []byte) error {
		for {
			actx, cancel := context.WithTimeout(ctx, 5*time.Second)
			err := e.Notify(actx, seg, rid, data)
			cancel()
			if !errors.Is(err, engine.ErrBusy) {
				return err
			}
			time.Sleep(100 * time.Microsecond)
		}
	}
	if err := announce(0, []byte(annHello)); err != nil {
		return fmt.Errorf("hello: %w", err)
	}
	var annErr atomic.Pointer[error]
	stop := time.Now().Add(time.Duration(c.duration * float64(time.Second)))
	rs := runTraffic(c, e, seg, engine.AddrOf(src), bufs[0].Addr, stop, func(th int, rid uint64, starting bool) {
		kind := byte(annEnd)
		if starting {
			kind = annStart
		}
		if err := announce(rid, []byte{kind, byte(th)}); err != nil {
			annErr.CompareAndSwap(nil, &err)
		}
	})
	if err := announce(0, []byte(annBye)); err != nil {
		return fmt.Errorf("bye: %w", err)
	}
	tr := sumTraffic(rs)
	fmt.Printf("initiator process: requests %d, completed %d, ended ABORTED %d, other %d; EventAborted %d\n",
		tr.requests, tr.completed, tr.aborted, tr.other, events.Load())
	if p := annErr.Load(); p != nil {
		return fmt.Errorf("announce: %w", *p)
	}
	if tr.other > 0 {
		fmt.Printf("FAIL: initiator process: %d requests ended neither COMPLETED nor ABORTED; first: %v\n", tr.other, tr.firstErr)
		return fmt.Errorf("%w: %d requests ended neither COMPLETED nor ABORTED", errAbortFail, tr.other)
	}
	return nil
}
