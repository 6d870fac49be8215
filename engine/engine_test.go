package engine_test

import (
	"bytes"
	"context"
	"errors"
	"runtime"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
)

func newEngine(t *testing.T) *engine.Engine {
	t.Helper()
	e, err := engine.New(engine.Options{IgnoreEnv: true, Protocol: "tcp"})
	if err != nil {
		t.Fatalf("new engine: %v", err)
	}
	t.Cleanup(func() { _ = e.Close() })
	return e
}

func alloc(t *testing.T, e *engine.Engine, n int) []byte {
	t.Helper()
	b, err := e.AllocBuffer(n, "cpu")
	if err != nil {
		t.Fatalf("alloc: %v", err)
	}
	t.Cleanup(func() { _ = e.FreeBuffer(engine.AddrOf(b)) })
	return b
}

func TestSmokeWriteRead(t *testing.T) {
	a, b := newEngine(t), newEngine(t)
	src, dst, back := alloc(t, a, 8<<20), alloc(t, b, 8<<20), alloc(t, a, 8<<20)
	for i := range src {
		src[i] = byte(i * 7)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	seg, err := a.OpenSegment(ctx, b.Name())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.Transfer(ctx, []engine.Request{{Op: engine.Write, Local: engine.AddrOf(src), Segment: seg, Remote: engine.AddrOf(dst), Length: uint64(len(src))}}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(src, dst) {
		t.Fatal("write mismatch")
	}
	if _, err := a.Transfer(ctx, []engine.Request{{Op: engine.Read, Local: engine.AddrOf(back), Segment: seg, Remote: engine.AddrOf(dst), Length: uint64(len(src))}}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(src, back) {
		t.Fatal("read mismatch")
	}
}

// An absurd length is refused before anything is allocated for it: a
// request of 2^50 bytes (or 1 TiB) outside any registration is an error
// value, not slice records for every MiB of it (which would end the
// process with "out of memory", which no recover catches).
func TestAbsurdLengthsAreRefusedBeforeAllocating(t *testing.T) {
	owner := newEngineWith(t, engine.Options{})
	init := newEngineWith(t, engine.Options{})
	dst, src := alloc(t, owner, 1<<20), alloc(t, init, 1<<20)
	seg := openSegment(t, init, owner.Name())
	for _, n := range []uint64{1 << 40, 1 << 50} {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		_, err := init.Transfer(testCtx(t, 10*time.Second), []engine.Request{{Op: engine.Write, Local: engine.AddrOf(src), Segment: seg, Remote: engine.AddrOf(dst), Length: n}})
		runtime.ReadMemStats(&after)
		if !errors.Is(err, engine.ErrNotRegistered) && !errors.Is(err, engine.ErrInvalidArg) && !errors.Is(err, engine.ErrOutOfBounds) {
			t.Errorf("a WRITE of %d bytes from a 1 MiB registration: %v; want it refused as not registered", n, err)
		}
		// The old code allocated 168 MiB for 2^40 bytes (and died for 2^50);
		// 16 MiB leaves room for what the engines' own goroutines allocate.
		if grew := after.TotalAlloc - before.TotalAlloc; grew > 16<<20 {
			t.Errorf("refusing a WRITE of %d bytes allocated %d bytes first", n, grew)
		}
	}
}
