package netfault

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/internal/childproc"
)

// The test process's own engine, and the checks on what it does.

// newEngine makes an engine for the test, closed when it ends; its events
// are taken as an application would.
func newEngine(t *testing.T, o engine.Options) *engine.Engine {
	t.Helper()
	o.IgnoreEnv, o.Protocol = true, "tcp"
	e, err := engine.New(o)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range e.Events() {
		}
	}()
	t.Cleanup(func() {
		_ = e.Close()
		<-done
	})
	return e
}

// alloc allocates registered memory of e, freed when the test ends.
func alloc(t *testing.T, e *engine.Engine, size int) []byte {
	t.Helper()
	b, err := e.AllocBuffer(size, "cpu")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.FreeBuffer(engine.AddrOf(b)) })
	return b
}

func openSegment(t *testing.T, e *engine.Engine, name string) *engine.Segment {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := e.OpenSegment(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// transfer runs reqs within d and fails the test unless all completed.
func transfer(t *testing.T, e *engine.Engine, d time.Duration, reqs ...engine.Request) time.Duration {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	start := time.Now()
	res, err := e.Transfer(ctx, reqs)
	took := time.Since(start)
	if err != nil {
		t.Fatalf("transfer of %d requests: %v after %v (%s)", len(reqs), err, took, summarize(res))
	}
	return took
}

// summarize counts results by status.
func summarize(res []engine.TaskResult) string {
	n := map[string]int{}
	for _, r := range res {
		n[r.Status.String()]++
	}
	return fmt.Sprint(n)
}

func req(op engine.Op, local []byte, seg *engine.Segment, remote uint64) engine.Request {
	return engine.Request{Op: op, Local: engine.AddrOf(local), Segment: seg, Remote: remote, Length: uint64(len(local))}
}

// waitFor polls cond until it holds or d passed, and reports whether it
// held.
func waitFor(d time.Duration, cond func() bool) bool {
	return childproc.Poll(d, 2*time.Millisecond, cond)
}
