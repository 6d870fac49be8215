// Command kvferry-bench measures kvferry transfers, in the manner of
// Mooncake's transfer_engine_bench.
//
//	kvferry-bench --mode loopback --op write --block-size 65536 --threads 4 --duration 10
//	kvferry-bench --mode abort --rate 1000 --duration 10
//	kvferry-bench --mode fence --rate 1000 --duration 10
//	kvferry-bench --mode auth --duration 2
//	kvferry-bench --mode pingpong --block-size 4096 --duration 6
//	kvferry-bench --mode samehost --duration 12
//	kvferry-bench --mode peers --peers 2,8,32,128,256 --idle 10
//	kvferry-bench --mode compress --rates 1gbit,10gbit,none --duration 5
//	kvferry-bench --mode loopback --duration 20 --metrics-addr 127.0.0.1:9400
//	kvferry-bench --mode metrics-cost --protocol tcp --block-size 65536 --duration 2 --buffer-size 67108864
//
// Modes: target (serve a buffer and wait), initiator (move data to or from a
// target named by --segment), loopback (both in one process, TCP on
// 127.0.0.1: the README's main job), raw-tcp (plain loopback TCP with the
// same stream count and block size: the baseline to compare with) and abort
// (abort latency, call to Safe, with --rate MB/s of WRITEs in flight; see
// abort.go). Data integrity is verified outside the timed loop; a mismatch
// exits 1, as does an abort that is not Safe.
package main

import (
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"runtime/pprof"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kvferry/kvferry/engine"
)

type config struct {
	mode, op, segment, host, proto   string
	blockSize, batchSize, threads    int
	bufferSize, sliceSize, pathCount int
	duration                         float64
	seed                             uint64
	rate                             float64       // abort mode: MB/s of background WRITEs
	abortEvery                       time.Duration // abort mode: mean time between aborts
	twoProcess                       bool          // abort mode: the initiator in a child process
	clusterSecret                    string        // engines authenticate with this cluster secret file
	pathsGiven                       bool          // --paths was given
	metricsAddr                      string        // engines serve their metrics here (--metrics-addr)
	metricsOff                       bool          // --metrics off: no per-task counting
	rounds                           int           // metrics-cost mode: rounds of each setting
	compression                      string        // the engine's Compression
	data                             string        // "random" or "kv": what the source and target buffers hold
	shapes                           string        // compress mode: the link rates tried
	ops                              string        // compress mode: the operations measured
	peerCounts                       string        // peers mode: the peer counts measured
	peerWindow                       float64       // peers mode: seconds of the in-use traffic window
	progressEvery                    time.Duration // a progress line this often (0: every 5 s from 10 s runs)
	// ready and gate line up runs that are timed side by side: each calls
	// ready once set up, then starts its timed loop when gate closes.
	ready func()
	gate  <-chan struct{}
}

func main() {
	var c config
	flag.StringVar(&c.mode, "mode", "loopback", "target | initiator | loopback | raw-tcp | abort | fence | auth | pingpong | samehost | peers | compress")
	flag.StringVar(&c.proto, "protocol", "", "engines' data-plane protocol: auto, tcp, rdma or shm (empty: auto; KVFERRY_PROTOCOL, when set, overrides it)")
	flag.StringVar(&c.op, "op", "write", "write | read")
	flag.StringVar(&c.segment, "segment", "", "the target's segment name host:port (initiator mode; abort mode: be the child of --two-process)")
	flag.StringVar(&c.host, "host", "127.0.0.1", "address to listen on")
	flag.IntVar(&c.blockSize, "block-size", 64<<10, "bytes per request (abort mode: per request id, default 8 MiB)")
	flag.IntVar(&c.batchSize, "batch-size", 16, "requests per batch (abort mode: pieces of one request id)")
	flag.IntVar(&c.threads, "threads", 4, "submitting threads; also the connection (stream) count")
	flag.Float64Var(&c.duration, "duration", 5, "seconds of timed transfers (abort mode: default 10)")
	flag.IntVar(&c.bufferSize, "buffer-size", 256<<20, "bytes registered on each side")
	flag.IntVar(&c.sliceSize, "slice-size", 0, "engine slice size (0: engine default)")
	flag.IntVar(&c.pathCount, "paths", 0, "connections per peer (0: --threads)")
	flag.Uint64Var(&c.seed, "seed", 1, "data pattern seed (target and initiator must agree)")
	flag.Float64Var(&c.rate, "rate", 1000, "abort mode: background WRITE rate to aim at, MB/s (1e6 bytes)")
	flag.StringVar(&c.compression, "compression", "", "the engine's Compression: off, auto, huff0, s2 or zstd (the tcp data it sends: WRITEs as initiator, READ answers as target)")
	flag.StringVar(&c.data, "data", "random", "buffer contents: random (incompressible) or kv (bf16 values shaped like attention keys and values)")
	flag.StringVar(&c.shapes, "rates", "1gbit,10gbit,none", "compress mode: link rates (tc tbf) tried; none: unshaped")
	flag.StringVar(&c.ops, "ops", "write,read", "compress mode: the operations measured (write, read)")
	flag.StringVar(&c.peerCounts, "peers", "2,8,32,128,256", "peers mode: peer counts to measure, comma-separated")
	flag.Float64Var(&c.peerWindow, "idle", 10, "peers mode: seconds of the window, right after the transfers, in which background traffic to peers in use is measured (whole heartbeat intervals; the idle window is one IdleHeartbeatInterval)")
	flag.DurationVar(&c.abortEvery, "abort-interval", 10*time.Millisecond, "abort mode: mean time between aborts (uniform in [x/2, 3x/2])")
	flag.BoolVar(&c.twoProcess, "two-process", false, "abort mode: run the initiator (prefill) as a child process")
	flag.StringVar(&c.clusterSecret, "cluster-secret-file", "", "engines authenticate with this cluster secret (auth mode: a temporary one when empty)")
	flag.StringVar(&c.metricsAddr, "metrics-addr", "", "serve the engines' metrics at http://ADDR/metrics during the run (as KVFERRY_METRICS_ADDR)")
	metricsOn := flag.String("metrics", "on", "on | off: off leaves per-task counting out of the engines (KVFERRY_METRICS=0)")
	flag.IntVar(&c.rounds, "rounds", 5, "metrics-cost and compress modes: rounds of each setting, alternating (compress mode: default 3)")
	flag.DurationVar(&c.progressEvery, "progress", 0, "print the rate every this long (0: every 5 s in runs of 10 s or more)")
	cpuProfile := flag.String("cpuprofile", "", "write a CPU profile to this file")
	flag.Parse()
	switch *metricsOn {
	case "on":
	case "off":
		c.metricsOff = true
	default:
		fmt.Fprintf(os.Stderr, "kvferry-bench: --metrics %q: want on or off\n", *metricsOn)
		os.Exit(2)
	}
	given := map[string]bool{}
	flag.Visit(func(f *flag.Flag) { given[f.Name] = true })
	if c.mode == "compress" && !given["rounds"] {
		c.rounds = 3
	}
	if c.mode == "abort" || c.mode == "fence" {
		if !given["block-size"] {
			c.blockSize = 8 << 20
		}
		if !given["duration"] {
			c.duration = 10
		}
	}
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err == nil {
			err = pprof.StartCPUProfile(f)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "kvferry-bench:", err)
			os.Exit(2)
		}
		defer pprof.StopCPUProfile()
	}
	switch c.data {
	case "random":
	case "kv":
		kvData = true
	default:
		fmt.Fprintln(os.Stderr, "kvferry-bench: --data: want random or kv")
		os.Exit(2)
	}
	c.pathsGiven = c.pathCount != 0
	if c.pathCount == 0 {
		c.pathCount = c.threads
	}
	if err := c.check(); err != nil {
		fmt.Fprintln(os.Stderr, "kvferry-bench:", err)
		os.Exit(2)
	}
	if err := modes[c.mode](c); err != nil {
		pprof.StopCPUProfile()
		fmt.Fprintln(os.Stderr, "kvferry-bench:", err)
		if errors.Is(err, errMismatch) || errors.Is(err, errAbortFail) {
			os.Exit(1)
		}
		os.Exit(3)
	}
}

// modes are the --mode values and what runs each.
var modes = map[string]func(config) error{
	"target":        runTarget,
	"initiator":     func(c config) error { return runInitiator(c, nil) },
	"loopback":      runLoopback,
	"raw-tcp":       runRawTCP,
	"abort":         runAbort,
	"fence":         runFence,
	"auth":          runAuthCompare,
	"pingpong":      runPingPong,
	"compress":      runCompress,
	"peers":         runPeers,
	"peers-subject": runPeersSubject,
	"samehost":      runSameHost,
	"metrics-cost":  runMetricsCost,
	// pong-server is pingpong mode's raw TCP peer process.
	"pong-server": runPongServer,
}

func (c *config) check() error {
	if _, ok := modes[c.mode]; !ok {
		return fmt.Errorf("--mode %q: want target, initiator, loopback, raw-tcp, abort, fence, auth, pingpong, samehost, peers or metrics-cost", c.mode)
	}
	if c.op != "write" && c.op != "read" {
		return fmt.Errorf("--op %q: want write or read", c.op)
	}
	if (c.mode == "abort" || c.mode == "fence") && (c.op != "write" || c.rate <= 0 || c.abortEvery <= 0) {
		return fmt.Errorf("--mode %s needs --op write, a positive --rate and a positive --abort-interval", c.mode)
	}
	if c.mode == "fence" && c.threads < 2 {
		return errors.New("--mode fence needs --threads of at least 2: a victim and bystanders")
	}
	if c.mode == "initiator" && c.segment == "" {
		return errors.New("--mode initiator needs --segment host:port")
	}
	if c.blockSize <= 0 || c.batchSize <= 0 || c.threads <= 0 || c.duration <= 0 {
		return errors.New("--block-size, --batch-size, --threads and --duration must be positive")
	}
	if c.bufferSize < c.threads*c.blockSize {
		return fmt.Errorf("--buffer-size %d is smaller than --threads x --block-size", c.bufferSize)
	}
	return nil
}

func (c *config) engineOptions() engine.Options {
	return engine.Options{Host: c.host, SliceSize: c.sliceSize, PathsPerPeer: c.pathCount, ClusterSecretFile: c.clusterSecret, Protocol: c.proto,
		MetricsAddr: c.metricsAddr, MetricsOff: c.metricsOff, Compression: c.compression}
}

// newEngine starts an engine with c's options and allocates size bytes of
// its memory, in any location. The caller closes the engine.
func (c *config) newEngine(size int) (*engine.Engine, []byte, error) {
	e, err := engine.New(c.engineOptions())
	if err != nil {
		return nil, nil, err
	}
	buf, err := e.AllocBuffer(size, "*")
	if err != nil {
		e.Close()
		return nil, nil, err
	}
	return e, buf, nil
}

// fill writes the pattern of seed into b, as it would stand at offset off of
// the whole buffer, so any slice of it can be checked independently.
func fill(b []byte, off int, seed uint64) {
	if kvData {
		fillKV(b, off, seed)
		return
	}
	for i := 0; i+8 <= len(b); i += 8 {
		binary.LittleEndian.PutUint64(b[i:], mix(uint64(off+i)^seed))
	}
	for i := len(b) &^ 7; i < len(b); i++ {
		b[i] = byte(mix(uint64(off+i) ^ seed))
	}
}

func mix(x uint64) uint64 { // splitmix64
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

var errMismatch = errors.New("data mismatch")

// verify compares b, which starts at byte start of a buffer that fill
// wrote from 0, with the pattern and names the first bad byte. The pattern
// is made of 8-byte words from the buffer's start, so it is generated over
// whole words around b, whatever start and len(b) are.
func verify(b []byte, start int, seed uint64) error {
	want := make([]byte, 1<<20+16)
	for off := 0; off < len(b); off += 1 << 20 {
		n := min(1<<20, len(b)-off)
		lo := (start + off) &^ 7
		hi := (start + off + n + 7) &^ 7
		fill(want[:hi-lo], lo, seed)
		w := want[start+off-lo:]
		for i := 0; i < n; i++ {
			if b[off+i] != w[i] {
				return fmt.Errorf("%w at byte %d: got %#x, want %#x", errMismatch, start+off+i, b[off+i], w[i])
			}
		}
	}
	return nil
}

// newTarget is a target's engine and its --buffer-size bytes, filled with
// the pattern of --seed that READs from initiators expect.
func (c *config) newTarget() (*engine.Engine, []byte, error) {
	e, buf, err := c.newEngine(c.bufferSize)
	if err == nil {
		fill(buf, 0, c.seed)
	}
	return e, buf, err
}

func runTarget(c config) error {
	e, buf, err := c.newTarget()
	if err != nil {
		return err
	}
	defer e.Close()
	fmt.Printf("target ready: segment=%s buffer=%#x size=%d\n", e.Name(), engine.AddrOf(buf), len(buf))
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	<-sig
	return nil
}

func runLoopback(c config) error {
	_, err := loopback(c)
	return err
}

// loopback runs a target and the timed loop against it in this process and
// returns the loop's GB/s.
func loopback(c config) (float64, error) {
	target, buf, err := c.newTarget()
	if err != nil {
		return 0, err
	}
	defer target.Close()
	c.segment = target.Name()
	return initiate(c, buf)
}

type result struct {
	bytes, transfers uint64
	covered          uint64 // bytes of the thread's share moved at least once
	latencies        []time.Duration
}

// runInitiator runs the timed loop against c.segment. In loopback mode
// targetBuf is the target's buffer, checked directly as well.
func runInitiator(c config, targetBuf []byte) error {
	_, err := initiate(c, targetBuf)
	return err
}

// initiate is runInitiator, returning the timed loop's GB/s.
func initiate(c config, targetBuf []byte) (gbps float64, err error) {
	e, local, err := c.newEngine(c.bufferSize)
	if err != nil {
		return 0, err
	}
	defer e.Close()
	ctx := context.Background()
	seg, err := e.OpenSegment(ctx, c.segment)
	if err != nil {
		return 0, err
	}
	bufs := seg.Descriptor().Buffers
	if len(bufs) == 0 {
		return 0, fmt.Errorf("segment %s registered no buffer", c.segment)
	}
	remote := bufs[0]
	size := min(uint64(c.bufferSize), remote.Len)
	per := size / uint64(c.threads) / uint64(c.blockSize) * uint64(c.blockSize)
	if per == 0 {
		return 0, fmt.Errorf("buffer of %d bytes holds no block per thread", size)
	}
	op := engine.Write
	if c.op == "read" {
		// Put the pattern the reads will be checked against into the
		// target first (untimed): earlier runs may have written over it.
		op = engine.Read
		fill(local, 0, c.seed)
		if err := moveAll(ctx, e, seg, engine.Write, engine.AddrOf(local), remote.Addr, per*uint64(c.threads)); err != nil {
			return 0, fmt.Errorf("prepare the target for reads: %w", err)
		}
		clear(local)
	} else {
		fill(local, 0, c.seed^0x5a5a)
	}
	proto := c.proto
	if proto == "" {
		proto = "auto"
	}
	fmt.Printf("kvferry-bench: mode=%s protocol=%s op=%s segment=%s block=%d batch=%d threads=%d paths=%d duration=%gs\n",
		c.mode, proto, c.op, c.segment, c.blockSize, c.batchSize, c.threads, c.pathCount, c.duration)
	if addr := e.MetricsAddr(); addr != "" {
		fmt.Printf("kvferry-bench: metrics at http://%s/metrics (engine %s)\n", addr, e.Name())
	}

	if c.ready != nil {
		c.ready()
		<-c.gate
	}
	// Bytes that crossed compressed, either way (WRITEs we sent, READ
	// answers we decoded), over the timed loop only.
	zRaw := func() uint64 { st := e.Stats(); return st.CompressedRawOut + st.CompressedRawIn }
	zBefore := zRaw()
	var total atomic.Uint64
	stop := time.Now().Add(time.Duration(c.duration * float64(time.Second)))
	results := make([]result, c.threads)
	errs := make([]error, c.threads)
	var wg sync.WaitGroup
	start := time.Now()
	done := make(chan struct{})
	go progress(c, &total, start, done)
	for th := 0; th < c.threads; th++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			base := uint64(th) * per
			reqs := make([]engine.Request, c.batchSize)
			off := uint64(0)
			r := &results[th]
			for time.Now().Before(stop) {
				for i := range reqs {
					if off+uint64(c.blockSize) > per {
						off = 0
					}
					reqs[i] = engine.Request{Op: op, Local: engine.AddrOf(local) + base + off, Segment: seg,
						Remote: remote.Addr + base + off, Length: uint64(c.blockSize)}
					off += uint64(c.blockSize)
				}
				t0 := time.Now()
				if _, err := e.Transfer(ctx, reqs); err != nil {
					errs[th] = err
					return
				}
				r.latencies = append(r.latencies, time.Since(t0))
				r.covered = max(r.covered, min(r.bytes+uint64(c.batchSize*c.blockSize), per/uint64(c.blockSize)*uint64(c.blockSize)))
				n := uint64(c.batchSize * c.blockSize)
				r.bytes += n
				r.transfers += uint64(c.batchSize)
				total.Add(n)
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	close(done)
	if err := errors.Join(errs...); err != nil {
		return 0, err
	}
	var all result
	for _, r := range results {
		all.bytes += r.bytes
		all.transfers += r.transfers
		all.latencies = append(all.latencies, r.latencies...)
	}
	sort.Slice(all.latencies, func(i, j int) bool { return all.latencies[i] < all.latencies[j] })
	pct := func(p float64) time.Duration {
		if len(all.latencies) == 0 {
			return 0
		}
		return all.latencies[min(len(all.latencies)-1, int(p*float64(len(all.latencies))))]
	}
	gbps = float64(all.bytes) / elapsed.Seconds() / 1e9
	fmt.Printf("RESULT mode=%s op=%s block=%d batch=%d threads=%d gbps=%.3f transfers_per_s=%.0f p50_batch_us=%d p99_batch_us=%d bytes=%d seconds=%.2f z_raw_bytes=%d\n",
		c.mode, c.op, c.blockSize, c.batchSize, c.threads, gbps, float64(all.transfers)/elapsed.Seconds(),
		pct(0.50).Microseconds(), pct(0.99).Microseconds(), all.bytes, elapsed.Seconds(), zRaw()-zBefore)

	// Integrity, outside the timed loop: what each thread moved must hold
	// the pattern its source holds. A thread that did not wrap through its
	// share within the duration moved only the start of it; the rest of
	// the target holds whatever earlier runs left there, and is not checked.
	used, checked := per*uint64(c.threads), uint64(0)
	check := func(b []byte, seed uint64) error {
		for th, r := range results {
			base := uint64(th) * per
			if err := verify(b[base:base+r.covered], int(base), seed); err != nil {
				return err
			}
		}
		return nil
	}
	for _, r := range results {
		checked += r.covered
	}
	if op == engine.Write {
		back, err := e.AllocBuffer(int(used), "*")
		if err != nil {
			return 0, err
		}
		if err := moveAll(ctx, e, seg, engine.Read, engine.AddrOf(back), remote.Addr, used); err != nil {
			return 0, fmt.Errorf("read back for verification: %w", err)
		}
		if err := check(back, c.seed^0x5a5a); err != nil {
			return 0, fmt.Errorf("written data read back: %w", err)
		}
		if targetBuf != nil {
			if err := check(targetBuf[:used], c.seed^0x5a5a); err != nil {
				return 0, fmt.Errorf("target buffer: %w", err)
			}
		}
	} else if err := check(local[:used], c.seed); err != nil {
		return 0, fmt.Errorf("data read: %w", err)
	}
	fmt.Printf("integrity: ok (%d bytes checked)\n", checked)
	return gbps, nil
}

// moveAll moves n bytes in 4 MiB requests.
func moveAll(ctx context.Context, e *engine.Engine, seg *engine.Segment, op engine.Op, local, remote, n uint64) error {
	var reqs []engine.Request
	for off := uint64(0); off < n; off += 4 << 20 {
		reqs = append(reqs, engine.Request{Op: op, Local: local + off, Segment: seg, Remote: remote + off, Length: min(4<<20, n-off)})
	}
	_, err := e.Transfer(ctx, reqs)
	return err
}

// progress prints throughput every 5 seconds on runs of 10 seconds or more.
func progress(c config, total *atomic.Uint64, start time.Time, done chan struct{}) {
	every := c.progressEvery
	if every <= 0 {
		if c.duration < 10 {
			return
		}
		every = 5 * time.Second
	}
	tick := time.NewTicker(every)
	defer tick.Stop()
	last, lastT := uint64(0), start
	for {
		select {
		case <-done:
			return
		case now := <-tick.C:
			cur := total.Load()
			fmt.Fprintf(os.Stderr, "progress: %.0fs %.3f GB/s\n", now.Sub(start).Seconds(), float64(cur-last)/now.Sub(lastT).Seconds()/1e9)
			last, lastT = cur, now
		}
	}
}

// streamBuffer is the memory one raw-tcp stream cycles through on each side:
// the engine's per-thread share of --buffer-size.
func streamBuffer(c config) int {
	return max(c.bufferSize/c.threads/c.blockSize, 1) * c.blockSize
}

// runRawTCP measures plain loopback TCP: --threads streams, each writing
// --block-size writes while a reader reads them into a buffer.
func runRawTCP(c config) error {
	ln, err := net.Listen("tcp", net.JoinHostPort(c.host, "0"))
	if err != nil {
		return err
	}
	defer ln.Close()
	var got atomic.Uint64
	var rwg sync.WaitGroup
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			rwg.Add(1)
			go func() {
				defer rwg.Done()
				defer conn.Close()
				// Like the engine, land blocks at successive offsets of a
				// buffer as large as --buffer-size / --threads, so both
				// sides touch the same amount of memory.
				buf := make([]byte, streamBuffer(c))
				fill(buf, 0, 0) // fault the pages in before the clock runs
				for off := 0; ; off += c.blockSize {
					if off+c.blockSize > len(buf) {
						off = 0
					}
					n, err := io.ReadFull(conn, buf[off:off+c.blockSize])
					got.Add(uint64(n))
					if err != nil {
						return
					}
				}
			}()
		}
	}()
	fmt.Printf("kvferry-bench: mode=raw-tcp block=%d threads=%d duration=%gs\n", c.blockSize, c.threads, c.duration)
	stop := time.Now().Add(time.Duration(c.duration * float64(time.Second)))
	var wg sync.WaitGroup
	start := time.Now()
	errs := make([]error, c.threads)
	for th := 0; th < c.threads; th++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			conn, err := net.Dial("tcp", ln.Addr().String())
			if err != nil {
				errs[th] = err
				return
			}
			defer conn.Close()
			buf := make([]byte, streamBuffer(c))
			fill(buf, 0, c.seed)
			for off := 0; time.Now().Before(stop); off += c.blockSize {
				if off+c.blockSize > len(buf) {
					off = 0
				}
				if _, err := conn.Write(buf[off : off+c.blockSize]); err != nil {
					errs[th] = err
					return
				}
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	if err := errors.Join(errs...); err != nil {
		return err
	}
	rwg.Wait()
	fmt.Printf("RESULT mode=raw-tcp op=write block=%d threads=%d gbps=%.3f bytes=%d seconds=%.2f\n",
		c.blockSize, c.threads, float64(got.Load())/elapsed.Seconds()/1e9, got.Load(), elapsed.Seconds())
	return nil
}
