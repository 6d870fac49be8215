package engine_test

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/internal/fakeverbs"
)

// Cancels and deadlines that must hold wherever a slice is: waiting for
// its rkeys from an owner that stopped answering, or in its last staging
// chunk. The rdma owner runs in a child process, so that it can be stopped
// with SIGSTOP, like a paused decode server.

const (
	stoppableOwnerEnv      = "KVFERRY_TEST_RDMA_OWNER"       // buffer size of the child owner
	stoppableOwnerVerbsEnv = "KVFERRY_TEST_RDMA_OWNER_VERBS" // its libibverbs
)

func init() {
	v := os.Getenv(stoppableOwnerEnv)
	if v == "" {
		return
	}
	os.Exit(runStoppableOwner(v))
}

func runStoppableOwner(sizeStr string) int {
	size, err := strconv.Atoi(sizeStr)
	if err != nil {
		return 2
	}
	e, err := engine.New(engine.Options{IgnoreEnv: true, Protocol: "rdma", RDMALibrary: os.Getenv(stoppableOwnerVerbsEnv)})
	if err != nil {
		fmt.Fprintf(os.Stderr, "rdma owner process: %v\n", err)
		return 2
	}
	buf, err := e.AllocBuffer(size, "cpu")
	if err != nil {
		fmt.Fprintf(os.Stderr, "rdma owner process: %v\n", err)
		return 2
	}
	fmt.Printf("%s %d %d\n", e.Name(), engine.AddrOf(buf), len(buf))
	_, _ = io.Copy(io.Discard, os.Stdin)
	_ = e.Close()
	return 0
}

// startRDMAOwnerProcess starts an rdma owner process; it is resumed and
// stopped when the test ends.
func startRDMAOwnerProcess(t *testing.T, size int) *target {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), stoppableOwnerEnv+"="+strconv.Itoa(size), stoppableOwnerVerbsEnv+"="+fakeverbs.Path(t))
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGCONT)
		_ = stdin.Close()
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	})
	line := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		if sc.Scan() {
			line <- sc.Text()
		}
		close(line)
		_, _ = io.Copy(io.Discard, stdout)
	}()
	tp := &target{cmd: cmd, size: size}
	select {
	case l, ok := <-line:
		f := strings.Fields(l)
		if !ok || len(f) != 3 {
			t.Fatalf("rdma owner said %q", l)
		}
		tp.name = f[0]
		if tp.addr, err = strconv.ParseUint(f[1], 10, 64); err != nil {
			t.Fatal(err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("rdma owner did not start")
	}
	return tp
}

// A Transfer over rdma whose slice waits for its rkeys (the first slice of
// a new request id asks the owner) from an owner that stopped answering
// returns by its deadline: the cancel ends the slice's rkey request, which
// would otherwise run until its own 5 s timeout (SAFETY.md promise 3).
func TestRDMATransferToAStoppedOwnerKeepsItsDeadlineWhileAskingForRKeys(t *testing.T) {
	fakeverbs.NeedFake(t, "a stopped owner process on the fake fabric")
	const size = 8 << 20
	const deadline = 200 * time.Millisecond
	tp := startRDMAOwnerProcess(t, size)
	a := newEngineWith(t, rdmaOpts(t, engine.Options{}))
	local := alloc(t, a, size)
	seg := openSegment(t, a, tp.name)
	warmPaths(t, a, seg, local, tp.addr) // every path dialed, rkeys of request id 0 cached
	tp.signal(t, syscall.SIGSTOP)

	start := time.Now()
	res, err := a.Transfer(testCtx(t, deadline), []engine.Request{withRID(write(local, seg, tp.addr, 1<<20), 7, 0)})
	took := time.Since(start)
	t.Logf("Transfer with a %v deadline returned after %v: %v (results %+v)", deadline, took, err, res)
	if took > deadline+timeoutBound {
		t.Errorf("Transfer returned %v after its deadline, want at most %v (SAFETY.md promise 3)", took-deadline, timeoutBound)
	}
}

// A cancel that lands during a slice's last staging chunk: the cancel
// leaves a Staging slice to the stager, which must see the task ended once
// the chunk is done and end the slice instead of posting it. Otherwise the
// TIMEOUT task's bytes go on the wire after the deadline and Transfer waits
// for the whole network transfer, not one staging chunk (promise 3).
func TestGPUStagedSliceCanceledDuringItsLastChunkIsNotPosted(t *testing.T) {
	needFakeGPU(t, "slow copies")
	const n = 1 << 20
	const deadline = 100 * time.Millisecond
	const copyTime = 300 * time.Millisecond
	owner := newEngineWith(t, gpuOpts(t, engine.Options{Testing: engine.Testing{ApplyDelay: 3 * time.Second}}))
	init := newEngineWith(t, gpuOpts(t, engine.Options{PathsPerPeer: 1}))
	d, initGPU := gpuAlloc(t, 1, n)
	if _, err := init.RegisterMemory(initGPU, "*"); err != nil {
		t.Fatal(err)
	}
	gpuWrite(t, d, 1, initGPU, bytes.Repeat([]byte{oldByte}, n))
	dst := alloc(t, owner, n)
	seg := openSegment(t, init, owner.Name())
	if err := d.Control(fmt.Sprintf("delay op=cuMemcpyDtoH_v2 us=%d", copyTime.Microseconds())); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Control("reset") })

	start := time.Now()
	res, err := init.Transfer(testCtx(t, deadline), []engine.Request{write(initGPU, seg, engine.AddrOf(dst), n)})
	took := time.Since(start)
	landed := bytes.Count(dst, []byte{oldByte})
	t.Logf("Transfer with a %v deadline returned after %v: %v; %d bytes of it in the owner's memory", deadline, took, err, landed)
	if len(res) == 1 && res[0].Status == engine.Completed {
		t.Fatalf("the transfer completed: the cancel did not land during staging")
	}
	if bound := deadline + copyTime + timeoutBound; took > bound {
		t.Errorf("Transfer returned after %v, want at most %v (deadline + one staging chunk + %v)", took, bound, timeoutBound)
	}
	if landed > 0 {
		t.Errorf("%d bytes of a task that ended %v were written into the owner after its cancel", landed, res[0].Status)
	}
}
