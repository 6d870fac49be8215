package engine

import (
	"context"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/control"
)

// Helpers of the ABORT handling tests (abortindex_internal_test.go), and
// the benchmark of the handler. This file uses nothing but the handler's
// signature, so the benchmark also runs against older engines.

// until polls cond every millisecond and fails the test when it does not
// hold within d; d only catches a condition that never comes, it is no
// performance bound.
func until(tb testing.TB, d time.Duration, what string, cond func() bool) {
	tb.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			tb.Fatalf("%s: not within %v", what, d)
		}
		time.Sleep(time.Millisecond)
	}
}

// inflightPair starts an owner whose tcp transport holds each WRITE for
// delay before applying it, so that tasks to it stay in flight, and an
// initiator with opts that has the owner open; each has a 1 MiB buffer.
func inflightPair(tb testing.TB, opts Options, delay time.Duration) (owner, init *Engine, seg *Segment, dst, src []byte) {
	tb.Helper()
	opts.Host, opts.IgnoreEnv, opts.Protocol = "127.0.0.1", true, "tcp"
	oo := opts
	oo.Testing.ApplyDelay = delay
	var err error
	if owner, err = New(oo); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = owner.Close() })
	if init, err = New(opts); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = init.Close() })
	if dst, err = owner.AllocBuffer(1<<20, "cpu"); err != nil {
		tb.Fatal(err)
	}
	if src, err = init.AllocBuffer(1<<20, "cpu"); err != nil {
		tb.Fatal(err)
	}
	if seg, err = init.OpenSegment(context.Background(), owner.Name()); err != nil {
		tb.Fatal(err)
	}
	return owner, init, seg, dst, src
}

// submitInFlight submits n WRITEs of 4 KiB of request rid (all over the
// same bytes) in one batch and waits until each is posted.
func submitInFlight(tb testing.TB, e *Engine, seg *Segment, dst, src []byte, rid uint64, n int) *Batch {
	tb.Helper()
	b, err := e.AllocateBatch(n)
	if err != nil {
		tb.Fatal(err)
	}
	reqs := make([]Request, n)
	for i := range reqs {
		off := uint64(i%256) * 4096
		reqs[i] = Request{Op: Write, Local: AddrOf(src) + off, Segment: seg, Remote: AddrOf(dst) + off, Length: 4096, RequestID: rid}
	}
	if err := b.Submit(context.Background(), reqs); err != nil {
		tb.Fatal(err)
	}
	return b
}

// abortFrom hands an ABORT of rid at gen from owner to e's handler, as the
// control plane's loop does.
func abortFrom(e *Engine, owner string, rid uint64, gen uint32) {
	e.handleAbort(owner, control.AbortMsg{RequestID: rid, Generation: gen}.Encode())
}

// BenchmarkAbortHandler measures the initiator's ABORT handler (the work the
// control plane's loop does per ABORT) with no task in flight, then with
// 100,000 tasks of another request in flight, in one run, and reports both
// and their ratio. Run it with -benchtime=10000x for 10,000 ABORTs each.
func BenchmarkAbortHandler(b *testing.B) {
	owner, init, seg, dst, src := inflightPair(b, Options{PathsPerPeer: 1, MaxRetries: -1}, 50*time.Millisecond)
	measure := func(base uint64) time.Duration {
		start := time.Now()
		for i := range b.N {
			abortFrom(init, owner.Name(), base+uint64(i), 1)
		}
		return time.Since(start)
	}
	b.ResetTimer()
	idle := measure(1 << 32)
	b.StopTimer()
	batch := submitInFlight(b, init, seg, dst, src, 1, 100_000)
	b.StartTimer()
	busy := measure(2 << 32)
	b.StopTimer()
	n := float64(b.N)
	b.ReportMetric(float64(idle.Nanoseconds())/n, "ns/abort-idle")
	b.ReportMetric(float64(busy.Nanoseconds())/n, "ns/abort-100k")
	b.ReportMetric(float64(busy)/float64(idle), "ratio")
	if err := batch.Cancel(); err != nil {
		b.Fatal(err)
	}
	_ = batch.Free()
}
