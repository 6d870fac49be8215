package engine_test

// Transfers between two engines in one process: 8 MiB and a GiB each way, a
// batch of ten thousand requests, data intact.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
)

func TestTwoEnginesInOneProcessMoveOneGiBBothWays(t *testing.T) {
	size := bigSize()
	a, b := newEngine(t), newEngine(t)
	aSrc, aBack := alloc(t, a, size), alloc(t, a, size)
	bBuf := alloc(t, b, size)
	fillPattern(aSrc, 1)
	segB := openSegment(t, a, b.Name())
	segA := openSegment(t, b, a.Name())
	const d = 2 * time.Minute

	// step has e move req, then checks that got holds want.
	step := func(what string, e *engine.Engine, req engine.Request, got, want []byte) {
		t.Helper()
		start := time.Now()
		transfer(t, e, d, req)
		t.Logf("%s %d MiB: %v", what, size>>20, time.Since(start))
		requireEqual(t, what, got, want)
	}
	step("a WRITEs into b", a, write(aSrc, segB, engine.AddrOf(bBuf), size), bBuf, aSrc)
	step("a READs it back from b", a, read(aBack, segB, engine.AddrOf(bBuf), size), aBack, aSrc)
	fillPattern(bBuf, 2)
	step("b WRITEs a new pattern into a", b, write(bBuf, segA, engine.AddrOf(aBack), size), aBack, bBuf)
	step("b READs a's first buffer", b, read(bBuf, segA, engine.AddrOf(aSrc), size), bBuf, aSrc)

	if st := a.Stats(); st.BytesWritten != uint64(size) || st.BytesRead != uint64(size) || st.TasksInFlight != 0 {
		t.Errorf("a's stats: %+v", st)
	}
}

func TestBatchOfTenThousandRequestsCompletesWithDataIntact(t *testing.T) {
	const n, blk = 10000, 4 << 10
	for _, tc := range []struct {
		name string
		self bool
	}{{"to a peer", false}, {"to the engine itself", true}} {
		t.Run(tc.name, func(t *testing.T) {
			a := newEngine(t)
			owner := a
			if !tc.self {
				owner = newEngine(t)
			}
			src, back := alloc(t, a, n*blk), alloc(t, a, n*blk)
			dst := alloc(t, owner, n*blk)
			fillPattern(src, 3)
			seg := openSegment(t, a, owner.Name())
			rng := rand.New(rand.NewPCG(1, 2))
			perm := rng.Perm(n) // local block i goes to remote block perm[i]

			run := func(op engine.Op, local []byte) {
				t.Helper()
				b, err := a.AllocateBatch(n)
				if err != nil {
					t.Fatal(err)
				}
				reqs := make([]engine.Request, n)
				for i := range reqs {
					reqs[i] = engine.Request{
						Op: op, Local: engine.AddrOf(local) + uint64(i*blk), Segment: seg,
						Remote: engine.AddrOf(dst) + uint64(perm[i]*blk), Length: blk, RequestID: uint64(i + 1),
					}
				}
				ctx := testCtx(t, time.Minute)
				if err := b.Submit(ctx, reqs); err != nil {
					t.Fatalf("submit %v: %v", op, err)
				}
				if err := b.Wait(ctx); err != nil {
					t.Fatalf("wait %v: %v", op, err)
				}
				if b.Len() != n {
					t.Fatalf("batch holds %d tasks, want %d", b.Len(), n)
				}
				res := b.Results()
				if len(res) != n {
					t.Fatalf("%d results, want %d", len(res), n)
				}
				for i, r := range res {
					if r.Status != engine.Completed || r.Err != nil || r.Transferred != blk {
						t.Fatalf("%v task %d: status %v, transferred %d, err %v", op, i, r.Status, r.Transferred, r.Err)
					}
				}
				if r, err := b.Status(n - 1); err != nil || r.Status != engine.Completed {
					t.Fatalf("Status(%d) = %+v, %v", n-1, r, err)
				}
				if _, err := b.Status(n); !errors.Is(err, engine.ErrInvalidArg) {
					t.Fatalf("Status(%d) past the end: %v, want ErrInvalidArg", n, err)
				}
				if err := b.Free(); err != nil {
					t.Fatalf("free: %v", err)
				}
			}

			run(engine.Write, src)
			for i := 0; i < n; i++ {
				requireEqual(t, fmt.Sprintf("remote block %d (from local block %d)", perm[i], i),
					dst[perm[i]*blk:(perm[i]+1)*blk], src[i*blk:(i+1)*blk])
			}
			run(engine.Read, back)
			requireEqual(t, "blocks read back", back, src)
			if st := a.Stats(); st.TasksCompleted != 2*n || st.TasksInFlight != 0 {
				t.Errorf("stats after two batches: completed %d, in flight %d", st.TasksCompleted, st.TasksInFlight)
			}
		})
	}
}

// Two engines move 8 MiB each way over tcp.
func TestSmokeWriteRead(t *testing.T) {
	a, b := newEngine(t), newEngine(t)
	src, dst, back := alloc(t, a, 8<<20), alloc(t, b, 8<<20), alloc(t, a, 8<<20)
	fillPattern(src, 7)
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
