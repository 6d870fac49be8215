package engine_test

import (
	"bytes"
	"context"
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
