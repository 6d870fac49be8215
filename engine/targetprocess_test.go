package engine_test

import (
	"fmt"
	"io"
	"os"
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
	shmEnv      = "KVFERRY_TEST_SHM"      // "1": the target takes shm (Options.Protocol "shm")
	hostBufEnv  = "KVFERRY_TEST_HOST_BUF" // "1": with cudaEnv, the driver is loaded but the buffer is host memory
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
	if mode == "auth-attacker" {
		if err := runAttacker(); err != nil {
			return fail("attacker: %v", err)
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
	if os.Getenv(shmEnv) == "1" {
		opts.Protocol = "shm"
	}
	e, err := engine.New(opts)
	if err != nil {
		return fail("new engine: %v", err)
	}
	var buf []byte
	freeGPU := func() {}
	if cudaLib != "" && os.Getenv(hostBufEnv) != "1" {
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
	shm      bool   // the target takes shm, the same-host transport
	hostBuf  bool   // with cuda: the driver is loaded, the buffer is host memory
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
	if cfg.shm {
		env = append(env, shmEnv+"=1")
	}
	if cfg.hostBuf {
		env = append(env, hostBufEnv+"=1")
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
