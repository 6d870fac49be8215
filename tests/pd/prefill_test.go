package pd

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/internal/childproc"
	"github.com/kvferry/kvferry/internal/fakeverbs"
)

// The test binary runs itself as the prefill process when roleEnv is set;
// the other variables configure it (the library reads no variable for its
// Testing switches, so the unsafe mode travels in one of ours).
const (
	roleEnv    = "KVFERRY_PD_ROLE"           // "prefill"
	unsafeEnv  = "KVFERRY_PD_UNSAFE"         // "1": Options.Testing.UnsafeAbort
	sliceEnv   = "KVFERRY_PD_SLICE"          // Options.SliceSize
	pathsEnv   = "KVFERRY_PD_PATHS"          // Options.PathsPerPeer
	workersEnv = "KVFERRY_PD_WORKERS"        // requests written at once
	srcEnv     = "KVFERRY_PD_SRC"            // source bytes per worker (the largest request)
	rdmaEnv    = "KVFERRY_PD_RDMA"           // the libibverbs to load: Options.Protocol "rdma" over it; unset: tcp
	devicesEnv = "KVFERRY_PD_RDMA_DEVICES"   // the prefill's Options.RDMADevices
	noFenceEnv = "KVFERRY_PD_NOFENCE"        // "1": Options.RDMANoFence
	noRIDEnv   = "KVFERRY_PD_NORID"          // "1": request id 0 on every transfer
	secretEnv  = "KVFERRY_PD_CLUSTER_SECRET" // Options.ClusterSecretFile: both ends authenticate
	shmEnv     = "KVFERRY_PD_SHM"            // "1": Options.Protocol "shm" (the same-host transport)
)

func TestMain(m *testing.M) {
	if os.Getenv(roleEnv) == "prefill" {
		os.Exit(runPrefill()) // on the fake fabric of the parent, which it inherits
	}
	// Before anything loads the fake libibverbs: the rdma tests' processes
	// share a fake fabric of this process's own (the tcp tests never load it).
	cleanup := fakeverbs.UseFabric()
	code := m.Run()
	cleanup()
	os.Exit(code)
}

// prefillConfig configures the prefill process.
type prefillConfig struct {
	unsafe           bool
	slice, paths     int
	workers, srcSize int
	rdma             string // the libibverbs to write over rdma with (fakeverbs.Library); "": tcp
	noFence          bool   // Options.RDMANoFence
	devices          string // the prefill's Options.RDMADevices (decode's: fakeverbs.Devices("owner"))
	// noRID: the prefill passes no request id (0, generation 0, on every
	// transfer), as SGLang's and vLLM's Mooncake wrappers do; only a Fence
	// of decode's pages stops its transfers. The request ids of the
	// bootstrap lines still name the requests' patterns.
	noRID bool
	// clusterSecret: a cluster secret file both ends authenticate with
	// (Options.ClusterSecretFile); "": no authentication.
	clusterSecret string
	// shm: both ends use the same-host transport (the owner copies from
	// the prefill's shared buffers itself) instead of tcp.
	shm bool
}

func (c prefillConfig) env() []string {
	u := "0"
	if c.unsafe {
		u = "1"
	}
	nf := "0"
	if c.noFence {
		nf = "1"
	}
	nr := "0"
	if c.noRID {
		nr = "1"
	}
	sh := "0"
	if c.shm {
		sh = "1"
	}
	return []string{roleEnv + "=prefill", shmEnv + "=" + sh, unsafeEnv + "=" + u, sliceEnv + "=" + strconv.Itoa(c.slice),
		pathsEnv + "=" + strconv.Itoa(c.paths), workersEnv + "=" + strconv.Itoa(c.workers), srcEnv + "=" + strconv.Itoa(c.srcSize),
		rdmaEnv + "=" + c.rdma, noFenceEnv + "=" + nf, devicesEnv + "=" + c.devices, noRIDEnv + "=" + nr,
		secretEnv + "=" + c.clusterSecret}
}

// options are the prefill's engine options: c's transport, pinned (tcp
// unless c says rdma, whatever devices the machine has).
func (c prefillConfig) options() engine.Options {
	o := engine.Options{IgnoreEnv: true, Protocol: "tcp", ClusterSecretFile: c.clusterSecret}
	if c.shm {
		o.Protocol = "shm"
	}
	if c.rdma != "" {
		o.Protocol, o.RDMALibrary, o.RDMANoFence, o.RDMADevices = "rdma", c.rdma, c.noFence, c.devices
	}
	return o
}

// decodeOptions are decode's: the same transport (both ends must speak
// rdma), on the owner's devices.
func (c prefillConfig) decodeOptions() engine.Options {
	o := c.options()
	if c.rdma != "" {
		o.RDMADevices = fakeverbs.Devices("owner")
	}
	return o
}

// job is one "request" line.
type job struct {
	rid                     uint64
	gen                     uint32
	layers, pages, pageSize int
	addrs                   []uint64 // layer-major
}

func parseJob(f []string) (job, error) {
	var j job
	if len(f) < 6 || f[0] != "request" {
		return j, fmt.Errorf("not a request line")
	}
	var nums [5]uint64
	for i := range nums {
		n, err := strconv.ParseUint(f[i+1], 10, 64)
		if err != nil {
			return j, err
		}
		nums[i] = n
	}
	j.rid, j.gen = nums[0], uint32(nums[1])
	j.layers, j.pages, j.pageSize = int(nums[2]), int(nums[3]), int(nums[4])
	if j.layers <= 0 || j.pages <= 0 || j.pageSize <= 0 || j.pageSize%8 != 0 || len(f) != 6+j.layers*j.pages {
		return j, fmt.Errorf("bad shape")
	}
	for _, s := range f[6:] {
		a, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			return j, err
		}
		j.addrs = append(j.addrs, a)
	}
	return j, nil
}

// processFDs counts this process's open file descriptors; the leak checks
// of both processes use it, the child's without a testing.T.
func processFDs() (int, []string, error) {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return 0, nil, err
	}
	var names []string
	for _, e := range ents {
		l, _ := os.Readlink(filepath.Join("/proc/self/fd", e.Name()))
		names = append(names, e.Name()+" -> "+l)
	}
	sort.Strings(names)
	// One entry is the directory ReadDir itself had open.
	return len(ents) - 1, names, nil
}

// warmUp starts and closes an engine with options o, so that what the
// runtime, libzmq and (over rdma) the loaded libibverbs create once per
// process (the netpoller's descriptors, ...) exists before a leak check
// takes its baseline.
func warmUp(o engine.Options) error {
	e, err := engine.New(o)
	if err != nil {
		return err
	}
	return e.Close()
}

// settled waits up to d for the goroutine and descriptor counts to drop to
// at most g0 and f0 (goroutines on their way out need a moment), and
// returns the last counts.
func settled(g0, f0 int, d time.Duration) (g, f int) {
	waitUntil(d, 10*time.Millisecond, func() bool {
		g = runtime.NumGoroutine()
		f, _, _ = processFDs()
		return g <= g0 && f <= f0
	})
	return g, f
}

// runPrefill is the prefill process: it WRITEs each requested request's
// pages into decode's slots, one batch per layer, and reports each
// request's outcome. At stdin's end it waits for the requests, closes its
// engine, checks itself for leaks and says "bye".
func runPrefill() int {
	fail := func(format string, args ...any) int {
		fmt.Fprintf(os.Stderr, "pd prefill: "+format+"\n", args...)
		return 2
	}
	num := func(name string) int {
		n, err := strconv.Atoi(os.Getenv(name))
		if err != nil {
			return -1
		}
		return n
	}
	cfg := prefillConfig{unsafe: os.Getenv(unsafeEnv) == "1", slice: num(sliceEnv), paths: num(pathsEnv),
		workers: num(workersEnv), srcSize: num(srcEnv), rdma: os.Getenv(rdmaEnv), noFence: os.Getenv(noFenceEnv) == "1",
		devices: os.Getenv(devicesEnv), noRID: os.Getenv(noRIDEnv) == "1", clusterSecret: os.Getenv(secretEnv),
		shm: os.Getenv(shmEnv) == "1"}
	if cfg.slice <= 0 || cfg.paths <= 0 || cfg.workers <= 0 || cfg.srcSize <= 0 {
		return fail("bad configuration %+v", cfg)
	}
	opts := cfg.options()
	if err := warmUp(opts); err != nil {
		return fail("warm-up engine: %v", err)
	}
	g0 := runtime.NumGoroutine()
	f0, _, err := processFDs()
	if err != nil {
		return fail("%v", err)
	}

	opts.SliceSize, opts.PathsPerPeer, opts.Testing.UnsafeAbort = cfg.slice, cfg.paths, cfg.unsafe
	e, err := engine.New(opts)
	if err != nil {
		return fail("new engine: %v", err)
	}
	src, err := e.AllocBuffer(cfg.workers*cfg.srcSize, "cpu")
	if err != nil {
		return fail("alloc: %v", err)
	}
	// What fences refused, over every request (see writeRequest).
	var fenced fenceTally
	// The application learns of aborts through events; take them so the
	// queue never overflows, and count them.
	var abortEvents, otherEvents int
	evDone := make(chan struct{})
	go func() {
		defer close(evDone)
		for ev := range e.Events() {
			if ev.Kind == engine.EventAborted {
				abortEvents++
			} else {
				otherEvents++
			}
		}
	}()
	out := childproc.NewLineWriter(os.Stdout)
	out.Printf("prefill %s", e.Name())

	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 64<<10), 1<<20)
	if !in.Scan() {
		return fail("no segment line")
	}
	f := strings.Fields(in.Text())
	if len(f) != 2 || f[0] != "segment" {
		return fail("want a segment line, got %q", in.Text())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	seg, err := e.OpenSegment(ctx, f[1])
	cancel()
	if err != nil {
		return fail("open segment: %v", err)
	}

	slots := make(chan []byte, cfg.workers)
	for i := range cfg.workers {
		slots <- src[i*cfg.srcSize : (i+1)*cfg.srcSize]
	}
	var wg sync.WaitGroup
	for in.Scan() {
		j, err := parseJob(strings.Fields(in.Text()))
		if err != nil {
			return fail("line %q: %v", in.Text(), err)
		}
		if j.layers*j.pages*j.pageSize > cfg.srcSize {
			return fail("request %d of %d bytes, sources hold %d", j.rid, j.layers*j.pages*j.pageSize, cfg.srcSize)
		}
		s := <-slots // a free source: the request's KV "computed" into it
		wg.Add(1)
		go func() {
			defer wg.Done()
			out.Printf("%s", writeRequest(e, seg, j, s, cfg.noRID, out, &fenced))
			slots <- s
		}()
	}
	if err := in.Err(); err != nil {
		return fail("stdin: %v", err)
	}
	wg.Wait()
	st := e.Stats()
	if err := e.Close(); err != nil {
		return fail("close: %v", err)
	}
	<-evDone
	if err := e.FreeBuffer(engine.AddrOf(src)); err != nil {
		return fail("free: %v", err)
	}
	g, fds := settled(g0, f0, 2*time.Second)
	out.Printf("bye completed=%d failed=%d inflight=%d tasks_aborted=%d aborts_received=%d abort_events=%d other_events=%d events_dropped=%d goroutines_before=%d goroutines_after=%d fds_before=%d fds_after=%d rdma_wrs=%d rdma_error_wcs=%d rdma_failovers=%d retries=%d tasks_fenced=%d bytes_fenced=%d fences_received=%d acks_sent=%d shm_slices=%d shm_over_tcp=%d",
		st.TasksCompleted, st.TasksFailed, st.TasksInFlight, st.TasksAborted, st.AbortsReceived, abortEvents, otherEvents,
		st.EventsDropped, g0, g, f0, fds, st.RDMAWorkRequests, st.RDMAErrorWCs, st.RDMAFailovers, st.Retries,
		fenced.tasks.Load(), fenced.bytes.Load(), st.FencesReceived, st.AbortAcksSent,
		st.SHMSharedSlices+st.SHMAttachSlices, st.SHMFallbackSlices)
	return 0
}

// fenceTally counts the prefill's tasks that their owner refused as fenced
// (engine.ErrFenced), and the bytes of them that did not land.
type fenceTally struct{ tasks, bytes atomic.Int64 }

// writeRequest writes one request: per layer, its pattern is "computed"
// into the source and the layer's pages go out as one batch submit (as
// SGLang writes KV layer by layer), with the request's id unless noRID.
// Once every submit returned it says "planned": nothing of the request is
// planned after that line. Then it waits for all of its tasks and returns
// the "done" line.
func writeRequest(e *engine.Engine, seg *engine.Segment, j job, src []byte, noRID bool, out *childproc.LineWriter, fenced *fenceTally) string {
	b, err := e.AllocateBatch(j.layers * j.pages)
	if err != nil {
		out.Printf("planned %d", j.rid)
		return fmt.Sprintf("done %d SUBMIT_FAILED 0 0 0 0 %q", j.rid, err.Error())
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	rid, gen := j.rid, j.gen
	if noRID {
		rid, gen = 0, 0
	}
	var submitErr error
	reqs := make([]engine.Request, j.pages)
	for l := range j.layers {
		for p := range j.pages {
			k := l*j.pages + p
			loc := src[k*j.pageSize : (k+1)*j.pageSize]
			fillSlot(loc, holder{tag: j.rid, pos: p}, l)
			reqs[p] = engine.Request{Op: engine.Write, Local: engine.AddrOf(loc), Segment: seg, Remote: j.addrs[k],
				Length: uint64(j.pageSize), RequestID: rid, Generation: gen}
		}
		if submitErr = b.Submit(ctx, reqs); submitErr != nil {
			break
		}
	}
	out.Printf("planned %d", j.rid)
	if err := b.Wait(ctx); err != nil {
		b.Cancel()
	}
	res := b.Results()
	if err := b.Free(); err != nil {
		return fmt.Sprintf("done %d SUBMIT_FAILED 0 %d 0 0 %q", j.rid, len(res), "free: "+err.Error())
	}
	status, moved := engine.Completed, uint64(0)
	var firstErr, firstFenced error
	nfenced, others := 0, 0
	for _, r := range res {
		moved += r.Transferred
		switch {
		case r.Status == engine.Completed:
		case errors.Is(r.Err, engine.ErrFenced):
			nfenced++
			fenced.tasks.Add(1)
			fenced.bytes.Add(int64(uint64(j.pageSize) - r.Transferred))
			if firstFenced == nil {
				firstFenced = r.Err
			}
		default:
			others++
			if firstErr == nil {
				firstErr = r.Err
			}
		}
		if rank(r.Status) > rank(status) {
			status = r.Status
		}
	}
	if firstErr == nil {
		// The first error that is not a fence's, else the first fence's.
		firstErr = firstFenced
	}
	name := status.String()
	if submitErr != nil {
		name, firstErr = "SUBMIT_FAILED", errors.Join(submitErr, firstErr)
	}
	msg := ""
	if firstErr != nil {
		msg = firstErr.Error()
	}
	return fmt.Sprintf("done %d %s %d %d %d %d %q", j.rid, name, moved, len(res), nfenced, others, msg)
}

// rank orders task states for a request's summary: the worst one names it.
func rank(s engine.TaskStatus) int {
	switch s {
	case engine.Completed:
		return 0
	case engine.Aborted:
		return 1
	case engine.Canceled:
		return 2
	case engine.Timeout:
		return 3
	}
	return 4 // FAILED, or anything not final
}
