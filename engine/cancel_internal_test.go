package engine

import (
	"context"
	"github.com/kvferry/kvferry/engine/transport"
	"testing"
)

// A Batch.Cancel preempted right after its snapshot, while another goroutine
// frees the batch and a new Submit reuses the records, must not cancel the
// new batch's tasks: the snapshot taints the batch, so Free keeps its
// records out of the pool. (Without the taint the new tasks end CANCELED.)
func TestStaleCancelSnapshotNeverHitsTheNextBatch(t *testing.T) {
	e, err := New(Options{IgnoreEnv: true, Protocol: "tcp"})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	buf, err := e.AllocBuffer(8<<20, "cpu")
	if err != nil {
		t.Fatal(err)
	}
	self, err := e.OpenSegment(context.Background(), e.Name())
	if err != nil {
		t.Fatal(err)
	}
	rs := make([]Request, 4)
	for i := range rs {
		rs[i] = Request{Op: Write, Local: AddrOf(buf) + uint64(i)<<20, Segment: self, Remote: AddrOf(buf) + uint64(4+i)<<20, Length: 1 << 20}
	}
	b1, _ := e.AllocateBatch(4)
	if err := b1.Submit(context.Background(), rs); err != nil {
		t.Fatal(err)
	}
	_ = b1.Wait(context.Background())
	snap, _ := b1.cancelSnapshot() // Batch.cancel, step 1
	if err := b1.Free(); err != nil {
		t.Fatal(err)
	}
	b2, _ := e.AllocateBatch(4)
	if err := b2.Submit(context.Background(), rs); err != nil {
		t.Fatal(err)
	}
	cut := map[*pathRef][]*transport.Slice{}
	for _, tk := range snap { // Batch.cancel, step 2, on the stale snapshot
		tk.cancel(Canceled, cut)
	}
	for ref := range cut {
		ref.ep.Abort(ErrCanceled)
	}
	_ = b2.Wait(context.Background())
	for i, r := range b2.Results() {
		if r.Status != Completed {
			t.Errorf("task %d of the next batch: %s (%v)", i, r.Status, r.Err)
		}
	}
}
