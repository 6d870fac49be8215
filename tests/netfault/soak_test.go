package netfault

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
)

// defaultSoak is the soak's length unless KVFERRY_NETFAULT_SOAK says
// otherwise (make test-netfault-soak: 3 minutes).
const defaultSoak = 25 * time.Second

// soakPhase is one state of the network during the soak.
type soakPhase struct {
	name  string
	d     time.Duration
	apply func(f *faults, ports []int)
}

// soakPhases repeat, in this order, for the length of the soak; all of
// them fit in the default run.
var soakPhases = []soakPhase{
	{"clean", 3 * time.Second, func(f *faults, _ []int) { f.unlimit(); f.clear() }},
	{"1% loss", 3 * time.Second, func(f *faults, p []int) { f.drop(p, 1) }},
	{"10% loss", 3 * time.Second, func(f *faults, p []int) { f.drop(p, 10) }},
	{"100 Mbit/s", 3 * time.Second, func(f *faults, _ []int) { f.clear(); f.limit(100) }},
	{"blackhole", 2 * time.Second, func(f *faults, p []int) { f.unlimit(); f.drop(p, 100) }},
}

// soakFate is when the owner aborts a request.
type soakFate int

const (
	fateNone   soakFate = iota // not aborted, unless it fails
	fateBefore                 // aborted before the initiator submits it
	fateDuring                 // aborted while it runs
	fateAfter                  // aborted after it completed
	nfates
)

func (f soakFate) String() string { return [...]string{"none", "before", "during", "after"}[f] }

// reuseBit marks the pattern an owner writes into a slot it reused after
// aborting the request that held it; request ids stay below it.
const reuseBit = 1 << 62

// TestSoakWritesReadsAndAbortsUnderFaults: for defaultSoak (or
// KVFERRY_NETFAULT_SOAK), four lanes of this process (the initiator) WRITE
// and READ 512 KiB requests (4 slices each, over 4 paths) into and out of
// the target's slots, while the network between the two cycles through
// soakPhases (no fault, 1% and 10% loss, a 100 Mbit/s limit, a 2 s
// blackhole). The target aborts requests at random: before they are
// submitted, while they run, after they completed, and every one that
// failed. It holds that:
//
//   - every Abort is Safe by its deadline + deadlineSlack, and every
//     Transfer returns by its deadline + deadlineSlack;
//   - every completed transfer verifies: a WRITE's slot holds its pattern,
//     a READ's destination the slot's;
//   - no byte lands in a slot after the abort that freed it: a slot holds
//     exactly what its last holder left when the next request takes it, and
//     at the end;
//   - no READ brings back a byte the target wrote after its Safe abort;
//   - no request aborted before it was submitted completes;
//   - once the faults stop, transfers complete again.
func TestSoakWritesReadsAndAbortsUnderFaults(t *testing.T) {
	f := useFaults(t)
	length := defaultSoak
	if v := os.Getenv(soakEnv); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			t.Fatalf("%s=%q: want a duration", soakEnv, v)
		}
		length = d
	}
	const (
		lanes    = 4
		slotSize = 512 << 10
		slots    = 8 * lanes
		slice    = 128 << 10
		// Shorter than the blackhole: transfers time out in it, and the
		// target aborts them there.
		xferDeadline  = time.Second
		abortDeadline = 2 * time.Second
		duringMax     = 3 * time.Millisecond
		seed          = 0x50a4
	)
	// The target pauses briefly after admitting each WRITE frame, so that
	// frames are in flight at aborts even on a clean loopback.
	tp := startPeer(t, peerConfig{size: slots * slotSize, applyDelay: 100 * time.Microsecond})
	e := newEngine(t, engine.Options{SliceSize: slice})
	local := alloc(t, e, lanes*slotSize)
	seg := openSegment(t, e, tp.name)
	eData, _ := e.Descriptor().Transport("tcp")
	ports := append(tp.ports(), portOf(t, e.Name()), portOf(t, eData))

	// The slots: a FIFO of free ones (a freed slot waits a while before
	// its next holder, so a late write has time to land), and the pattern
	// each must hold now (0: unknown, after an abort that was not Safe).
	var poolMu sync.Mutex
	free := make([]int, slots)
	holder := make([]uint64, slots)
	for i := range free {
		free[i] = i
		holder[i] = reuseBit | 1<<61 | uint64(i)
		tp.fill(i*slotSize, slotSize, holder[i])
	}

	var (
		phase     atomic.Int32
		stop      atomic.Bool
		next      atomic.Uint64
		lat       lateness
		mu        sync.Mutex // guards what follows
		corrupt   uint64     // bytes found wrong
		notes     []string   // the first findings, described
		requests  [nfates][2]int
		outcomes  = map[string]int{}
		byPhase   = map[string]map[string]int{}
		aborts    int
		notSafe   int
		verified  int // completed transfers whose bytes were checked
		completes int
	)
	finding := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		if len(notes) < 10 {
			notes = append(notes, fmt.Sprintf(format, args...))
			t.Errorf(format, args...)
		}
	}
	lane := func(li int) {
		buf := local[li*slotSize : (li+1)*slotSize]
		for !stop.Load() {
			rid := next.Add(1)
			rng := rand.New(rand.NewPCG(seed, rid))
			op, opi := engine.Write, 0
			if rng.IntN(2) == 1 {
				op, opi = engine.Read, 1
			}
			fate := fateNone
			switch n := rng.IntN(100); {
			case n < 10:
				fate = fateBefore
			case n < 35:
				fate = fateDuring
			case n < 45:
				fate = fateAfter
			}
			poolMu.Lock()
			slot := free[0]
			free = free[1:]
			held := holder[slot]
			poolMu.Unlock()
			off := slot * slotSize
			if held != 0 {
				m, err := tp.tryCheck(off, slotSize, held, 0)
				if err != nil {
					finding("%v", err)
					return
				}
				if m.bad != 0 {
					mu.Lock()
					corrupt += m.bad
					mu.Unlock()
					finding("slot %d, before request %d takes it: %v (it must hold %#x, which its last holder left)", slot, rid, m, held)
				}
			}
			tag, reuse := rid, rid|reuseBit
			if op == engine.Read {
				if _, err := tp.try("ok", "fill %d %d %d", off, slotSize, tag); err != nil {
					finding("%v", err)
					return
				}
			}
			ph := soakPhases[phase.Load()].name
			run := func() engine.TaskStatus {
				if op == engine.Write {
					fillPattern(buf, tag)
				} else {
					fillPattern(buf, poisonSeed)
				}
				r := req(op, buf, seg, tp.addr+uint64(off))
				r.RequestID = rid
				ctx, cancel := context.WithTimeout(context.Background(), xferDeadline)
				defer cancel()
				start := time.Now()
				res, err := e.Transfer(ctx, []engine.Request{r})
				took := time.Since(start)
				lat.add("Transfer", took, xferDeadline)
				if took > xferDeadline+deadlineSlack {
					finding("request %d (%v, %s): Transfer returned %v past its %v deadline: %v", rid, op, ph, took-xferDeadline, xferDeadline, err)
				}
				if len(res) != 1 {
					finding("request %d: Transfer gave %d results: %v", rid, len(res), err)
					return engine.Failed
				}
				return res[0].Status
			}
			// abort has the target abort the request and, once Safe, fill
			// its slot with the reuse pattern; it returns the slot's new
			// holder (0 when not Safe).
			abort := func() uint64 {
				ar, err := tp.abort(rid, abortDeadline, e.Name(), off, slotSize, reuse)
				if err != nil {
					finding("%v", err)
					return 0
				}
				lat.add("Abort", ar.took, abortDeadline)
				mu.Lock()
				aborts++
				if !ar.safe {
					notSafe++
				}
				mu.Unlock()
				if !ar.safe {
					finding("request %d (%v, %s): Abort not Safe after %v: %s", rid, op, ph, ar.took, ar.reason)
					return 0
				}
				if ar.took > abortDeadline+deadlineSlack {
					finding("request %d: Abort returned %v past its %v deadline", rid, ar.took-abortDeadline, abortDeadline)
				}
				return reuse
			}
			// verify checks a completed transfer's bytes.
			verify := func() {
				var m mismatch
				if op == engine.Write {
					var err error
					if m, err = tp.tryCheck(off, slotSize, tag, 0); err != nil {
						finding("%v", err)
						return
					}
				} else {
					m = checkPattern(buf, tag, reuse)
				}
				mu.Lock()
				verified++
				corrupt += m.bad
				mu.Unlock()
				if m.bad != 0 {
					finding("request %d (%v, fate %v, %s) completed, but %s: %v", rid, op, fate, ph, map[engine.Op]string{engine.Write: "the slot holds", engine.Read: "its destination holds"}[op], m)
				}
			}
			next := tag
			var status engine.TaskStatus
			switch fate {
			case fateBefore:
				next = abort()
				status = run()
				if status == engine.Completed {
					finding("request %d (%v, %s), aborted Safe before it was submitted, completed", rid, op, ph)
				}
			case fateDuring:
				done := make(chan engine.TaskStatus, 1)
				go func() { done <- run() }()
				time.Sleep(time.Duration(rng.Int64N(int64(duringMax)))) // when the abort strikes
				next = abort()
				status = <-done
				if status == engine.Completed && op == engine.Read {
					verify() // whole: every byte was read before the abort
				}
			default:
				status = run()
				if status == engine.Completed {
					verify()
				}
				if fate == fateAfter || status != engine.Completed {
					// A failed request is given up as an application
					// would: aborted before its slot is reused.
					next = abort()
				}
			}
			if op == engine.Read && status != engine.Completed {
				if m := checkPattern(buf, tag, reuse); m.reuse != 0 {
					mu.Lock()
					corrupt += 8 * m.reuse
					mu.Unlock()
					finding("request %d (READ, fate %v, %s) ended %v with %d words the target wrote after its Safe abort", rid, fate, ph, status, m.reuse)
				}
			}
			mu.Lock()
			requests[fate][opi]++
			outcomes[fmt.Sprintf("%v/%v", fate, status)]++
			if byPhase[ph] == nil {
				byPhase[ph] = map[string]int{}
			}
			byPhase[ph][status.String()]++
			if status == engine.Completed {
				completes++
			}
			mu.Unlock()
			poolMu.Lock()
			holder[slot] = next
			free = append(free, slot)
			poolMu.Unlock()
		}
	}

	start := time.Now()
	var wg sync.WaitGroup
	for li := range lanes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			lane(li)
		}()
	}
	// Should the fault injector fail the test, the lanes stop before the
	// engines close under them.
	defer func() {
		stop.Store(true)
		wg.Wait()
	}()
	// The network's phases, in this goroutine (the fault injector fails
	// the test from here only).
	for i := 0; time.Since(start) < length; i = (i + 1) % len(soakPhases) {
		p := soakPhases[i]
		p.apply(f, ports)
		phase.Store(int32(i))
		time.Sleep(min(p.d, length-time.Since(start))) // the fault itself
	}
	f.unlimit()
	f.clear()
	phase.Store(0)
	ended := time.Now()
	stop.Store(true)
	wg.Wait()
	seen, dropped := f.counts()

	// Recovery: a WRITE and a READ of every slot complete, the first
	// within a minute of the faults' end.
	buf := local[:slotSize]
	for slot := range slots {
		off := slot * slotSize
		rid := next.Add(1)
		fillPattern(buf, rid)
		r := req(engine.Write, buf, seg, tp.addr+uint64(off))
		r.RequestID = rid
		for {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			_, err := e.Transfer(ctx, []engine.Request{r})
			cancel()
			if err == nil {
				break
			}
			if time.Since(ended) > time.Minute {
				t.Fatalf("no WRITE completed within a minute of the faults' end: %v", err)
			}
		}
		// A READ on every path after the WRITE: each path is FIFO, so
		// once these are done every frame sent before was handled.
		fillPattern(buf, poisonSeed)
		r.Op = engine.Read
		transfer(t, e, 30*time.Second, r)
		if m := checkPattern(buf, rid, 0); m.bad != 0 {
			t.Errorf("slot %d after the faults: the READ brought back %v", slot, m)
		}
		poolMu.Lock()
		holder[slot] = rid
		poolMu.Unlock()
	}
	recovered := time.Since(ended)
	// Every slot holds its last holder's pattern: nothing landed late.
	for slot := range slots {
		if m := tp.check(slot*slotSize, slotSize, holder[slot], 0); m.bad != 0 {
			corrupt += m.bad
			t.Errorf("slot %d at the end: %v", slot, m)
		}
	}
	st := tp.stats()

	total := 0
	for _, r := range requests {
		total += r[0] + r[1]
	}
	t.Logf("soak of %v (%s), %d lanes, slots of %d KiB in slices of %d KiB, deadlines: transfer %v, abort %v",
		length, where, lanes, slotSize>>10, slice>>10, xferDeadline, abortDeadline)
	t.Logf("  %d requests (%.0f/s): %d completed, %d of them verified (%d MiB); by fate (WRITE, READ): none %v, before %v, during %v, after %v",
		total, float64(total)/length.Seconds(), completes, verified, verified*slotSize>>20,
		requests[fateNone], requests[fateBefore], requests[fateDuring], requests[fateAfter])
	t.Logf("  outcomes by fate: %v", outcomes)
	for _, p := range soakPhases {
		t.Logf("  in %-10s %v", p.name+":", byPhase[p.name])
	}
	t.Logf("  %d aborts, %d not Safe; calls: %v", aborts, notSafe, &lat)
	t.Logf("  target: refused %d accesses (%d in flight), aborts safe %d, not safe %d; packets on the ports %d, dropped %d; recovered %v after the faults ended",
		st["refused"], st["refused_in_flight"], st["aborts_safe"], st["aborts_not_safe"], seen, dropped, recovered.Round(time.Millisecond))
	t.Logf("  corrupted bytes: %d", corrupt)
	if corrupt != 0 || notSafe != 0 || st["aborts_not_safe"] != 0 {
		t.Errorf("%d corrupted bytes, %d aborts not Safe (the target counted %d); want none", corrupt, notSafe, st["aborts_not_safe"])
	}
	// The run must have done what it claims, or its silence proves nothing.
	if verified < 100 || requests[fateDuring][0] < 10 || requests[fateDuring][1] < 10 || dropped == 0 {
		t.Errorf("the soak verified %d transfers, aborted %v (WRITE, READ) while running, and saw %d packets dropped: too little to mean anything",
			verified, requests[fateDuring], dropped)
	}
}
