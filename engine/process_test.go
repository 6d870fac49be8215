package engine_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/kvferry/kvferry/cuda"
	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/internal/childproc"
	"github.com/kvferry/kvferry/internal/fakeverbs"
)

// The test binary runs itself as a target process when helperEnv is set.
const (
	helperEnv   = "KVFERRY_TEST_HELPER"   // "target"
	sizeEnv     = "KVFERRY_TEST_SIZE"     // bytes of the target's buffer
	seedEnv     = "KVFERRY_TEST_SEED"     // fill the buffer with fillPattern(seed)
	progressEnv = "KVFERRY_TEST_PROGRESS" // print "progress N" once peers moved N bytes
	cudaEnv     = "KVFERRY_TEST_CUDA"     // the buffer is GPU memory of this (fake) libcuda's device 0
	rdmaEnv     = "KVFERRY_TEST_VERBS"    // the target speaks rdma over this libibverbs
)

func TestMain(m *testing.M) {
	if mode := os.Getenv(helperEnv); mode != "" {
		os.Exit(runHelper(mode))
	}
	cleanup := fakeverbs.UseFabric()
	code := m.Run()
	cleanup()
	if n := transport.IllegalTransitions(); n > 0 && code == 0 {
		fmt.Fprintf(os.Stderr, "FAIL: %d slice state moves the state table refuses\n", n)
		code = 1
	}
	os.Exit(code)
}

// runHelper is the target process: an engine with one buffer. It prints
// "<segment> <addr> <len>" on stdout, optionally "progress N" once peers
// moved N bytes through it, and runs until stdin is closed.
func runHelper(mode string) int {
	fail := func(format string, args ...any) int {
		fmt.Fprintf(os.Stderr, "kvferry test helper: "+format+"\n", args...)
		return 2
	}
	if mode == "data-flood" {
		if err := dataFlood(os.Getenv(spoofTargetEnv), os.Getenv(spoofCountEnv)); err != nil {
			return fail("data flood: %v", err)
		}
		return 0
	}
	if mode == "spoof-aborts" {
		if err := spoofAborts(os.Getenv(spoofTargetEnv), os.Getenv(spoofCountEnv)); err != nil {
			return fail("spoof aborts: %v", err)
		}
		return 0
	}
	if mode != "target" {
		return fail("unknown mode %q", mode)
	}
	size, err := strconv.Atoi(os.Getenv(sizeEnv))
	if err != nil || size <= 0 {
		return fail("%s=%q", sizeEnv, os.Getenv(sizeEnv))
	}
	var progress uint64
	if v := os.Getenv(progressEnv); v != "" {
		if progress, err = strconv.ParseUint(v, 10, 64); err != nil {
			return fail("%s=%q", progressEnv, v)
		}
	}
	cudaLib := os.Getenv(cudaEnv)
	opts := engine.Options{IgnoreEnv: true, Protocol: "tcp", CUDALibrary: cudaLib}
	if lib := os.Getenv(rdmaEnv); lib != "" {
		opts.Protocol, opts.RDMALibrary = "rdma", lib
	}
	e, err := engine.New(opts)
	if err != nil {
		return fail("new engine: %v", err)
	}
	var buf []byte
	freeGPU := func() {}
	if cudaLib != "" {
		// GPU memory of device 0 of the (fake) driver, registered as
		// cuda:0 and filled through the driver.
		var drv *cuda.Driver
		if drv, err = cuda.Open(cudaLib); err == nil {
			if err = drv.Use(0); err == nil {
				var p uint64
				if p, err = drv.Alloc(0, uint64(size)); err == nil {
					buf = unsafe.Slice((*byte)(unsafe.Add(nil, uintptr(p))), size)
					freeGPU = func() { _ = drv.Free(0, p) }
					_, err = e.RegisterMemory(buf, "cuda:0")
				}
			}
		}
		if err != nil {
			return fail("GPU buffer: %v", err)
		}
		if v := os.Getenv(seedEnv); v != "" {
			seed, _ := strconv.ParseUint(v, 10, 64)
			host := make([]byte, size)
			fillPattern(host, seed)
			if err := drv.Copy(0, cuda.HostToDevice, engine.AddrOf(buf), engine.AddrOf(host), uint64(size)); err != nil {
				return fail("fill GPU buffer: %v", err)
			}
		}
	} else {
		if buf, err = e.AllocBuffer(size, "cpu"); err != nil {
			return fail("alloc: %v", err)
		}
		if v := os.Getenv(seedEnv); v != "" {
			seed, err := strconv.ParseUint(v, 10, 64)
			if err != nil {
				return fail("%s=%q", seedEnv, v)
			}
			fillPattern(buf, seed)
		}
	}
	fmt.Printf("%s %d %d\n", e.Name(), engine.AddrOf(buf), len(buf))
	if progress > 0 {
		go func() {
			for {
				st := e.Stats()
				if n := st.OwnerBytesIn + st.OwnerBytesOut; n >= progress {
					fmt.Printf("progress %d\n", n)
					return
				}
				time.Sleep(200 * time.Microsecond) // polls the counters: the engine signals no byte count
			}
		}()
	}
	_, _ = io.Copy(io.Discard, os.Stdin)
	if err := e.Close(); err != nil {
		return fail("close: %v", err)
	}
	if cudaLib != "" {
		freeGPU()
		return 0
	}
	if err := e.FreeBuffer(engine.AddrOf(buf)); err != nil {
		return fail("free: %v", err)
	}
	return 0
}

// target is a running target process.
type target struct {
	proc  *childproc.Proc
	lines <-chan string // stdout lines after the first
	name  string        // its segment name
	addr  uint64        // its buffer's address
	size  int
}

type targetConfig struct {
	cuda     string // a libcuda: the target's buffer is its device 0's memory
	size     int
	seed     uint64 // 0: leave the buffer as mapped (zeros)
	progress uint64 // 0: no progress line
	rdma     string // a libibverbs: the target speaks rdma over it
}

// startTarget runs the target process and waits for its segment line. It is
// stopped (resumed if paused, stdin closed, killed if it lingers) when the
// test ends.
func startTarget(t *testing.T, cfg targetConfig) *target {
	t.Helper()
	env := []string{helperEnv + "=target", sizeEnv + "=" + strconv.Itoa(cfg.size)}
	if cfg.seed != 0 {
		env = append(env, seedEnv+"="+strconv.FormatUint(cfg.seed, 10))
	}
	if cfg.progress != 0 {
		env = append(env, progressEnv+"="+strconv.FormatUint(cfg.progress, 10))
	}
	if cfg.cuda != "" {
		env = append(env, cudaEnv+"="+cfg.cuda)
	}
	if cfg.rdma != "" {
		env = append(env, rdmaEnv+"="+cfg.rdma)
	}
	proc := childproc.Start(t, childproc.Config{Name: "target", Env: env})
	tp := &target{proc: proc, lines: proc.Lines(), size: cfg.size}
	l := proc.First(t, 60*time.Second)
	f := strings.Fields(l)
	if len(f) != 3 {
		t.Fatalf("target said %q", l)
	}
	tp.name = f[0]
	var ok bool
	if tp.addr, ok = childproc.ParseBuffer(f[1:], cfg.size); !ok {
		t.Fatalf("target said %q", l)
	}
	return tp
}

// signal sends sig to the target and, for SIGSTOP, waits until it is stopped.
func (tp *target) signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	tp.proc.Signal(t, sig)
}

// warmPaths moves one slice on each of the segment's paths, so they are all
// dialed.
func warmPaths(t *testing.T, e *engine.Engine, seg *engine.Segment, local []byte, remote uint64) {
	t.Helper()
	n := engine.DefaultPathsPerPeer * engine.DefaultSliceSize
	transfer(t, e, 30*time.Second, write(local, seg, remote, n))
}

// ---------------------------------------------------------------------------
// 2. Two engines in two processes.

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

// ---------------------------------------------------------------------------
// 5. A peer killed mid-transfer.

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

// ---------------------------------------------------------------------------
// 8. Timeouts against a stopped peer.

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
	a, err := engine.New(engine.Options{IgnoreEnv: true, Protocol: "tcp", IOTimeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Close() })
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
	if g > g0 {
		buf := make([]byte, 1<<20)
		buf = buf[:runtime.Stack(buf, true)]
		t.Errorf("goroutines: %d before the engine, %d a second after its Close\n%s", g0, g, buf)
	}
	if f > f0 {
		_, fdsAfter := countFDs(t)
		t.Errorf("open file descriptors: %d before the engine, %d a second after its Close\nbefore:\n%s\nafter:\n%s",
			f0, f, strings.Join(fdsBefore, "\n"), strings.Join(fdsAfter, "\n"))
	}
}
