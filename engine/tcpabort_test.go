package engine_test

import (
	"context"
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
	rng := rand.New(rand.NewPCG(3, 4))
	deadline := time.Now().Add(5 * time.Second)
	for n := 0; time.Now().Before(deadline) && (n < 50 || p.owner.Stats().RefusedInFlight < 5); n++ {
		time.Sleep(time.Duration(rng.Int64N(int64(3 * time.Millisecond)))) // aborts at random moments
		rid := current[rng.IntN(workers)].Load()
		if rid == 0 {
			continue
		}
		aborted.Store(rid, true)
		if _, err := p.owner.Abort(testCtx(t, 10*time.Second), rid, []string{p.init.Name()}); err != nil {
			t.Fatalf("abort %d: %v", rid, err)
		}
	}
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
