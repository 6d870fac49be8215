package engine_test

import (
	"bytes"
	"context"
	"errors"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/internal/childproc"
)

// Calls against a peer process stopped with SIGSTOP keep their deadlines,
// leave local memory alone once they returned, and leave nothing running
// after Close.

// timeoutBound is how long past its deadline a Transfer may return.
const timeoutBound = 500 * time.Millisecond

func TestTransferToStoppedPeerTimesOutAndLeavesLocalMemoryAlone(t *testing.T) {
	const size = 64 << 20
	const deadline = 200 * time.Millisecond
	for _, op := range []engine.Op{engine.Write, engine.Read} {
		for _, check := range []string{"unregister while stopped", "memory untouched after return"} {
			t.Run(op.String()+"/"+check, func(t *testing.T) {
				tp := startTarget(t, targetConfig{size: size, seed: 9})
				a := newEngine(t)
				local := alloc(t, a, size)
				fillPattern(local, 10)
				seg := openSegment(t, a, tp.name)
				warmPaths(t, a, seg, local, tp.addr)
				tp.signal(t, syscall.SIGSTOP)

				start := time.Now()
				res, err := a.Transfer(testCtx(t, deadline), []engine.Request{
					{Op: op, Local: engine.AddrOf(local), Segment: seg, Remote: tp.addr, Length: size}})
				took := time.Since(start)
				t.Logf("Transfer with a %v deadline returned after %v: %v", deadline, took, err)
				if len(res) != 1 || res[0].Status != engine.Timeout {
					t.Fatalf("results %+v, err %v; want one TIMEOUT task", res, err)
				}
				if !errors.Is(err, engine.ErrTimeout) || !errors.Is(res[0].Err, engine.ErrTimeout) {
					t.Errorf("err %v, want ErrTimeout", err)
				}
				if took > deadline+timeoutBound {
					t.Errorf("Transfer returned %v after its deadline, want at most %v", took-deadline, timeoutBound)
				}

				switch check {
				case "unregister while stopped":
					// UnregisterMemory waits for copies in progress: it
					// returns promptly only if none is.
					took := within(t, 30*time.Second, "UnregisterMemory after a timeout", func() {
						if err := a.UnregisterMemory(engine.AddrOf(local)); err != nil {
							t.Errorf("unregister: %v", err)
						}
					})
					if took > timeoutBound {
						t.Errorf("UnregisterMemory took %v after the timed-out Transfer returned", took)
					}
				case "memory untouched after return":
					// Change the local buffer, let the target run, and make
					// sure the change never reaches it (WRITE) and nothing
					// lands in the buffer any more (READ).
					const marker = 0x5A
					fillByte(local, marker)
					tp.signal(t, syscall.SIGCONT)
					// One slice on every path after the target resumed: each
					// path is FIFO, so once they are done every earlier frame
					// was answered and handled.
					probe := alloc(t, a, engine.DefaultPathsPerPeer*engine.DefaultSliceSize)
					start := time.Now()
					transfer(t, a, 30*time.Second, read(probe, seg, tp.addr, len(probe)))
					t.Logf("probe READ after the target resumed took %v", time.Since(start))
					if op == engine.Read {
						requireAll(t, "local buffer after the timed-out READ", local, marker)
						return
					}
					back := alloc(t, a, size)
					start = time.Now()
					transfer(t, a, 30*time.Second, read(back, seg, tp.addr, size))
					t.Logf("READ back took %v", time.Since(start))
					old, neu := pattern(size, 9), pattern(size, 10)
					const chunk = 4 << 10
					for off := 0; off < size; off += chunk {
						b, o, n := back[off:off+chunk], old[off:off+chunk], neu[off:off+chunk]
						if bytes.Equal(b, o) || bytes.Equal(b, n) {
							continue
						}
						for i, c := range b {
							if c != o[i] && c != n[i] {
								t.Fatalf("target byte %d is %#02x after the timed-out WRITE: neither its old %#02x nor the sent %#02x (marker %#02x): the engine read the source after Transfer returned",
									off+i, c, o[i], n[i], marker)
							}
						}
					}
				}
			})
		}
	}
}

// A Transfer must keep its deadline even when it has to dial a path first:
// a stopped peer's kernel accepts the TCP connection but never answers HELLO.
func TestTransferToStoppedPeerReturnsByDeadlineWhenItMustDialFirst(t *testing.T) {
	const deadline = 300 * time.Millisecond
	tp := startTarget(t, targetConfig{size: 4 << 20})
	a := newEngine(t)
	local := alloc(t, a, 1<<20)
	seg := openSegment(t, a, tp.name) // descriptor cached, no data path dialed yet
	tp.signal(t, syscall.SIGSTOP)
	var res []engine.TaskResult
	var err error
	took := within(t, time.Minute, "Transfer needing a dial to a stopped peer", func() {
		res, err = a.Transfer(testCtx(t, deadline), []engine.Request{write(local, seg, tp.addr, len(local))})
	})
	t.Logf("Transfer with a %v deadline returned after %v: %v", deadline, took, err)
	if err == nil {
		t.Fatal("transfer to a stopped peer succeeded")
	}
	if len(res) != 1 || res[0].Status != engine.Timeout {
		t.Errorf("results %+v, want one TIMEOUT task", res)
	}
	if took > deadline+timeoutBound {
		t.Errorf("Transfer returned %v after its %v deadline, want at most %v (SAFETY.md promise 3)", took-deadline, deadline, timeoutBound)
	}
}

// Opening a segment of a stopped peer keeps its deadline too.
func TestOpenSegmentOfStoppedPeerReturnsByDeadline(t *testing.T) {
	const deadline = 300 * time.Millisecond
	tp := startTarget(t, targetConfig{size: 1 << 20})
	tp.signal(t, syscall.SIGSTOP)
	a := newEngine(t)
	var err error
	took := within(t, time.Minute, "OpenSegment of a stopped peer", func() {
		ctx, cancel := context.WithTimeout(context.Background(), deadline)
		defer cancel()
		_, err = a.OpenSegment(ctx, tp.name)
	})
	t.Logf("OpenSegment returned after %v: %v", took, err)
	if !errors.Is(err, engine.ErrSegmentUnknown) || !errors.Is(err, engine.ErrUnreachable) {
		t.Errorf("err %v, want ErrSegmentUnknown and ErrUnreachable", err)
	}
	if took > deadline+timeoutBound {
		t.Errorf("OpenSegment returned %v after its deadline", took-deadline)
	}
}

// A Close after a timeout against a stopped peer leaves no goroutine or
// socket of the engine behind ("Close ... returns once no goroutine or socket
// of the engine remains"), even while paths to that peer were being redialed.
func TestCloseAfterTimeoutAgainstStoppedPeerLeavesNothingRunning(t *testing.T) {
	const size = 64 << 20
	tp := startTarget(t, targetConfig{size: size})
	g0 := runtime.NumGoroutine()
	f0, fdsBefore := countFDs(t)

	// A short I/O timeout makes the blocked paths fail (and be redialed)
	// while the transfer is still in flight.
	a := newEngineWith(t, engine.Options{Protocol: "tcp", IOTimeout: 300 * time.Millisecond})
	local, err := a.AllocBuffer(size, "cpu")
	if err != nil {
		t.Fatal(err)
	}
	seg := openSegment(t, a, tp.name)
	warmPaths(t, a, seg, local, tp.addr)
	tp.signal(t, syscall.SIGSTOP)
	const deadline = 1500 * time.Millisecond
	var res []engine.TaskResult
	took := within(t, time.Minute, "Transfer to a stopped peer", func() {
		res, err = a.Transfer(testCtx(t, deadline), []engine.Request{write(local, seg, tp.addr, size)})
	})
	t.Logf("Transfer returned after %v: %v", took, err)
	if err == nil || len(res) != 1 || res[0].Status == engine.Completed {
		t.Fatalf("transfer to a stopped peer: %+v, %v", res, err)
	}
	if took > deadline+timeoutBound {
		t.Errorf("Transfer returned %v after its deadline", took-deadline)
	}
	took = within(t, time.Minute, "Close", func() {
		if err := a.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	})
	t.Logf("Close took %v", took)
	if err := a.FreeBuffer(engine.AddrOf(local)); err != nil {
		t.Error(err)
	}
	// Close promises nothing remains when it returns; allow a short settle
	// for goroutines that are on their way out.
	var g, f int
	childproc.Poll(time.Second, 20*time.Millisecond, func() bool {
		g = runtime.NumGoroutine()
		f, _ = countFDs(t)
		return g <= g0 && f <= f0
	})
	reportLeaks(t, "the engine's Close and a second to settle", g0, g, f0, f, fdsBefore)
}
