package main

// --mode fence: fence latency (Fence called -> returned Safe) with WRITE
// traffic that carries no request id, as SGLang's and vLLM's Mooncake
// wrappers send it, and what a fence costs the other requests in flight.
//
// Both engines run here (the transport is the engine's choice: tcp by
// default, rdma with KVFERRY_PROTOCOL=rdma). --threads threads write
// requests of --block-size bytes, cut into --batch-size pieces, each into a
// slot of its own, paced to --rate MB/s together. Thread 0 is the victim:
// every --abort-interval (mean) the owner fences its slot, whatever is in
// flight, and the victim goes on with its next request at once. The other
// threads are the bystanders: their requests never touch a fenced byte, so
// every one of them must complete; their latency in the first third of the
// run (no fences yet) is the same-run baseline for their latency while
// fences strike. Baselines for the fence itself, from the same run and just
// before each fence: an owner -> initiator Notify round trip, and an Abort
// of a request id nothing carries (the abort's fixed cost).

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvferry/kvferry/engine"
)

// victimRun is what the victim thread saw.
type victimRun struct {
	requests, completed, fenced, nextFailed uint64
	firstNextErr                            error
}

// bystanderRun is what one other thread saw.
type bystanderRun struct {
	quiet, fencing latencies // request latency before the first fence, and after it
	failed         uint64
	firstErr       error
}

func runFence(c config) error {
	size := c.threads * c.blockSize
	owner, slots, err := c.newEngine(size)
	if err != nil {
		return err
	}
	defer owner.Close()
	prefill, src, err := c.newEngine(size)
	if err != nil {
		return err
	}
	defer prefill.Close()
	fill(src, 0, c.seed)
	ctx := context.Background()
	seg, err := prefill.OpenSegment(ctx, owner.Name())
	if err != nil {
		return err
	}
	initSeg, err := owner.OpenSegment(ctx, prefill.Name())
	if err != nil {
		return err
	}
	go drainEvents(prefill, new(atomic.Uint64))
	go drainEvents(owner, new(atomic.Uint64))
	fmt.Printf("kvferry-bench: mode=fence owner=%s request=%d pieces=%d threads=%d (1 victim) paths=%d rate=%gMB/s fence-interval=%s duration=%gs seed=%d\n",
		owner.Name(), c.blockSize, min(c.batchSize, c.blockSize), c.threads, c.pathCount, c.rate, c.abortEvery, c.duration, c.seed)

	dur := time.Duration(c.duration * float64(time.Second))
	start := time.Now()
	stop := start.Add(dur)
	fencingFrom := start.Add(dur / 3)
	// fenceStarted is when the newest fence was called: a victim request
	// planned after it and refused as fenced was a "next request", which
	// the normal flow promises never fails (no fence came after it was
	// planned).
	var fenceStarted, fenceReturned atomic.Int64
	before := owner.Stats()

	perThread := c.rate * 1e6 / float64(c.threads)
	victim := &victimRun{}
	bystanders := make([]bystanderRun, c.threads)
	var wg sync.WaitGroup
	for th := 0; th < c.threads; th++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			reqs := threadRequests(c, th, engine.AddrOf(src), seg, engine.AddrOf(slots))
			pace := newPacer(perThread, stop)
			for pace.due() {
				// No fence in progress when it is planned, and none after:
				// a refusal then breaks the normal-flow promise.
				s0, r0 := fenceStarted.Load(), fenceReturned.Load()
				planned := time.Now()
				tctx, cancel := context.WithTimeout(ctx, 10*time.Second)
				res, err := prefill.Transfer(tctx, reqs)
				cancel()
				lat := time.Since(planned)
				var moved uint64
				for _, t := range res {
					moved += t.Transferred
				}
				pace.spent(max(moved, 1))
				if th == 0 {
					victim.requests++
					switch {
					case err == nil:
						victim.completed++
					case errors.Is(err, engine.ErrFenced):
						victim.fenced++
						if r0 >= s0 && fenceStarted.Load() == s0 {
							victim.nextFailed++
							if victim.firstNextErr == nil {
								victim.firstNextErr = err
							}
						}
					default:
						victim.nextFailed++
						if victim.firstNextErr == nil {
							victim.firstNextErr = err
						}
					}
					continue
				}
				b := &bystanders[th]
				if err != nil {
					b.failed++
					if b.firstErr == nil {
						b.firstErr = err
					}
					continue
				}
				if planned.Before(fencingFrom) {
					b.quiet = append(b.quiet, lat)
				} else {
					b.fencing = append(b.fencing, lat)
				}
			}
		}()
	}

	rng := rand.New(rand.NewPCG(c.seed, 0xfe4ce))
	victimSlot := []engine.FenceRange{{Addr: engine.AddrOf(slots), Len: uint64(c.blockSize)}}
	var fenceLat, notifyLat, idleLat latencies
	var notSafe int
	var firstNotSafe error
	var cut int
	idleK := uint64(0)
	time.Sleep(time.Until(fencingFrom))
	for time.Until(stop) > c.abortEvery {
		time.Sleep(c.abortEvery/2 + time.Duration(rng.Int64N(int64(c.abortEvery))))
		nctx, cancel := context.WithTimeout(ctx, time.Second)
		t0 := time.Now()
		if err := owner.Notify(nctx, initSeg, 0, []byte("ping")); err == nil {
			notifyLat = append(notifyLat, time.Since(t0))
		}
		cancel()
		idleK++
		actx, cancel := context.WithTimeout(ctx, time.Second)
		t0 = time.Now()
		if res, err := owner.Abort(actx, idleRidBase|idleK, []string{prefill.Name()}); err == nil && res.Safe {
			idleLat = append(idleLat, time.Since(t0))
		}
		cancel()
		fctx, cancel := context.WithTimeout(ctx, time.Second)
		t0 = time.Now()
		fenceStarted.Store(t0.UnixNano())
		res, err := owner.Fence(fctx, victimSlot)
		lat := time.Since(t0)
		fenceReturned.Store(time.Now().UnixNano())
		cancel()
		fenceLat = append(fenceLat, lat)
		cut += len(res.Cut)
		if err != nil || !res.Safe {
			notSafe++
			if firstNotSafe == nil {
				firstNotSafe = errors.Join(err, res.Reason)
			}
		}
	}
	wg.Wait()
	elapsed := time.Since(start)
	after := owner.Stats()

	var quiet, fencing latencies
	var failed uint64
	var firstErr error
	for i := 1; i < c.threads; i++ {
		quiet = append(quiet, bystanders[i].quiet...)
		fencing = append(fencing, bystanders[i].fencing...)
		failed += bystanders[i].failed
		if firstErr == nil {
			firstErr = bystanders[i].firstErr
		}
	}
	ratio := func(a, b time.Duration) string {
		if b <= 0 {
			return "n/a"
		}
		return fmt.Sprintf("%.2f", float64(a)/float64(b))
	}
	mbps := float64(after.OwnerBytesIn-before.OwnerBytesIn) / elapsed.Seconds() / 1e6
	if after.OwnerBytesIn == before.OwnerBytesIn {
		mbps = float64(uint64(c.blockSize)*(victim.completed+uint64(len(quiet)+len(fencing)))) / elapsed.Seconds() / 1e6
	}
	fmt.Printf("fence latency (Fence call -> return, victim's slot, a request of it mostly in flight): %s\n", fenceLat)
	fmt.Printf("baseline idle abort (same run, request id nothing carries): %s\n", idleLat)
	fmt.Printf("baseline Notify round trip (same run): %s\n", notifyLat)
	fmt.Printf("ratio fence/idle-abort: p50 %s, p99 %s\n", ratio(fenceLat.pct(0.5), idleLat.pct(0.5)), ratio(fenceLat.pct(0.99), idleLat.pct(0.99)))
	fmt.Printf("bystanders' request latency, no fence yet: %s\n", quiet)
	fmt.Printf("bystanders' request latency, fences striking: %s\n", fencing)
	fmt.Printf("bystanders: %d requests failed (collateral)%s; rdma initiators cut %d times\n", failed, errSuffix(firstErr), cut)
	fmt.Printf("victim: requests %d, completed %d, refused as fenced %d, next-request failures %d%s\n",
		victim.requests, victim.completed, victim.fenced, victim.nextFailed, errSuffix(victim.firstNextErr))
	fmt.Printf("background WRITEs: %.0f MB/s achieved, target %g MB/s\n", mbps, c.rate)
	fmt.Printf("RESULT mode=fence fences=%d not_safe=%d fence_p50_us=%d fence_p99_us=%d idle_abort_p50_us=%d idle_abort_p99_us=%d "+
		"notify_p50_us=%d notify_p99_us=%d ratio_p50=%s ratio_p99=%s bystander_failed=%d bystander_quiet_p50_us=%d bystander_quiet_p99_us=%d "+
		"bystander_fencing_p50_us=%d bystander_fencing_p99_us=%d victim_fenced=%d next_request_failures=%d cut=%d bg_mbps=%.0f seconds=%.2f\n",
		len(fenceLat), notSafe, fenceLat.pct(0.5).Microseconds(), fenceLat.pct(0.99).Microseconds(),
		idleLat.pct(0.5).Microseconds(), idleLat.pct(0.99).Microseconds(),
		notifyLat.pct(0.5).Microseconds(), notifyLat.pct(0.99).Microseconds(),
		ratio(fenceLat.pct(0.5), idleLat.pct(0.5)), ratio(fenceLat.pct(0.99), idleLat.pct(0.99)),
		failed, quiet.pct(0.5).Microseconds(), quiet.pct(0.99).Microseconds(),
		fencing.pct(0.5).Microseconds(), fencing.pct(0.99).Microseconds(),
		victim.fenced, victim.nextFailed, cut, mbps, elapsed.Seconds())

	var fails []error
	if notSafe > 0 {
		fails = append(fails, fmt.Errorf("%d fences not Safe; first: %w", notSafe, firstNotSafe))
	}
	if failed > 0 {
		fails = append(fails, fmt.Errorf("%d bystander requests failed; first: %w", failed, firstErr))
	}
	if victim.nextFailed > 0 {
		fails = append(fails, fmt.Errorf("%d victim requests planned after a fence returned failed; first: %w", victim.nextFailed, victim.firstNextErr))
	}
	if len(fenceLat) == 0 {
		fails = append(fails, errors.New("no fence was measured"))
	}
	return verdict("fence", fails)
}

func errSuffix(err error) string {
	if err == nil {
		return ""
	}
	return fmt.Sprintf(" (first: %v)", err)
}
