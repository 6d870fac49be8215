package engine_test

// Helpers shared by the engine's external tests: engines, segments, patterns,
// assertions with deadlines.

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
)

// newEngine starts a tcp engine with default options (IgnoreEnv) and
// closes it when the test ends.
func newEngine(t *testing.T) *engine.Engine {
	t.Helper()
	e, err := engine.New(engine.Options{IgnoreEnv: true, Protocol: "tcp"})
	if err != nil {
		t.Fatalf("new engine: %v", err)
	}
	t.Cleanup(func() { _ = e.Close() })
	return e
}

// alloc allocates n bytes of registered host memory at e, freed when the
// test ends.
func alloc(t testing.TB, e *engine.Engine, n int) []byte {
	t.Helper()
	b, err := e.AllocBuffer(n, "cpu")
	if err != nil {
		t.Fatalf("alloc: %v", err)
	}
	t.Cleanup(func() { _ = e.FreeBuffer(engine.AddrOf(b)) })
	return b
}

// newEngineWith starts an engine with opts (IgnoreEnv forced) and closes it
// when the test ends. Its transport is tcp unless opts names one: tests
// that state tcp's properties must hold on a machine with RDMA devices
// too, where "auto" would pick rdma.
func newEngineWith(t testing.TB, opts engine.Options) *engine.Engine {
	t.Helper()
	opts.IgnoreEnv = true
	if opts.Protocol == "" {
		opts.Protocol = "tcp"
	}
	e, err := engine.New(opts)
	if err != nil {
		t.Fatalf("new engine: %v", err)
	}
	t.Cleanup(func() { _ = e.Close() })
	return e
}

// testCtx returns a context that ends after d or when the test ends.
func testCtx(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// openSegment opens name on e, failing the test on error.
func openSegment(t *testing.T, e *engine.Engine, name string) *engine.Segment {
	t.Helper()
	seg, err := e.OpenSegment(testCtx(t, 10*time.Second), name)
	if err != nil {
		t.Fatalf("open segment %s: %v", name, err)
	}
	return seg
}

// fillPattern fills b with a deterministic xorshift64* stream derived from
// seed: fast enough for 1 GiB, and no two seeds (or offsets) look alike.
func fillPattern(b []byte, seed uint64) {
	x := seed*0x9E3779B97F4A7C15 ^ 0xD1B54A32D192ED03
	if x == 0 {
		x = 1
	}
	next := func() uint64 {
		x ^= x >> 12
		x ^= x << 25
		x ^= x >> 27
		return x * 0x2545F4914F6CDD1D
	}
	n := len(b) &^ 7
	for i := 0; i < n; i += 8 {
		binary.LittleEndian.PutUint64(b[i:i+8], next())
	}
	if n < len(b) {
		var tail [8]byte
		binary.LittleEndian.PutUint64(tail[:], next())
		copy(b[n:], tail[:])
	}
}

// pattern returns a fresh n-byte slice holding fillPattern(seed).
func pattern(n int, seed uint64) []byte {
	b := make([]byte, n)
	fillPattern(b, seed)
	return b
}

// requireEqual fails the test when got differs from want, naming the first
// differing offset.
func requireEqual(t *testing.T, what string, got, want []byte) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: length %d, want %d", what, len(got), len(want))
	}
	if bytes.Equal(got, want) {
		return
	}
	i := 0
	for i < len(got) && got[i] == want[i] {
		i++
	}
	end := min(i+16, len(got))
	t.Fatalf("%s: first difference at offset %d of %d: got % x, want % x", what, i, len(got), got[i:end], want[i:end])
}

// requireAll fails the test unless every byte of b is v.
func requireAll(t *testing.T, what string, b []byte, v byte) {
	t.Helper()
	want := make([]byte, min(len(b), 64<<10))
	fillByte(want, v)
	for off := 0; off < len(b); off += len(want) {
		chunk := b[off:min(off+len(want), len(b))]
		if bytes.Equal(chunk, want[:len(chunk)]) {
			continue
		}
		for i, c := range chunk {
			if c != v {
				t.Fatalf("%s: byte %d of %d is %#02x, want %#02x", what, off+i, len(b), c, v)
			}
		}
	}
}

// fillByte sets every byte of b to v (by doubling copies: fast under -race).
func fillByte(b []byte, v byte) {
	if len(b) == 0 {
		return
	}
	b[0] = v
	for n := 1; n < len(b); n *= 2 {
		copy(b[n:], b[:n])
	}
}

// within runs fn and panics with every goroutine's stack when it does not
// return within d: a hang is a bug, and letting the test go on would free
// memory the engine may still touch.
func within(t *testing.T, d time.Duration, what string, fn func()) time.Duration {
	t.Helper()
	start := time.Now()
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn()
	}()
	select {
	case <-done:
		return time.Since(start)
	case <-time.After(d):
		buf := make([]byte, 1<<20)
		buf = buf[:runtime.Stack(buf, true)]
		panic(fmt.Sprintf("%s: %s did not return within %v (hang)\n%s", t.Name(), what, d, buf))
	}
}

// write and read build one request.
func write(local []byte, seg *engine.Segment, remote uint64, n int) engine.Request {
	return engine.Request{Op: engine.Write, Local: engine.AddrOf(local), Segment: seg, Remote: remote, Length: uint64(n)}
}

func read(local []byte, seg *engine.Segment, remote uint64, n int) engine.Request {
	return engine.Request{Op: engine.Read, Local: engine.AddrOf(local), Segment: seg, Remote: remote, Length: uint64(n)}
}

// transfer runs reqs synchronously and requires every task COMPLETED.
func transfer(t *testing.T, e *engine.Engine, d time.Duration, reqs ...engine.Request) {
	t.Helper()
	res, err := e.Transfer(testCtx(t, d), reqs)
	if err != nil {
		t.Fatalf("transfer: %v", err)
	}
	for i, r := range res {
		if r.Status != engine.Completed || r.Err != nil || r.Transferred != reqs[i].Length {
			t.Fatalf("task %d: status %v, transferred %d of %d, err %v", i, r.Status, r.Transferred, reqs[i].Length, r.Err)
		}
	}
}

// bigSize is 1 GiB, or 64 MiB in -short mode.
func bigSize() int {
	if testing.Short() {
		return 64 << 20
	}
	return 1 << 30
}
