package engine_test

// GPU memory on the fake libcuda (tests/fakecuda): registration checks,
// transfers GPU<->CPU and GPU->GPU over tcp through host staging with the
// data checked through the driver, and an abort striking while the owner
// stages a WRITE into GPU memory.

import (
	"bytes"
	"errors"
	"os"
	"testing"
	"time"
	"unsafe"

	"github.com/kvferry/kvferry/cuda"
	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/internal/fakeverbs"
)

// cudaLib is the driver the GPU tests run on: the fake, or with
// KVFERRY_TEST_GPU=1 the system's libcuda.so.1 on real GPUs (tests/gpu/run.sh).
func cudaLib(t *testing.T) string {
	t.Helper()
	if realGPU() {
		return cuda.DefaultLibrary
	}
	return fakeverbs.CUDAPath(t)
}

func realGPU() bool { return os.Getenv("KVFERRY_TEST_GPU") == "1" }

// needFakeGPU skips tests that drive the fake driver's faults or counters.
func needFakeGPU(t *testing.T, what string) {
	t.Helper()
	if realGPU() {
		t.Skipf("needs the fake libcuda (%s); KVFERRY_TEST_GPU=1 runs on a real driver", what)
	}
}

func gpuOpts(t *testing.T, o engine.Options) engine.Options {
	t.Helper()
	o.Protocol = "tcp"
	o.CUDALibrary = cudaLib(t)
	return o
}

// gpuAlloc allocates n bytes on device dev of the fake driver.
func gpuAlloc(t *testing.T, dev int, n int) (*cuda.Driver, []byte) {
	dev = gpuDev(t, dev)
	t.Helper()
	d, err := cuda.Open(cudaLib(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Use(dev); err != nil {
		t.Fatal(err)
	}
	p, err := d.Alloc(dev, uint64(n))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Free(dev, p) })
	// Device memory is not Go memory: the slice only carries its address.
	return d, unsafe.Slice((*byte)(unsafe.Add(nil, uintptr(p))), n)
}

// gpuDev maps a test's device number to one this machine has (a machine
// with one GPU runs both ends on it).
func gpuDev(t *testing.T, dev int) int {
	t.Helper()
	d, err := cuda.Open(cudaLib(t))
	if err != nil {
		t.Fatal(err)
	}
	return min(dev, len(d.Devices())-1)
}

// gpuRead copies GPU memory out through the driver (never by load).
func gpuRead(t *testing.T, d *cuda.Driver, dev int, g []byte) []byte {
	t.Helper()
	dev = gpuDev(t, dev)
	out := make([]byte, len(g))
	if err := d.Copy(dev, cuda.DeviceToHost, engine.AddrOf(out), engine.AddrOf(g), uint64(len(g))); err != nil {
		t.Fatal(err)
	}
	return out
}

func gpuWrite(t *testing.T, d *cuda.Driver, dev int, g, data []byte) {
	t.Helper()
	dev = gpuDev(t, dev)
	if err := d.Copy(dev, cuda.HostToDevice, engine.AddrOf(g), engine.AddrOf(data), uint64(len(g))); err != nil {
		t.Fatal(err)
	}
}

func TestGPUMemoryRegistrationIsChecked(t *testing.T) {
	needFakeGPU(t, "two devices")
	e := newEngineWith(t, gpuOpts(t, engine.Options{}))
	d, g := gpuAlloc(t, 1, 1<<20)
	_ = d
	if _, err := e.RegisterMemory(g, "cuda:0"); !errors.Is(err, engine.ErrInvalidArg) {
		t.Fatalf("device 1 memory registered as cuda:0: %v", err)
	}
	if _, err := e.RegisterMemory(g, "*"); err != nil {
		t.Fatalf("register with *: %v", err)
	}
	if _, err := e.RegisterMemory(make([]byte, 4096), "cuda:0"); !errors.Is(err, engine.ErrInvalidArg) {
		t.Fatalf("host memory registered as cuda:0: %v", err)
	}
	var loc string
	for _, b := range e.Descriptor().Buffers {
		if b.Addr == engine.AddrOf(g) {
			loc = b.Location
		}
	}
	if loc != "cuda:1" {
		t.Fatalf("\"*\" on device 1 memory gave location %q", loc)
	}
	noDriver := newEngineWith(t, engine.Options{Protocol: "tcp", CUDALibrary: t.TempDir() + "/libcuda.so.1"})
	if _, err := noDriver.RegisterMemory(make([]byte, 4096), "cuda:0"); !errors.Is(err, engine.ErrUnsupported) || !bytes.Contains([]byte(err.Error()), []byte("cuda not available")) {
		t.Fatalf("cuda:0 without a driver: %v", err)
	}
}

func TestGPUTransfersOverTCPThroughStaging(t *testing.T) {
	owner := newEngineWith(t, gpuOpts(t, engine.Options{SliceSize: 256 << 10}))
	init := newEngineWith(t, gpuOpts(t, engine.Options{SliceSize: 256 << 10}))
	const n = 6<<20 + 4096
	d, ownerGPU := gpuAlloc(t, 0, n)
	_, initGPU := gpuAlloc(t, 1, n)
	registerMemory(t, owner, ownerGPU, "*")
	registerMemory(t, init, initGPU, "*")
	host := alloc(t, init, n)
	start := time.Now()
	seg := openSegment(t, init, owner.Name())
	want := make([]byte, n)
	fillPattern(want, 7)

	// CPU -> GPU (WRITE into the owner's GPU memory).
	copy(host, want)
	transfer(t, init, 30*time.Second, write(host, seg, engine.AddrOf(ownerGPU), n))
	requireEqual(t, "owner GPU memory after CPU->GPU", gpuRead(t, d, 0, ownerGPU), want)
	// GPU -> GPU (WRITE from the initiator's GPU into the owner's).
	fillPattern(want, 8)
	gpuWrite(t, d, 1, initGPU, want)
	transfer(t, init, 30*time.Second, write(initGPU, seg, engine.AddrOf(ownerGPU), n))
	requireEqual(t, "owner GPU memory after GPU->GPU", gpuRead(t, d, 0, ownerGPU), want)
	// GPU -> CPU (READ of the owner's GPU memory into host memory).
	clear(host)
	transfer(t, init, 30*time.Second, read(host, seg, engine.AddrOf(ownerGPU), n))
	requireEqual(t, "host memory after GPU->CPU", host, want)
	// GPU -> GPU by READ (into the initiator's GPU memory).
	gpuWrite(t, d, 1, initGPU, make([]byte, n))
	transfer(t, init, 30*time.Second, read(initGPU, seg, engine.AddrOf(ownerGPU), n))
	requireEqual(t, "initiator GPU memory after a READ", gpuRead(t, d, 1, initGPU), want)
	t.Logf("4 transfers of %d MiB through staging in %v (%.2f GB/s)", n>>20, time.Since(start).Round(time.Millisecond),
		4*float64(n)/time.Since(start).Seconds()/1e9)
	if c := d.Stat("copies"); c >= 0 && c < 4*int64(n/(256<<10)) {
		t.Errorf("only %d driver copies: the data did not go through staging", c)
	}
	if r := d.Stat("registered"); r == 0 {
		t.Errorf("no host memory page-locked: staging buffers are not pinned")
	}
}

// An abort while the owner stages a WRITE into GPU memory: the staging copy
// runs inside the request's guard, so after Abort returns Safe no byte of
// the request reaches the GPU memory, which the test refills and checks.
func TestGPUStagingObeysAbort(t *testing.T) {
	needFakeGPU(t, "slow copies")
	const n, rid = 8 << 20, 66
	owner := newEngineWith(t, gpuOpts(t, engine.Options{SliceSize: 256 << 10}))
	init := newEngineWith(t, gpuOpts(t, engine.Options{SliceSize: 256 << 10}))
	d, ownerGPU := gpuAlloc(t, 0, n)
	registerMemory(t, owner, ownerGPU, "cuda:0")
	src := alloc(t, init, n)
	fillByte(src, oldByte)
	seg := openSegment(t, init, owner.Name())
	// Each host->device staging copy takes 20 ms: the WRITE lands slowly.
	if err := d.Control("delay op=cuMemcpyHtoDAsync_v2 us=20000"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Control("reset") })
	b := submit(t, init, withRID(write(src, seg, engine.AddrOf(ownerGPU), n), rid, 0))
	waitFor(t, 10*time.Second, "first staged copy", func() bool { return bytes.IndexByte(gpuRead(t, d, 0, ownerGPU), oldByte) >= 0 })
	res, err := owner.Abort(testCtx(t, 10*time.Second), rid, []string{init.Name()})
	if err != nil || !res.Safe {
		t.Fatalf("abort = %+v, %v; want Safe", res, err)
	}
	_ = d.Control("reset")
	gpuWrite(t, d, 0, ownerGPU, bytes.Repeat([]byte{reusedByte}, n))
	r := waitBatch(t, b, 30*time.Second)[0]
	// A staging copy still under way would land by the time the owner gave
	// every staging buffer back and no stager runs.
	waitFor(t, 10*time.Second, "the owner's staging copies to end", func() bool {
		st := owner.Stats()
		return st.StagingInUse == 0 && st.Stagers == 0
	})
	got := gpuRead(t, d, 0, ownerGPU)
	if old := bytes.Count(got, []byte{oldByte}); old != 0 {
		t.Fatalf("%d bytes of the aborted WRITE reached GPU memory after a Safe abort", old)
	}
	t.Logf("task %v after %d bytes", r.Status, r.Transferred)
}

// Two processes over tcp: the target's buffer is GPU memory (device 0 of
// its fake driver); this process moves data GPU->CPU, CPU->GPU and
// GPU->GPU (its own GPU memory on device 1) and checks every byte.
func TestTwoProcessesGPUOverTCP(t *testing.T) {
	const n = 8<<20 + 4096
	lib := cudaLib(t)
	tg := startTarget(t, targetConfig{cuda: lib, size: n, seed: 9})
	e := newEngineWith(t, gpuOpts(t, engine.Options{SliceSize: 1 << 20}))
	seg := openSegment(t, e, tg.name)
	host := alloc(t, e, n)
	want := make([]byte, n)

	fillPattern(want, 9)
	transfer(t, e, 30*time.Second, read(host, seg, tg.addr, n))
	requireEqual(t, "GPU->CPU: the target's GPU memory read into host memory", host, want)

	fillPattern(want, 10)
	copy(host, want)
	transfer(t, e, 30*time.Second, write(host, seg, tg.addr, n))
	clear(host)
	transfer(t, e, 30*time.Second, read(host, seg, tg.addr, n))
	requireEqual(t, "CPU->GPU: host memory written into the target's GPU memory, read back", host, want)

	d, g := gpuAlloc(t, 1, n)
	registerMemory(t, e, g, "*")
	fillPattern(want, 11)
	gpuWrite(t, d, 1, g, want)
	transfer(t, e, 30*time.Second, write(g, seg, tg.addr, n))
	gpuWrite(t, d, 1, g, make([]byte, n))
	transfer(t, e, 30*time.Second, read(g, seg, tg.addr, n))
	requireEqual(t, "GPU->GPU: this GPU's memory written to the target's GPU and read back into it", gpuRead(t, d, 1, g), want)
}

// Two processes over shm: the owner (the target process) opens this
// process's GPU memory by its CUDA IPC handle and copies it itself, device
// to device into its own GPU memory and between device and host memory;
// this process stages nothing. Every byte is checked, and the target's
// driver copied what moved (here: no host staging copy of ours).
func TestTwoProcessesGPUOverSHMThroughIPC(t *testing.T) {
	const n = 8<<20 + 4096
	lib := cudaLib(t)
	tg := startTarget(t, targetConfig{cuda: lib, size: n, seed: 9, shm: true})
	o := gpuOpts(t, engine.Options{SliceSize: 1 << 20})
	o.Protocol = "shm"
	e := newEngineWith(t, o)
	seg := openSegment(t, e, tg.name)
	want := make([]byte, n)

	// This process's GPU memory <-> the target's GPU memory: device to
	// device at the target, through the IPC mapping of ours.
	d, g := gpuAlloc(t, 1, n)
	registerMemory(t, e, g, "*")
	before := e.Stats()
	fillPattern(want, 11)
	gpuWrite(t, d, 1, g, want)
	copiesBefore := d.Stat("copies")
	transfer(t, e, 30*time.Second, write(g, seg, tg.addr, n))
	gpuWrite(t, d, 1, g, make([]byte, n))
	copiesMid := d.Stat("copies")
	transfer(t, e, 30*time.Second, read(g, seg, tg.addr, n))
	requireEqual(t, "GPU->GPU over shm: this GPU's memory written to the target's GPU and read back into it", gpuRead(t, d, 1, g), want)
	if !realGPU() {
		// The fake counts this process's driver copies: only the test's
		// own gpuWrite may show between the transfers.
		if c := copiesMid - copiesBefore; c != 1 {
			t.Errorf("%d driver copies in this process around the WRITE (1 is the test's own): its GPU memory was staged", c)
		}
	}
	st := e.Stats()
	if got := st.SHMGPUSlices - before.SHMGPUSlices; got == 0 {
		t.Errorf("no slice of GPU memory went through CUDA IPC (stats %+v)", st)
	}
	if st.StagingInUse != 0 {
		t.Errorf("%d staging bytes in use after the transfers", st.StagingInUse)
	}

	// Host memory here <-> the target's GPU memory: the target copies
	// between our shared buffer and its device.
	host := alloc(t, e, n)
	fillPattern(want, 12)
	copy(host, want)
	transfer(t, e, 30*time.Second, write(host, seg, tg.addr, n))
	clear(host)
	transfer(t, e, 30*time.Second, read(host, seg, tg.addr, n))
	requireEqual(t, "CPU->GPU over shm: host memory written into the target's GPU memory, read back", host, want)

}

// Two processes over shm, GPU memory here and host memory at the owner
// (KV offloaded to CPU memory on the same node): the owner copies between
// its host memory and this process's GPU memory through the IPC mapping.
func TestTwoProcessesGPUToHostMemoryOverSHM(t *testing.T) {
	const n = 4<<20 + 4096
	lib := cudaLib(t)
	tg := startTarget(t, targetConfig{cuda: lib, hostBuf: true, size: n, shm: true})
	o := gpuOpts(t, engine.Options{SliceSize: 1 << 20})
	o.Protocol = "shm"
	e := newEngineWith(t, o)
	seg := openSegment(t, e, tg.name)
	d, g := gpuAlloc(t, 0, n)
	registerMemory(t, e, g, "*")
	want := make([]byte, n)
	fillPattern(want, 13)
	gpuWrite(t, d, 0, g, want)
	transfer(t, e, 30*time.Second, write(g, seg, tg.addr, n))
	gpuWrite(t, d, 0, g, make([]byte, n))
	transfer(t, e, 30*time.Second, read(g, seg, tg.addr, n))
	requireEqual(t, "GPU->CPU->GPU over shm", gpuRead(t, d, 0, g), want)
	if st := e.Stats(); st.SHMGPUSlices == 0 {
		t.Errorf("no slice of GPU memory went through CUDA IPC (stats %+v)", st)
	}
}

// Over rdma GPU memory is registered with the NICs (dma-buf first; the fake
// NIC refuses it, so as is, as nvidia-peermem would) and moved without
// staging: the driver copies nothing during the transfer.
func TestGPUOverRDMAWithoutStaging(t *testing.T) {
	needFakeGPU(t, "the fake NIC")
	o := engine.Options{Protocol: "rdma", RDMALibrary: fakeverbs.Path(t), CUDALibrary: fakeverbs.CUDAPath(t)}
	owner := newEngineWith(t, o)
	init := newEngineWith(t, o)
	const n = 4 << 20
	d, ownerGPU := gpuAlloc(t, 0, n)
	_, initGPU := gpuAlloc(t, 1, n)
	registerMemory(t, owner, ownerGPU, "cuda:0")
	registerMemory(t, init, initGPU, "cuda:1")
	st := owner.Stats()
	if st.RDMAGPUPeermem+st.RDMAGPUDmabuf != uint64(st.RDMANICs) {
		t.Fatalf("stats %+v: GPU memory not registered on every NIC", st)
	}
	want := make([]byte, n)
	fillPattern(want, 12)
	gpuWrite(t, d, 1, initGPU, want)
	seg := openSegment(t, init, owner.Name())
	before := d.Stat("copies")
	transfer(t, init, 30*time.Second, write(initGPU, seg, engine.AddrOf(ownerGPU), n))
	gpuWrite(t, d, 1, initGPU, make([]byte, n))
	transfer(t, init, 30*time.Second, read(initGPU, seg, engine.AddrOf(ownerGPU), n))
	if c := d.Stat("copies") - before; c != 1 {
		t.Fatalf("%d driver copies during the rdma transfers (1 is the test's own): GPU memory was staged", c)
	}
	requireEqual(t, "GPU memory after GPU->GPU over rdma and back", gpuRead(t, d, 1, initGPU), want)
	t.Logf("GPU registrations: %d dma-buf, %d as is", st.RDMAGPUDmabuf, st.RDMAGPUPeermem)
}

// An rdma peer's request for rkeys of GPU memory stages nothing at the
// owner: the NIC reaches GPU memory itself, so admitting the access (here
// for the whole 32 MiB registration at once) takes no host staging buffer,
// whatever length the peer names. Staging there would let a peer pick the
// size of pinned buffers the owner keeps.
func TestRDMAKeyRequestsForGPUMemoryStageNothing(t *testing.T) {
	needFakeGPU(t, "the fake NIC")
	o := engine.Options{Protocol: "rdma", RDMALibrary: fakeverbs.Path(t), CUDALibrary: fakeverbs.CUDAPath(t)}
	owner := newEngineWith(t, o)
	init := newEngineWith(t, o)
	const n = 32 << 20
	d, ownerGPU := gpuAlloc(t, 0, n)
	registerMemory(t, owner, ownerGPU, "cuda:0")
	src := alloc(t, init, n)
	pinned := d.Stat("registered")
	seg := openSegment(t, init, owner.Name())
	transfer(t, init, 30*time.Second, withRID(write(src, seg, engine.AddrOf(ownerGPU), n), 3, 0))
	if got := d.Stat("registered") - pinned; got != 0 {
		t.Errorf("the owner page-locked %d host staging buffers for rdma accesses", got)
	}
	if st := owner.Stats(); st.StagingInUse != 0 {
		t.Errorf("the owner holds %d staging buffers", st.StagingInUse)
	}
}

// registerMemory registers mem at e for the devices named by where, and
// fails the test when that is refused.
func registerMemory(t *testing.T, e *engine.Engine, mem []byte, where string) {
	t.Helper()
	if _, err := e.RegisterMemory(mem, where); err != nil {
		t.Fatal(err)
	}
}
