package engine_test

import (
	"errors"
	"syscall"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
)

// Two engines in two processes: the test process and a target process
// (startTarget), moving data and losing the peer mid-transfer.

func TestTwoProcessesMoveOneGiBBothWays(t *testing.T) {
	size := bigSize()
	tp := startTarget(t, targetConfig{size: size, seed: 7})
	a := newEngine(t)
	want, back := alloc(t, a, size), alloc(t, a, size)
	seg := openSegment(t, a, tp.name)
	const d = 2 * time.Minute

	// READ the target's own pattern.
	fillPattern(want, 7)
	start := time.Now()
	transfer(t, a, d, read(back, seg, tp.addr, size))
	t.Logf("READ %d MiB from the target process: %v", size>>20, time.Since(start))
	requireEqual(t, "the target's pattern, read", back, want)

	// WRITE a new pattern, READ it back.
	fillPattern(want, 8)
	start = time.Now()
	transfer(t, a, d, write(want, seg, tp.addr, size))
	t.Logf("WRITE %d MiB into the target process: %v", size>>20, time.Since(start))
	start = time.Now()
	transfer(t, a, d, read(back, seg, tp.addr, size))
	t.Logf("READ %d MiB back: %v", size>>20, time.Since(start))
	requireEqual(t, "our pattern, written and read back", back, want)
}

func TestPeerProcessKilledMidTransferFailsTransfersInsteadOfHanging(t *testing.T) {
	size, progress := 1<<30, uint64(32<<20)
	if testing.Short() {
		size, progress = 256<<20, 16<<20
	}
	for _, op := range []engine.Op{engine.Write, engine.Read} {
		t.Run(op.String(), func(t *testing.T) {
			tp := startTarget(t, targetConfig{size: size, seed: 9, progress: progress})
			a := newEngine(t)
			local := alloc(t, a, size)
			fillPattern(local, 10)
			seg := openSegment(t, a, tp.name)
			type outcome struct {
				res []engine.TaskResult
				err error
				at  time.Duration
			}
			done := make(chan outcome, 1)
			ctx := testCtx(t, 5*time.Minute)
			req := engine.Request{Op: op, Local: engine.AddrOf(local), Segment: seg, Remote: tp.addr, Length: uint64(size)}
			start := time.Now()
			go func() {
				res, err := a.Transfer(ctx, []engine.Request{req})
				done <- outcome{res, err, time.Since(start)}
			}()
			select {
			case l := <-tp.lines:
				t.Logf("target: %q after %v; killing it", l, time.Since(start))
			case o := <-done:
				t.Fatalf("transfer ended before the target was killed (size too small for this machine?): %v", o.err)
			case <-time.After(60 * time.Second):
				t.Fatal("no progress from the target within 60s")
			}
			tp.signal(t, syscall.SIGKILL)
			killed := time.Now()

			var o outcome
			within(t, 2*time.Minute, "Transfer to a killed peer", func() { o = <-done })
			t.Logf("Transfer returned %v after the kill: %v", time.Since(killed), o.err)
			if o.err == nil {
				t.Fatal("transfer to a killed peer succeeded")
			}
			if len(o.res) != 1 || o.res[0].Status != engine.Failed {
				t.Fatalf("results %+v, want one FAILED task", o.res)
			}
			if !errors.Is(o.err, engine.ErrTransferFailed) {
				t.Errorf("err %v, want ErrTransferFailed", o.err)
			}
			if since := time.Since(killed); since > 30*time.Second {
				t.Errorf("Transfer took %v after the kill; its deadline was 5 min away, want it well before", since)
			}

			// The segment is dead now: a new transfer fails by its deadline.
			const d = 3 * time.Second
			var res []engine.TaskResult
			var err error
			took := within(t, time.Minute, "second Transfer to a dead segment", func() {
				res, err = a.Transfer(testCtx(t, d), []engine.Request{req})
			})
			t.Logf("second Transfer: %v after %v", err, took)
			if err == nil {
				t.Fatal("second transfer to a dead segment succeeded")
			}
			if res != nil && (len(res) != 1 || (res[0].Status != engine.Failed && res[0].Status != engine.Timeout)) {
				t.Errorf("results %+v, want one FAILED or TIMEOUT task", res)
			}
			if took > d+2*time.Second {
				t.Errorf("second transfer took %v, want at most its %v deadline + 2s", took, d)
			}
			within(t, 10*time.Second, "Close after the peer died", func() { _ = a.Close() })
		})
	}
}
