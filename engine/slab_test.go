package engine_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
)

// Task and slice records of local batches are reused after Free. Many
// goroutines transferring, canceling and freeing at once must still see
// their own data and states (run it with -race: a record reused while a
// path still touched it is a race).
func TestReusedRecordsKeepConcurrentLocalTransfersApart(t *testing.T) {
	e := newEngine(t)
	const workers, rounds, reqs, size = 4, 150, 64, 256
	buf := alloc(t, e, 2*workers*reqs*size)
	self, err := e.OpenSegment(context.Background(), e.Name())
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			src := buf[w*reqs*size : (w+1)*reqs*size]
			dst := buf[(workers+w)*reqs*size : (workers+w+1)*reqs*size]
			rs := make([]engine.Request, reqs)
			for i := range rs {
				rs[i] = engine.Request{Op: engine.Write, Local: engine.AddrOf(src) + uint64(i*size), Segment: self,
					Remote: engine.AddrOf(dst) + uint64(i*size), Length: size, RequestID: uint64(w)}
			}
			for r := 0; r < rounds; r++ {
				for i := range src {
					src[i] = byte(w*31 + r + i)
				}
				if r%5 == 4 {
					// A batch canceled at once (its tasks may be final
					// already): Cancel keeps its records out of the pool.
					b, err := e.AllocateBatch(reqs)
					if err != nil {
						t.Error(err)
						return
					}
					ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
					if err := b.Submit(ctx, rs); err != nil {
						t.Error(err)
					}
					b.Cancel()
					cancel()
					for i, res := range b.Results() {
						if !res.Status.Final() {
							t.Errorf("worker %d round %d task %d: %s after Cancel", w, r, i, res.Status)
						}
					}
					if err := b.Free(); err != nil {
						t.Error(err)
					}
					continue
				}
				res, err := e.Transfer(context.Background(), rs)
				if err != nil {
					t.Errorf("worker %d round %d: %v", w, r, err)
					return
				}
				for i, x := range res {
					if x.Status != engine.Completed || x.Transferred != size {
						t.Errorf("worker %d round %d task %d: %s, %d bytes", w, r, i, x.Status, x.Transferred)
					}
				}
				for i := range dst {
					if dst[i] != src[i] {
						t.Errorf("worker %d round %d: byte %d is %d, want %d", w, r, i, dst[i], src[i])
						return
					}
				}
			}
		}()
	}
	wg.Wait()
}
