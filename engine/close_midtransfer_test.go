package engine_test

// Close, Unregister and a target's exit with transfers in flight: the
// transfers end, and no byte touches the released memory afterwards.

import (
	"bytes"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
)

func TestCloseWithBatchInFlightCancelsAndReturns(t *testing.T) {
	const total, blk = 256 << 20, 1 << 20
	a, b := newEngine(t), newEngine(t)
	src, dst := alloc(t, a, total), alloc(t, b, total)
	fillPattern(src, 4)
	seg := openSegment(t, a, b.Name())
	batch, reqs := submitBlocks(t, a, engine.Write, src, seg, engine.AddrOf(dst), blk)
	took := within(t, 10*time.Second, "Close with a batch in flight", func() {
		if err := a.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	})
	t.Logf("Close took %v", took)
	within(t, 5*time.Second, "Wait after Close", func() {
		if err := batch.Wait(testCtx(t, 5*time.Second)); err != nil {
			t.Errorf("wait after close: %v", err)
		}
	})
	counts := map[engine.TaskStatus]int{}
	for i, r := range batch.Results() {
		counts[r.Status]++
		switch r.Status {
		case engine.Completed:
			requireEqual(t, fmt.Sprintf("completed block %d", i), dst[i*blk:(i+1)*blk], src[i*blk:(i+1)*blk])
		case engine.Canceled:
			if !errors.Is(r.Err, engine.ErrCanceled) {
				t.Errorf("canceled task %d: err %v, want ErrCanceled", i, r.Err)
			}
		default:
			t.Errorf("task %d: status %v (%v), want CANCELED or COMPLETED", i, r.Status, r.Err)
		}
	}
	t.Logf("after Close: %v", counts)
	if st := a.Stats(); st.TasksInFlight != 0 {
		t.Errorf("%d tasks in flight after Close", st.TasksInFlight)
	}
	if err := batch.Free(); err != nil {
		t.Errorf("free after close: %v", err)
	}
	// The closed engine refuses new work clearly.
	if _, err := a.Transfer(testCtx(t, time.Second), reqs[:1]); !errors.Is(err, engine.ErrClosed) {
		t.Errorf("transfer after close: %v, want ErrClosed", err)
	}
	if _, err := a.AllocateBatch(1); !errors.Is(err, engine.ErrClosed) {
		t.Errorf("allocate batch after close: %v, want ErrClosed", err)
	}
	if _, err := a.OpenSegment(testCtx(t, time.Second), b.Name()); !errors.Is(err, engine.ErrClosed) {
		t.Errorf("open segment after close: %v, want ErrClosed", err)
	}
}

func TestCloseDuringSynchronousTransferEndsItCanceled(t *testing.T) {
	const total = 256 << 20
	a, b := newEngine(t), newEngine(t)
	src, dst := alloc(t, a, total), alloc(t, b, total)
	seg := openSegment(t, a, b.Name())
	type outcome struct {
		res []engine.TaskResult
		err error
	}
	done := make(chan outcome, 1)
	ctx := testCtx(t, time.Minute)
	go func() {
		res, err := a.Transfer(ctx, []engine.Request{write(src, seg, engine.AddrOf(dst), total)})
		done <- outcome{res, err}
	}()
	waitFor(t, 10*time.Second, "the transfer to start", func() bool {
		return a.Stats().TasksInFlight > 0 || a.Stats().TasksCompleted > 0
	})
	within(t, 10*time.Second, "Close during a Transfer", func() { _ = a.Close() })
	var o outcome
	within(t, 5*time.Second, "Transfer after Close", func() { o = <-done })
	t.Logf("transfer: %v", o.err)
	if len(o.res) != 1 {
		t.Fatalf("results %+v, err %v", o.res, o.err)
	}
	switch o.res[0].Status {
	case engine.Completed:
		t.Log("transfer completed before Close")
	case engine.Canceled:
		if !errors.Is(o.err, engine.ErrCanceled) {
			t.Errorf("err %v, want ErrCanceled", o.err)
		}
	default:
		t.Errorf("status %v (%v), want CANCELED", o.res[0].Status, o.err)
	}
}

func TestClosingTheTargetMidTransferFailsInitiatorTasks(t *testing.T) {
	const total, blk = 256 << 20, 1 << 20
	for _, op := range []engine.Op{engine.Write, engine.Read} {
		t.Run(op.String(), func(t *testing.T) {
			a, b := newEngine(t), newEngine(t)
			local, remote := alloc(t, a, total), alloc(t, b, total)
			seg := openSegment(t, a, b.Name())
			batch, reqs := submitBlocks(t, a, op, local, seg, engine.AddrOf(remote), blk)
			closeTook := within(t, 10*time.Second, "target Close", func() { _ = b.Close() })
			t.Logf("target Close took %v", closeTook)
			took := within(t, 20*time.Second, "initiator Wait after the target closed", func() {
				if err := batch.Wait(testCtx(t, 20*time.Second)); err != nil {
					t.Errorf("wait: %v", err)
				}
			})
			counts := map[engine.TaskStatus]int{}
			for i, r := range batch.Results() {
				counts[r.Status]++
				switch r.Status {
				case engine.Completed:
				case engine.Failed:
					if !errors.Is(r.Err, engine.ErrTransferFailed) {
						t.Errorf("failed task %d: err %v, want ErrTransferFailed", i, r.Err)
					}
				default:
					t.Errorf("task %d: status %v (%v), want FAILED or COMPLETED", i, r.Status, r.Err)
				}
			}
			t.Logf("initiator tasks ended %v within %v of the target's Close", counts, took)
			// A new transfer to the closed target fails too, by its deadline.
			took = within(t, 10*time.Second, "transfer to a closed target", func() {
				res, err := a.Transfer(testCtx(t, 3*time.Second), reqs[:1])
				if err == nil {
					t.Errorf("transfer to a closed target succeeded: %+v", res)
				}
				t.Logf("transfer to the closed target: %v", err)
			})
			if took > 5*time.Second {
				t.Errorf("transfer to a closed target with a 3s deadline took %v", took)
			}
		})
	}
}

// Unregister and Close mid-transfer: once they return, no further byte of
// the transfer touches their memory (SAFETY.md promise 1 for UnregisterMemory
// and Close, promise 3 for the initiator's own memory).

func TestUnregisterOrCloseMidTransferStopsEveryLaterByte(t *testing.T) {
	const marker = 0x77
	size, progress := 128<<20, uint64(8<<20)
	if testing.Short() {
		size, progress = 32<<20, 2<<20
	}
	type actor int
	const (
		owner actor = iota
		initiator
	)
	cases := []struct {
		who   actor
		close bool // Close the engine instead of unregistering the buffer
		self  bool // transfer within one engine (local transport)
	}{
		{owner, false, false}, {owner, true, false}, {initiator, false, false}, {initiator, true, false},
		{owner, false, true}, {initiator, false, true},
	}
	for _, op := range []engine.Op{engine.Write, engine.Read} {
		for _, tc := range cases {
			name := map[actor]string{owner: "owner", initiator: "initiator"}[tc.who]
			name += map[bool]string{false: " unregisters", true: " closes"}[tc.close]
			name += map[bool]string{false: "", true: " (same engine)"}[tc.self]
			t.Run(op.String()+"/"+name, func(t *testing.T) {
				a := newEngine(t)
				b := a
				if !tc.self {
					b = newEngine(t)
				}
				local, remote := alloc(t, a, size), alloc(t, b, size)
				src, dst := local, remote // the data's source and destination
				if op == engine.Read {
					src, dst = remote, local
				}
				fillPattern(src, 30)
				seg := openSegment(t, a, b.Name())
				batch, err := a.AllocateBatch(1)
				if err != nil {
					t.Fatal(err)
				}
				if err := batch.Submit(testCtx(t, time.Minute), []engine.Request{
					{Op: op, Local: engine.AddrOf(local), Segment: seg, Remote: engine.AddrOf(remote), Length: uint64(size)}}); err != nil {
					t.Fatal(err)
				}
				for end := time.Now().Add(10 * time.Second); time.Now().Before(end); time.Sleep(50 * time.Microsecond) {
					if r, _ := batch.Status(0); r.Transferred >= progress || r.Status.Final() {
						break
					}
				}
				actedOn, actorEngine := remote, b
				if tc.who == initiator {
					actedOn, actorEngine = local, a
				}
				took := within(t, 10*time.Second, name, func() {
					var err error
					if tc.close {
						err = actorEngine.Close()
					} else {
						err = actorEngine.UnregisterMemory(engine.AddrOf(actedOn))
					}
					if err != nil {
						t.Errorf("%s: %v", name, err)
					}
				})
				// The range may be reused at once.
				fillByte(actedOn, marker)
				r, _ := batch.Status(0)
				t.Logf("%s took %v, with %d of %d bytes confirmed", name, took, r.Transferred, size)
				within(t, 30*time.Second, "Wait", func() {
					if err := batch.Wait(testCtx(t, 30*time.Second)); err != nil {
						t.Errorf("wait: %v", err)
					}
				})
				r, _ = batch.Status(0)
				t.Logf("task: %v, %d bytes, %v", r.Status, r.Transferred, r.Err)
				switch r.Status {
				case engine.Completed:
					t.Log("the transfer completed before the action")
				case engine.Failed, engine.Canceled:
				default:
					t.Errorf("task ended %v (%v)", r.Status, r.Err)
				}
				if &actedOn[0] == &dst[0] {
					// Nothing may land in the destination after the action.
					requireAll(t, "destination after "+name, dst, marker)
					return
				}
				// The source changed after the action: the destination holds
				// the old source or what it held before (zeros), never marker.
				want := pattern(size, 30)
				const chunk = 4 << 10
				for off := 0; off < size; off += chunk {
					d, w := dst[off:off+chunk], want[off:off+chunk]
					if bytes.Equal(d, w) {
						continue
					}
					if r.Status == engine.Completed {
						requireEqual(t, "destination of a completed transfer", dst, want)
					}
					for i, c := range d {
						if c != w[i] && c != 0 {
							t.Fatalf("destination byte %d is %#02x: neither the source's %#02x nor 0 (marker %#02x): the source was read after %s returned",
								off+i, c, w[i], marker, name)
						}
					}
				}
			})
		}
	}
}

// submitBlocks has e submit, in one batch, one request of op per blk bytes
// of local, each to the same offset from remote in seg; it returns the
// batch and the requests.
func submitBlocks(t *testing.T, e *engine.Engine, op engine.Op, local []byte, seg *engine.Segment, remote uint64, blk int) (*engine.Batch, []engine.Request) {
	t.Helper()
	reqs := make([]engine.Request, len(local)/blk)
	for i := range reqs {
		reqs[i] = engine.Request{Op: op, Local: engine.AddrOf(local) + uint64(i*blk), Segment: seg,
			Remote: remote + uint64(i*blk), Length: uint64(blk)}
	}
	batch, err := e.AllocateBatch(len(reqs))
	if err != nil {
		t.Fatal(err)
	}
	if err := batch.Submit(testCtx(t, time.Minute), reqs); err != nil {
		t.Fatal(err)
	}
	return batch, reqs
}
