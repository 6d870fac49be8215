package netfault

import (
	"context"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
)

// TestDeadlineHoldsWhileAnAbortDrains: while a WRITE is under way, every
// packet of the target's data plane is dropped (its control plane still
// works); the target aborts the request, and the initiator hears the ABORT
// and drains the request: it waits for the slices on the wire, which can
// now end only by being cut, up to AbortDrainTimeout (5 s). The
// initiator's calls must still keep their own bounds (SAFETY.md promise
// 3): Transfer returns by its 1 s deadline + deadlineSlack, and
// Batch.Cancel within deadlineSlack. The drain that goes on afterwards is
// the engine's business, not the caller's.
func TestDeadlineHoldsWhileAnAbortDrains(t *testing.T) {
	requireSuite(t)
	for _, call := range []string{"Transfer", "Batch.Cancel"} {
		t.Run(call, func(t *testing.T) { testDeadlineWhileDraining(t, call) })
	}
}

func testDeadlineWhileDraining(t *testing.T, call string) {
	f := useFaults(t)
	const (
		size     = 8 << 20
		rid      = 7
		deadline = time.Second
		hole     = 8 * time.Second // longest wait: past AbortDrainTimeout
	)
	// The target pauses 20 ms after admitting each frame: the WRITE's 64
	// slices take a while, and some are on the wire when the ABORT comes.
	tp := startPeer(t, peerConfig{size: size, applyDelay: 20 * time.Millisecond})
	e := newEngine(t, engine.Options{SliceSize: 128 << 10})
	local := alloc(t, e, size)
	seg := openSegment(t, e, tp.name)
	transfer(t, e, 30*time.Second, req(engine.Read, local, seg, tp.addr)) // every path dialed

	b, err := e.AllocateBatch(1)
	if err != nil {
		t.Fatal(err)
	}
	r := req(engine.Write, local, seg, tp.addr)
	r.RequestID = rid
	ctx, cancel := context.WithTimeout(context.Background(), deadline)
	defer cancel()
	start := time.Now()
	type outcome struct {
		res  []engine.TaskResult
		err  error
		took time.Duration
	}
	done := make(chan outcome, 1)
	if call == "Transfer" {
		go func() {
			res, err := e.Transfer(ctx, []engine.Request{r})
			done <- outcome{res, err, time.Since(start)}
		}()
	} else if err := b.Submit(ctx, []engine.Request{r}); err != nil {
		t.Fatal(err)
	}
	if !waitFor(10*time.Second, func() bool { return tp.stats()["owner_in"] > 0 }) {
		t.Fatal("no byte of the WRITE landed within 10s")
	}
	f.drop([]int{portOf(t, tp.data)}, 100)
	defer f.clear()
	ar, err := tp.abort(rid, 2*time.Second, e.Name(), 0, 8, 1)
	if err != nil || !ar.safe {
		t.Fatalf("the target's abort: %+v, %v", ar, err)
	}
	if !waitFor(5*time.Second, func() bool { return e.Stats().AbortsReceived > 0 }) {
		t.Fatal("the initiator did not hear the ABORT within 5s")
	}
	heard := time.Since(start)

	bound, took := deadline+deadlineSlack, time.Duration(0)
	var o outcome
	if call == "Transfer" {
		select {
		case o = <-done:
		case <-time.After(hole):
			f.clear()
			o = <-done
			t.Logf("(Transfer returned only once the data plane was back)")
		}
		took = o.took
	} else {
		_ = b.Wait(ctx)
		began := time.Now()
		cdone := make(chan error, 1)
		go func() { cdone <- b.Cancel() }()
		select {
		case o.err = <-cdone:
		case <-time.After(hole):
			f.clear()
			o.err = <-cdone
			t.Logf("(Batch.Cancel returned only once the data plane was back)")
		}
		bound, took = deadlineSlack, time.Since(began)
		o.res = b.Results()
		_ = b.Free()
	}
	t.Logf("data plane blackholed, ABORT heard %v after the start; %s took %v (bound %v): %s %v",
		heard.Round(time.Millisecond), call, took.Round(time.Millisecond), bound, summarize(o.res), o.err)
	if took > bound {
		t.Errorf("%s took %v, %v past its bound: it waited for the abort's drain (AbortDrainTimeout) instead of cutting the request's slices itself",
			call, took.Round(time.Millisecond), (took - bound).Round(time.Millisecond))
	}
}
