package pd

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/internal/wordpattern"
)

// stressRun is one stress run in progress: decode's engine and slot pool,
// the prefill, and what the lanes found so far.
type stressRun struct {
	t    *testing.T
	cfg  stressConfig
	res  *stressResult
	rc   *recorder
	d    *engine.Engine
	pp   *prefillProc
	pool *slotPool
	// gaveUp says how decode gave up a request, in messages.
	gaveUp string

	pendMu  sync.Mutex
	pending []pendingReq // requests given up, whose outcome is awaited at the end

	failed     atomic.Bool // stop early on a broken run rather than time out
	overBudget atomic.Bool
	next       atomic.Int64 // the last request id handed to a lane
	start      time.Time
}

// pendingReq is a request decode gave up, and where its outcome arrives.
type pendingReq struct {
	rid uint64
	f   fate
	ch  <-chan outcome
}

// timedCall runs call (an Abort or a Fence of decode) with the run's abort
// deadline and returns how long it took; it fails the test if the call
// returned well past its deadline.
func (r *stressRun) timedCall(what string, call func(ctx context.Context)) time.Duration {
	ctx, cancel := context.WithTimeout(context.Background(), r.cfg.abortDeadline)
	defer cancel()
	start := time.Now()
	call(ctx)
	took := time.Since(start)
	if took > r.cfg.abortDeadline+500*time.Millisecond {
		r.t.Errorf("%s returned %v after its call, its deadline was %v", what, took, r.cfg.abortDeadline)
	}
	return took
}

// abort aborts request rid and counts the call.
func (r *stressRun) abort(rid uint64) {
	var ar engine.AbortResult
	var err error
	took := r.timedCall(fmt.Sprintf("Abort(%d)", rid), func(ctx context.Context) {
		ar, err = r.d.Abort(ctx, rid, []string{r.pp.name})
	})
	res := r.res
	r.rc.mu.Lock()
	defer r.rc.mu.Unlock()
	if countCall(&res.aborts, &res.notSafe, &res.abortTimes, took, err == nil && ar.Safe) {
		r.t.Errorf("Abort(%d) = %+v, %v after %v; want Safe", rid, ar, err, took)
	}
}

// countCall counts a call of decode's (an Abort or a Fence) that took
// took, and whether it was safe; it reports whether the call is one of the
// first five not safe, which the test names one by one.
func countCall(calls, notSafe *int, times *[]time.Duration, took time.Duration, safe bool) bool {
	*calls++
	*times = append(*times, took)
	if safe {
		return false
	}
	*notSafe++
	return *notSafe <= 5
}

// fence fences every slot of the pages of a request decode gives up
// (each page in every layer), for a writer that passes no request id, and
// counts the call.
func (r *stressRun) fence(pgs []int) {
	ranges := make([]engine.FenceRange, 0, r.cfg.layers*len(pgs))
	for l := range r.cfg.layers {
		for _, pg := range pgs {
			s := r.pool.slot(l, pg)
			ranges = append(ranges, engine.FenceRange{Addr: engine.AddrOf(s), Len: uint64(len(s))})
		}
	}
	var fr engine.FenceResult
	var err error
	took := r.timedCall(fmt.Sprintf("Fence of pages %v", pgs), func(ctx context.Context) {
		fr, err = r.d.Fence(ctx, ranges)
	})
	res := r.res
	r.rc.mu.Lock()
	defer r.rc.mu.Unlock()
	if countCall(&res.fences, &res.fenceNotSafe, &res.fenceTimes, took, err == nil && fr.Safe) {
		r.t.Errorf("Fence of pages %v = %+v, %v after %v; want Safe", pgs, fr, err, took)
	}
	if !r.cfg.unsafe && !slices.Contains(fr.Acked, r.pp.name) {
		res.fenceUnacked++
	}
}

// protect makes a request's pages decode's again: Abort of its id, or
// Fence of its pages.
func (r *stressRun) protect(rid uint64, pgs []int) {
	if r.cfg.fence {
		r.fence(pgs)
	} else {
		r.abort(rid)
	}
}

// label is an outcome's name in the run's counts.
func (r *stressRun) label(o outcome) string {
	if r.cfg.fence && o.fencedOnly() {
		return "FENCED"
	}
	return o.status
}

// reuse gives an aborted request's pages to decode itself at once, with a
// pattern of its own, and frees them.
func (r *stressRun) reuse(rid uint64, pgs []int) {
	for j, pg := range pgs {
		r.pool.assign(pg, holder{tag: reuseTag(rid), pos: j})
		r.pool.fill(pg)
	}
	r.pool.put(pgs)
}

// wait waits for request rid's outcome on ch; ok is false (and the test
// failed) when the prefill exited first or a minute passed.
func (r *stressRun) wait(rid uint64, ch <-chan outcome) (outcome, bool) {
	select {
	case o := <-ch:
		return o, true
	case <-r.pp.exited():
		select {
		case o := <-ch: // reported, then exited
			return o, true
		default:
		}
		r.t.Errorf("request %d: the prefill exited before reporting it", rid)
		return outcome{}, false
	case <-time.After(time.Minute):
		r.t.Errorf("request %d: no outcome from the prefill within a minute", rid)
		return outcome{}, false
	}
}

// countOutcome counts o among the outcomes of requests of fate f.
func (r *stressRun) countOutcome(f fate, o outcome) {
	r.rc.mu.Lock()
	r.res.outcomes[f][r.label(o)]++
	r.rc.mu.Unlock()
}

// checkWhole records corruption in the pages of request rid, which
// completed: they must hold its pattern whole.
func (r *stressRun) checkWhole(rid uint64, pgs []int) {
	for _, pg := range pgs {
		if dmg := r.pool.check(pg); dmg.bad > 0 {
			r.rc.corrupt(atCompletion, pg, rid, dmg)
		}
	}
}

// addPending leaves request rid's outcome to be awaited at the end.
func (r *stressRun) addPending(rid uint64, f fate, ch <-chan outcome) {
	r.pendMu.Lock()
	r.pending = append(r.pending, pendingReq{rid, f, ch})
	r.pendMu.Unlock()
}

// lane sends requests, one at a time, until the run's requests are all
// started, its budget is spent, or it failed.
func (r *stressRun) lane() {
	cfg := r.cfg
	addrs := make([]uint64, cfg.layers*cfg.pages)
	for !r.failed.Load() {
		if cfg.budget > 0 && time.Since(r.start) > cfg.budget {
			r.overBudget.Store(true)
			return
		}
		i := r.next.Add(1)
		if i > int64(cfg.requests) {
			return
		}
		rid := uint64(i)
		rng := rand.New(rand.NewPCG(cfg.seed, rid))
		f := fateNone
		switch n := rng.IntN(100); {
		case n < cfg.before:
			f = fateBefore
		case n < cfg.before+cfg.during:
			f = fateDuring
		case n < cfg.before+cfg.during+cfg.after:
			f = fateAfter
		}
		pgs := r.pool.take(cfg.pages)
		for j, pg := range pgs {
			if dmg := r.pool.check(pg); dmg.bad > 0 {
				r.rc.corrupt(atReuse, pg, r.pool.state[pg].cur.tag, dmg)
			}
			r.pool.assign(pg, holder{tag: rid, pos: j})
			for l := range cfg.layers {
				addrs[l*cfg.pages+j] = engine.AddrOf(r.pool.slot(l, pg))
			}
		}
		r.rc.mu.Lock()
		r.res.fates[f]++
		r.rc.mu.Unlock()
		var ok bool
		switch f {
		case fateNone, fateAfter:
			ok = r.writeToTheEnd(rid, f, pgs, addrs)
		case fateBefore:
			// The prefill hears of the request only after the abort (a
			// request aborted while queued at the prefill).
			r.abort(rid)
			r.reuse(rid, pgs)
			r.addPending(rid, f, r.pp.send(r.t, rid, 0, cfg.layers, cfg.pages, cfg.pageSize, addrs))
			ok = true
		case fateDuring:
			ok = r.giveUpWhileWritten(rid, rng, pgs, addrs)
		}
		if !ok {
			r.failed.Store(true)
			return
		}
	}
}

// writeToTheEnd has the prefill write request rid (fate none or after)
// and checks its pages once it completed; a request of fate after is then
// given up. It returns false when the run cannot go on.
func (r *stressRun) writeToTheEnd(rid uint64, f fate, pgs []int, addrs []uint64) bool {
	cfg := r.cfg
	o, ok := r.wait(rid, r.pp.send(r.t, rid, 0, cfg.layers, cfg.pages, cfg.pageSize, addrs))
	if !ok {
		return false
	}
	r.countOutcome(f, o)
	if o.status != engine.Completed.String() {
		// A transfer that did not complete, of a request not aborted: an
		// error. Its pages hold whatever landed, no holder's pattern;
		// decode gives up the request as an application would, aborting
		// (or fencing) it before it reuses the pages, and the run goes on
		// so that its checks cover every request. In a fence run this is
		// what the protected rows rule out: a request handed pages only
		// after their last fence returned, failing.
		r.rc.mu.Lock()
		r.res.notCompleted++
		n := r.res.notCompleted
		r.rc.mu.Unlock()
		if n <= 5 {
			r.t.Errorf("request %d (not %s before it completed): %s", rid, r.gaveUp, o.line)
		}
		r.protect(rid, pgs)
		r.reuse(rid, pgs)
		return true
	}
	r.checkWhole(rid, pgs)
	if f == fateAfter {
		r.protect(rid, pgs)
		r.reuse(rid, pgs)
	} else {
		r.pool.put(pgs)
	}
	return true
}

// giveUpWhileWritten has the prefill write request rid and gives it up
// while its pages are being written: once its first bytes landed, or
// after a random delay below duringMax. It returns false when the run
// cannot go on.
func (r *stressRun) giveUpWhileWritten(rid uint64, rng *rand.Rand, pgs []int, addrs []uint64) bool {
	t, cfg := r.t, r.cfg
	ch, planned := r.pp.sendPlanned(t, rid, 0, cfg.layers, cfg.pages, cfg.pageSize, addrs)
	var early *outcome
	if cfg.fence && !cfg.fenceEarly {
		// A fence stops the transfers planned before it: a layer the
		// prefill submitted after it would pass, and land in the reused
		// pages. Decode fences once every layer of the request was
		// submitted.
		select {
		case <-planned:
		case o := <-ch:
			early = &o
		case <-time.After(time.Minute):
			t.Errorf("request %d: not planned within a minute", rid)
			return false
		}
	}
	switch {
	case early != nil: // it ended before it was all planned
	case rng.IntN(2) == 0:
		// Until the first word of one of its layer-0 pages landed:
		// frames of it are certainly on their way.
		want := make([]uint64, cfg.pages)
		for j := range want {
			want[j], _ = patternOf(holder{tag: rid, pos: j}, 0)
		}
		landed := func() bool {
			for j, pg := range pgs {
				if wordpattern.Words(r.pool.slot(0, pg))[0] == want[j] {
					return true
				}
			}
			return false
		}
		for end := time.Now().Add(30 * time.Second); early == nil && !landed(); {
			select {
			case o := <-ch:
				early = &o
			case <-time.After(20 * time.Microsecond): // polls the pages: the landing of a word signals nothing
			}
			if time.Now().After(end) {
				t.Errorf("request %d: none of its pages began to land within 30s", rid)
				r.failed.Store(true)
				break
			}
		}
	default:
		select {
		case o := <-ch:
			early = &o
		case <-time.After(time.Duration(rng.Int64N(int64(cfg.duringMax)))): // the random moment of the abort
		}
	}
	if early != nil && early.status == engine.Completed.String() {
		// It completed before the abort: its pages are whole.
		r.checkWhole(rid, pgs)
	}
	r.protect(rid, pgs)
	r.reuse(rid, pgs)
	if early != nil {
		done := make(chan outcome, 1)
		done <- *early
		ch = done
	}
	r.addPending(rid, fateDuring, ch)
	return true
}
