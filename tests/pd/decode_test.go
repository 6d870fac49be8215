package pd

import (
	"context"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/internal/childproc"
)

// Decode's side of the rows: its engine, and the leak checks it takes
// against a baseline.

// newDecode makes decode's engine with opts. closeDecode closes it once,
// returning Close's error: a row calls it where nothing may land
// afterwards and checks the error; if the row does not, the engine is
// closed when the test ends.
func newDecode(t *testing.T, opts engine.Options) (d *engine.Engine, closeDecode func() error) {
	t.Helper()
	d, err := engine.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	closeDecode = func() error {
		once.Do(func() { err = d.Close() })
		return err
	}
	t.Cleanup(func() { _ = closeDecode() })
	return d, closeDecode
}

// allocDecode allocates size bytes of d's registered memory. freeMem frees
// it once, returning FreeBuffer's error: a row calls it after closing d
// and checks the error; if the row does not, the memory is freed when the
// test ends.
func allocDecode(t *testing.T, d *engine.Engine, size int) (mem []byte, freeMem func() error) {
	t.Helper()
	mem, err := d.AllocBuffer(size, "cpu")
	if err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	freeMem = func() error {
		once.Do(func() { err = d.FreeBuffer(engine.AddrOf(mem)) })
		return err
	}
	t.Cleanup(func() { _ = freeMem() })
	return mem, freeMem
}

// abortTimed has decode abort request rid, naming initiator, with
// deadline, and returns Abort's result, how long the call took, and its
// error.
func abortTimed(d *engine.Engine, rid uint64, initiator string, deadline time.Duration) (engine.AbortResult, time.Duration, error) {
	ctx, cancel := context.WithTimeout(context.Background(), deadline)
	defer cancel()
	called := time.Now()
	ar, err := d.Abort(ctx, rid, []string{initiator})
	return ar, time.Since(called), err
}

// leakBaseline warms up an engine of opts and returns this process's
// goroutines and open file descriptors (counted and named): a leak
// check's baseline, taken before anything of a run exists.
func leakBaseline(t *testing.T, opts engine.Options) (g0, f0 int, fds []string) {
	t.Helper()
	if err := warmUp(opts); err != nil {
		t.Fatal(err)
	}
	g0 = runtime.NumGoroutine()
	f0, fds, err := processFDs()
	if err != nil {
		t.Fatal(err)
	}
	return g0, f0, fds
}

// checkLeaks fails the test if decode's goroutines or file descriptors
// have not come back to the baseline within 3 s.
func checkLeaks(t *testing.T, g0, f0 int) {
	t.Helper()
	if g, f := settled(g0, f0, 3*time.Second); g > g0 || f > f0 {
		t.Errorf("decode leaked: goroutines %d -> %d, file descriptors %d -> %d", g0, g, f0, f)
	}
}

// waitUntil polls cond every interval until it holds or d has passed,
// and reports whether it held: the rows wait on conditions, not on time.
func waitUntil(d, interval time.Duration, cond func() bool) bool {
	return childproc.Poll(d, interval, cond)
}
