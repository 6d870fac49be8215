package engine_test

// READs of several requests sharing one tcp path, answered by the owner in
// gathered writes, while the owner aborts some of them at random: the
// aborts spare the bystanders and touch no buffer but the aborted READ's.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
)

// READs of several requests share one path, and the owner answers them in
// gathered writes; the owner aborts some of the requests at random while
// they are read. Every aborted request ends ABORTED or COMPLETED and every
// other one COMPLETED, with retries off: an abort never tears the shared
// connection under the bystanders, nor fails the aborted READs as broken
// connections.
func TestRandomAbortsOfReadsSpareBystanders(t *testing.T) {
	const size, block, workers = 32 << 20, 4 << 20, 4
	p := newAbortPair(t, engine.Options{PathsPerPeer: 1, MaxRetries: -1}, size)
	var next atomic.Uint64
	var current [workers]atomic.Uint64
	var aborted sync.Map
	type outcome struct {
		rid uint64
		res engine.TaskResult
	}
	var mu sync.Mutex
	var outcomes []outcome
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			off := uint64(w * size / workers)
			for {
				select {
				case <-stop:
					return
				default:
				}
				rid := next.Add(1)
				current[w].Store(rid)
				req := engine.Request{Op: engine.Read, Local: engine.AddrOf(p.src) + off, Segment: p.seg,
					Remote: engine.AddrOf(p.dst) + off, Length: block, RequestID: rid}
				res, _ := p.init.Transfer(context.Background(), []engine.Request{req})
				mu.Lock()
				outcomes = append(outcomes, outcome{rid, res[0]})
				mu.Unlock()
			}
		}()
	}
	abortReadsAtRandom(t, p, 3, 3*time.Millisecond, 50, 5*time.Second, &aborted, func(rng *rand.Rand) uint64 {
		return current[rng.IntN(workers)].Load()
	})
	close(stop)
	within(t, time.Minute, "the readers", wg.Wait)
	counts := map[engine.TaskStatus]int{}
	for _, o := range outcomes {
		counts[o.res.Status]++
		_, wasAborted := aborted.Load(o.rid)
		switch {
		case o.res.Status == engine.Aborted && !wasAborted:
			t.Errorf("request %d ended ABORTED without being aborted: %v", o.rid, o.res.Err)
		case o.res.Status != engine.Completed && o.res.Status != engine.Aborted:
			t.Errorf("request %d (aborted: %v) ended %v: %v", o.rid, wasAborted, o.res.Status, o.res.Err)
		}
	}
	st := p.owner.Stats()
	t.Logf("%d requests: %v; owner refusals mid-write %d", len(outcomes), counts, st.RefusedInFlight)
	if st.RefusedInFlight == 0 {
		t.Fatal("no abort struck while a READ was being sent: the test proved nothing")
	}
}

// READs of many requests share one path, so the owner answers several in
// one gathered write, and the owner aborts requests at random while they
// are read. Checked on the bytes, not only the statuses: every COMPLETED
// READ holds the owner's bytes exactly (no zeros of an aborted neighbour
// in it); an ABORTED one holds only the owner's bytes, the zeros standing
// in for the refused rest, or what it held before; the gaps between the
// READs' buffers are never written; and no buffer changes after its
// Transfer returned (every slot's content at the end is what it held when
// its last Transfer returned).
func TestAbortedGatheredReadsTouchOnlyTheirOwnBuffers(t *testing.T) {
	const (
		block   = 192 << 10 // several READs per gathered write (4 MiB)
		gap     = 4 << 10   // never written
		perTx   = 4         // requests per Transfer, each its own request id
		workers = 4
		slots   = 8 // per worker, used in turn
		stride  = block + gap
		region  = perTx * slots * stride
		size    = workers * region
	)
	p := newAbortPair(t, engine.Options{PathsPerPeer: 1, MaxRetries: -1}, size)
	fillPattern(p.dst, 11)
	for i, b := range p.dst {
		if b == 0 || b == 0xcc || b == 0xdd {
			p.dst[i] = 0x5a // the owner's bytes never look like zeros or the markers
		}
	}
	for i := range p.src {
		p.src[i] = 0xdd // gaps, and slots never used
	}
	var next atomic.Uint64
	var current [workers * perTx]atomic.Uint64
	// last[w][slot][k]: the bytes slot k of worker w held when its Transfer returned.
	last := make([][][][]byte, workers)
	var aborted sync.Map
	var mu sync.Mutex
	var errs []string
	fail := func(f string, args ...any) {
		mu.Lock()
		if len(errs) < 20 {
			errs = append(errs, fmt.Sprintf(f, args...))
		}
		mu.Unlock()
	}
	counts := map[engine.TaskStatus]int{}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range workers {
		last[w] = make([][][]byte, slots)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for round := 0; ; round++ {
				select {
				case <-stop:
					return
				default:
				}
				slot := round % slots
				reqs := make([]engine.Request, perTx)
				offs := make([]int, perTx)
				for k := range perTx {
					off := w*region + (slot*perTx+k)*stride
					offs[k] = off
					for i := off; i < off+block; i++ {
						p.src[i] = 0xcc // what the buffer held before
					}
					rid := next.Add(1)
					current[w*perTx+k].Store(rid)
					reqs[k] = engine.Request{Op: engine.Read, Local: engine.AddrOf(p.src) + uint64(off), Segment: p.seg,
						Remote: engine.AddrOf(p.dst) + uint64(off), Length: block, RequestID: rid}
				}
				res, err := p.init.Transfer(context.Background(), reqs)
				if len(res) != perTx {
					fail("transfer: %v", err)
					return
				}
				snap := make([][]byte, perTx)
				for k, r := range res {
					off := offs[k]
					got, want := p.src[off:off+block], p.dst[off:off+block]
					snap[k] = append([]byte(nil), got...)
					_, wasAborted := aborted.Load(reqs[k].RequestID)
					mu.Lock()
					counts[r.Status]++
					mu.Unlock()
					switch r.Status {
					case engine.Completed:
						for i := range got {
							if got[i] != want[i] {
								fail("request %d COMPLETED (aborted: %v) but byte %d is %#x, the owner's %#x", reqs[k].RequestID, wasAborted, i, got[i], want[i])
								break
							}
						}
					case engine.Aborted:
						if !wasAborted {
							fail("request %d ended ABORTED without being aborted: %v", reqs[k].RequestID, r.Err)
						}
						for i := range got {
							if got[i] != want[i] && got[i] != 0 && got[i] != 0xcc {
								fail("request %d ABORTED: byte %d is %#x, neither the owner's %#x, zero nor what it held", reqs[k].RequestID, i, got[i], want[i])
								break
							}
						}
					default:
						fail("request %d (aborted: %v) ended %v: %v", reqs[k].RequestID, wasAborted, r.Status, r.Err)
					}
				}
				last[w][slot] = snap
			}
		}()
	}
	// Under -race aborts strike mid-write less often: up to 30 s.
	abortReadsAtRandom(t, p, 5, 2*time.Millisecond, 200, 30*time.Second, &aborted, func(rng *rand.Rand) uint64 {
		return current[rng.IntN(len(current))].Load()
	})
	close(stop)
	within(t, time.Minute, "the readers", wg.Wait)
	// Whatever is still on its way lands by now: every path drained.
	if !waitUntil(10*time.Second, func() bool { return p.init.Stats().TasksInFlight == 0 }) {
		t.Fatalf("tasks still in flight: %+v", p.init.Stats())
	}
	for w := range workers {
		for slot := range slots {
			for k, snap := range last[w][slot] {
				off := w*region + (slot*perTx+k)*stride
				if got := p.src[off : off+block]; string(got) != string(snap) {
					fail("worker %d slot %d request %d: its buffer changed after its Transfer returned", w, slot, k)
				}
			}
		}
	}
	for off := 0; off < size; off += stride {
		for i := off + block; i < off+stride; i++ {
			if p.src[i] != 0xdd {
				fail("gap byte at %d written: %#x", i, p.src[i])
				break
			}
		}
	}
	st := p.owner.Stats()
	t.Logf("outcomes %v; owner refusals mid-write %d", counts, st.RefusedInFlight)
	for _, e := range errs {
		t.Error(e)
	}
	if st.RefusedInFlight == 0 {
		t.Fatal("no abort struck while a READ was being sent: the test proved nothing")
	}
}

// abortReadsAtRandom has the owner abort, at random moments, the request a
// reader is on (pick returns it, 0 when none), and records each in aborted;
// it stops once d passed, or once it sent minAborts and at least 5 struck a
// READ being sent.
func abortReadsAtRandom(t *testing.T, p *abortPair, seed uint64, maxGap time.Duration, minAborts int, d time.Duration, aborted *sync.Map, pick func(*rand.Rand) uint64) {
	t.Helper()
	rng := rand.New(rand.NewPCG(seed, seed+1))
	deadline := time.Now().Add(d)
	for n := 0; time.Now().Before(deadline) && (n < minAborts || p.owner.Stats().RefusedInFlight < 5); n++ {
		// Pacing, not a synchronization: the aborts strike at random moments
		// of the READs, which run on their own meanwhile.
		time.Sleep(time.Duration(rng.Int64N(int64(maxGap))))
		rid := pick(rng)
		if rid == 0 {
			continue
		}
		aborted.Store(rid, true)
		if _, err := p.owner.Abort(testCtx(t, 10*time.Second), rid, []string{p.init.Name()}); err != nil {
			t.Fatalf("abort %d: %v", rid, err)
		}
	}
}
