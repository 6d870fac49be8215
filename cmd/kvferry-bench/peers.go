package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvferry/kvferry/engine"
)

// Peers mode: what peers cost one engine, the subject. The subject is a
// process of its own, so that /proc describes it alone; its peers are
// engines of the bench process. Each peer writes to the subject and the
// subject to each peer, so every pair has paths dialed both ways, as
// between prefill and decode. The KVFERRY_* variables given to the bench
// reach the subject and the peers alike (no engine sets IgnoreEnv):
// KVFERRY_HEARTBEAT_MS, KVFERRY_IDLE_HEARTBEAT_MS, KVFERRY_PATHS_PER_PEER
// and the like change what is measured.

// What the bench and the subject move, and how long it lets things settle.
const (
	peerBufSize   = 4 << 20  // each engine's buffer
	peerWriteSize = 64 << 10 // what each side writes to the other, once per round
	// peerSettle is left between the last transfer and the first window,
	// so that what the transfers set going (completions, goroutines
	// ending) is not counted as background traffic.
	peerSettle = 500 * time.Millisecond
	// peerMargin is added to the computed ping times: a ping is an
	// exchange of messages, not an instant.
	peerMargin = 250 * time.Millisecond
)

// peerSettings are the engine settings that decide what is measured and
// when. The bench reads the KVFERRY_* variables the engines read, with
// the engines' defaults, as the engine does not report its options.
type peerSettings struct {
	heartbeat     time.Duration // HeartbeatInterval: peers in use are pinged this often
	idleHeartbeat time.Duration // IdleHeartbeatInterval: peers unused this long are pinged this often
	pathIdle      time.Duration // PathIdleTimeout: paths unused this long are closed
	perHost       int           // ControlMaxConnsPerHost: control connections the subject takes from one address
	paths         int           // PathsPerPeer: the paths each side dials to the other
}

// peerEngineOptions are the options of the subject and of every peer:
// tcp, with --paths when given. KVFERRY_* variables override them, in the
// engine.
func peerEngineOptions(c config) engine.Options {
	o := engine.Options{Host: c.host, Protocol: "tcp", LogLevel: slog.LevelWarn}
	if c.pathsGiven {
		o.PathsPerPeer = c.pathCount
	}
	return o
}

// peerSettingsFromEnv returns the settings; paths is --paths when given.
func peerSettingsFromEnv(paths int) (peerSettings, error) {
	t := peerSettings{heartbeat: time.Second, idleHeartbeat: 15 * time.Second, pathIdle: time.Minute, perHost: 256, paths: 4}
	if paths > 0 {
		t.paths = paths
	}
	for _, v := range []struct {
		name string
		d    *time.Duration
	}{{"KVFERRY_HEARTBEAT_MS", &t.heartbeat}, {"KVFERRY_IDLE_HEARTBEAT_MS", &t.idleHeartbeat}, {"KVFERRY_PATH_IDLE_MS", &t.pathIdle}} {
		if s := os.Getenv(v.name); s != "" {
			ms, err := strconv.Atoi(s)
			if err != nil || ms <= 0 {
				return t, fmt.Errorf("%s=%q: want a positive number of milliseconds", v.name, s)
			}
			*v.d = time.Duration(ms) * time.Millisecond
		}
	}
	for _, v := range []struct {
		name string
		n    *int
	}{{"KVFERRY_CONTROL_MAX_CONNS_PER_HOST", &t.perHost}, {"KVFERRY_PATHS_PER_PEER", &t.paths}} {
		if s := os.Getenv(v.name); s != "" {
			n, err := strconv.Atoi(s)
			if err != nil || n <= 0 {
				return t, fmt.Errorf("%s=%q: want a positive count", v.name, s)
			}
			*v.n = n
		}
	}
	// As the engine does: an idle peer is never pinged more often than
	// one in use.
	t.idleHeartbeat = max(t.idleHeartbeat, t.heartbeat)
	return t, nil
}

// runPeers measures, for each N of --peers and for no peer at all, the
// subject's memory, descriptors, threads and goroutines with N peers, and
// the bytes its read and write system calls move while no transfer runs:
// the heartbeats and other background control traffic, in two windows.
//
// The in-use window (--idle seconds, a whole number of heartbeat
// intervals) follows the last transfer: every peer is pinged each
// HeartbeatInterval. The idle window (one IdleHeartbeatInterval) starts
// once every peer has gone unused for IdleHeartbeatInterval: each engine
// then pings each peer once in it. A window of whole ping periods holds
// the same number of each pinger's pings whatever their phase; a shorter
// one would count the burst of idle pings wholly or not at all.
func runPeers(c config) error {
	counts, err := parsePeerCounts(c.peerCounts)
	if err != nil {
		return err
	}
	if c.peerWindow <= 0 {
		return fmt.Errorf("--idle %g: want a positive number of seconds", c.peerWindow)
	}
	var paths int
	if c.pathsGiven {
		paths = c.pathCount
	}
	t, err := peerSettingsFromEnv(paths)
	if err != nil {
		return err
	}
	if t.idleHeartbeat < 3*t.heartbeat {
		return fmt.Errorf("peers mode tells peers in use from idle ones: IdleHeartbeatInterval (%v) must be at least 3 HeartbeatIntervals (%v)", t.idleHeartbeat, t.heartbeat)
	}
	most := slices.Max(counts)
	if most > t.perHost {
		return fmt.Errorf("--peers %d: every peer connects from %s, and the subject takes at most %d control connections from one address (KVFERRY_CONTROL_MAX_CONNS_PER_HOST)", most, c.host, t.perHost)
	}
	if err := checkPeerFDs(most, t.paths); err != nil {
		return err
	}
	inUse := time.Duration(c.peerWindow * float64(time.Second)).Truncate(t.heartbeat)
	inUse = max(inUse, t.heartbeat)

	printPeersHeader(c, t, inUse)
	fmt.Printf("%6s %8s %9s %6s %8s %7s %6s %8s %10s %8s %8s %8s\n", "peers", "RSS MiB", "KiB/peer", "fds", "fds/peer",
		"threads", "gorout", "gor/peer", "B/s in use", "per peer", "B/s idle", "per peer")
	points := make([]peerPoint, 0, len(counts)+1)
	for _, n := range append([]int{0}, counts...) {
		p, err := measurePeersChecked(c, n, t, inUse)
		if err != nil {
			return fmt.Errorf("%d peers: %w", n, err)
		}
		points = append(points, p)
		base := points[0]
		fmt.Printf("%6d %8.1f %9s %6d %8s %7d %6d %8s %10.0f %8s %8.0f %8s\n", n, p.rssKiB/1024, perPeer(n, p.rssKiB, base.rssKiB),
			p.fds, perPeer(n, float64(p.fds), float64(base.fds)), p.threads,
			p.goroutines, perPeer(n, float64(p.goroutines), float64(base.goroutines)),
			p.inUseBps, perPeer(n, p.inUseBps, base.inUseBps), p.idleBps, perPeer(n, p.idleBps, base.idleBps))
	}

	fmt.Printf("\nwhere it goes, in the subject, at the end of the in-use window (KiB per peer; counts of the whole subject):\n")
	fmt.Printf("%6s %8s %9s %9s %9s %9s %9s %6s %7s %6s %6s %6s %7s %12s %10s %7s\n", "peers", "anon MiB", "anon/peer", "heap/peer",
		"stck/peer", "go/peer", "rest/peer", "paths", "trimmed", "data", "ctl in", "ctlout", "refused", "pings in use", "pings idle", "setup s")
	base := points[0]
	for _, p := range points {
		pings := func(v float64, w time.Duration) string {
			if p.n == 0 {
				return "-"
			}
			return fmt.Sprintf("%.1f/%gs", v, w.Seconds())
		}
		fmt.Printf("%6d %8.1f %9s %9s %9s %9s %9s %6d %7d %6d %6d %6d %7d %12s %10s %7.1f\n", p.n, p.anonKiB/1024,
			perPeer(p.n, p.anonKiB, base.anonKiB), perPeer(p.n, p.heapKiB, base.heapKiB), perPeer(p.n, p.stackKiB, base.stackKiB),
			perPeer(p.n, p.goKiB, base.goKiB), perPeer(p.n, p.anonKiB-p.goKiB, base.anonKiB-base.goKiB),
			p.paths, p.trimmed, p.dataConns, p.controlIn, p.controlOut, p.refused,
			pings(p.inUsePings, p.inUseWindow), pings(p.idlePings, p.idleWindow), p.setup.Seconds())
	}
	fmt.Printf("  anon: RssAnon (status): RSS less the mapped program and libraries and the buffer (shared memory).\n" +
		"  heap, stck: runtime.MemStats HeapInuse, StackInuse after a collection; go: Sys - HeapReleased, all the Go\n" +
		"  runtime holds (heap, stacks, spare heap, GC metadata), resident or not; rest: anon - go, about the memory\n" +
		"  outside Go's (libzmq's connections and queues). Go grows its heap in steps: with few peers these are noise.\n" +
		"  paths: the subject's dialed paths (Stats.OpenPaths); trimmed: its paths it closed as idle since it started\n" +
		"  (IdlePaths, PathIdleTimeout); data: data connections peers' paths hold to it; ctl in, ctlout: control\n" +
		"  connections peers hold to it, and its own to peers; refused: control connections it refused (per-address cap).\n" +
		"  pings: the subject's pings per peer in each window (each peer sends as many the other way);\n" +
		"  setup s: from the subject's start to the last transfer, peer engines' start included.\n")
	for _, p := range points {
		if p.trimmed > 0 {
			fmt.Printf("note: from %d peers on, the subject keeps %d of its %d paths once nothing is in flight, closing the\n"+
				"  rest at its next heartbeat (IdlePaths): those rows show peers with paths trimmed, not peers all transferring at once.\n",
				p.n, p.paths, p.n*t.paths)
			break
		}
	}
	for _, p := range points {
		if p.refused > 0 {
			fmt.Printf("note: with %d peers the subject refused %d control connection attempts: all peers connect from one\n"+
				"  address, whose cap (%d) this count reaches; ctl in shows the connections it held.\n", p.n, p.refused, t.perHost)
		}
	}
	return nil
}

func printPeersHeader(c config, t peerSettings, inUse time.Duration) {
	args := make([]string, 0, len(os.Args))
	for _, a := range os.Args[1:] {
		if strings.ContainsAny(a, " \t\"'") {
			a = strconv.Quote(a)
		}
		args = append(args, a)
	}
	fmt.Printf("kvferry-bench %s\n", strings.Join(args, " "))
	env := 0
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "KVFERRY_") {
			fmt.Println("  env", kv)
			env++
		}
	}
	if env == 0 {
		fmt.Println("  env: no KVFERRY_* variable (engine defaults)")
	}
	fmt.Printf("subject: one engine (tcp, %s) in a process of its own, started afresh for each row; peers: engines of the bench\n"+
		"process. Each peer WRITEs %d KiB to the subject and the subject to each peer, %d times (one per path: all paths dialed\n"+
		"both ways). PathsPerPeer %d, HeartbeatInterval %v, IdleHeartbeatInterval %v, PathIdleTimeout %v.\n",
		c.host, peerWriteSize>>10, max(t.paths, 2), t.paths, t.heartbeat, t.idleHeartbeat, t.pathIdle)
	fmt.Printf("Columns, all of the subject process:\n" +
		"  RSS MiB: VmRSS (/proc/<pid>/status); fds: entries of /proc/<pid>/fd; threads: Threads (status);\n" +
		"  gorout: runtime.NumGoroutine(); all taken at the end of the in-use window.\n")
	fmt.Printf("  B/s in use: bytes its read and write system calls moved per second (/proc/<pid>/io rchar+wchar: payload,\n"+
		"    not TCP/IP headers or ACKs) in a window of %v starting %v after the last transfer: every peer pinged each\n"+
		"    HeartbeatInterval, both ways (the subject pings each peer, each peer pings the subject).\n", inUse, peerSettle)
	fmt.Printf("  B/s idle: the same over one IdleHeartbeatInterval (%v) that starts once every peer has gone unused that\n"+
		"    long: each side pings the other once in it. Row 0 has no peer to go idle: its idle figure is its in-use one.\n"+
		"  per peer: (value with N peers - value with none) / N.\n"+
		"  Packets are not counted: the kernel counts them per network namespace, not per process.\n\n", t.idleHeartbeat)
}

func perPeer(n int, v, base float64) string {
	if n == 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f", (v-base)/float64(n))
}

func parsePeerCounts(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 || n > 4096 {
			return nil, fmt.Errorf("--peers %q: want a comma list of counts from 1 to 4096", s)
		}
		out = append(out, n)
	}
	return out, nil
}

// peerFDs is about how many descriptors n peer engines of paths paths a
// peer hold in the bench process: each its listeners, epoll and event
// descriptors and buffer's memfd, its paths to the subject and the
// subject's to it, and a control connection each way (21 measured with 4
// paths), with room to spare. The subject needs fewer per peer, in a
// process of its own.
func peerFDs(n, paths int) uint64 { return uint64(n*(16+2*paths) + 256) }

// checkPeerFDs fails, before anything starts, when this process may run
// out of descriptors with n peer engines. Go raises the soft limit to the
// hard one at start-up, so the soft limit read here is what there is.
func checkPeerFDs(n, paths int) error {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		return fmt.Errorf("read the file descriptor limit: %w", err)
	}
	if need := peerFDs(n, paths); lim.Cur < need {
		return fmt.Errorf("the file descriptor limit is %d (hard %d); %d peer engines in this process need about %d: raise it (ulimit -n) or measure fewer --peers",
			lim.Cur, lim.Max, n, need)
	}
	return nil
}

// peerPoint is what was measured with n peers.
type peerPoint struct {
	n                              int
	rssKiB, anonKiB, goKiB         float64
	fds, threads, goroutines       int
	inUseBps, idleBps              float64
	heapKiB, stackKiB              float64
	paths, dataConns               int // the subject's dialed paths and accepted data connections
	controlIn, controlOut          int // control connections peers hold to the subject, and the subject's to them
	refused, trimmed               int // control connections the subject refused; its paths it closed as idle
	inUsePings, idlePings          float64
	inUseWindow, idleWindow, setup time.Duration
}

// measurePeersChecked measures n peers and then checks that this process
// is back where it was: the peers are closed and their goroutines and
// descriptors gone, so that the next row starts clean. Leftovers would
// not touch the next subject (a fresh process) but would burden this
// one, which runs the next peers; they are reported, not fatal.
func measurePeersChecked(c config, n int, t peerSettings, inUse time.Duration) (peerPoint, error) {
	g0, f0 := runtime.NumGoroutine(), selfFDs()
	p, err := measurePeers(c, n, t, inUse)
	if err != nil {
		return p, err
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		g, f := runtime.NumGoroutine(), selfFDs()
		if g <= g0 && f <= f0 {
			break
		}
		if time.Now().After(deadline) {
			fmt.Fprintf(os.Stderr, "kvferry-bench: after the %d-peer row this process still has %d goroutines and %d descriptors more than before it\n",
				n, g-g0, f-f0)
			break
		}
		time.Sleep(50 * time.Millisecond) // polling for the closed engines' goroutines to end
	}
	return p, nil
}

func selfFDs() int {
	ents, _ := os.ReadDir("/proc/self/fd")
	return len(ents)
}

// measurePeers starts a subject and n peers, measures the subject and
// closes them all.
func measurePeers(c config, n int, t peerSettings, inUse time.Duration) (p peerPoint, err error) {
	p.n = n
	s, err := startPeerSubject(c)
	if err != nil {
		return p, err
	}
	defer func() {
		if qerr := s.quit(); err == nil && qerr != nil {
			err = qerr
		}
	}()
	ctx := context.Background()
	start := time.Now()
	peers, err := startPeers(ctx, c, n, s)
	defer closePeers(peers)
	if err != nil {
		return p, err
	}
	// Each pair has been used once, one pair after the other. Each
	// transfer starts on the next of a segment's PathsPerPeer paths, so
	// more rounds, all pairs at once, dial every path both ways, as
	// sustained traffic between prefill and decode does. The last round
	// makes the pairs' last use nearly the same instant: they go idle
	// together and the windows below hold whole ping periods of every
	// pair.
	var used0 time.Time
	for range max(t.paths-1, 1) {
		used0 = time.Now()
		if err := touchPeers(ctx, peers, s); err != nil {
			return p, err
		}
	}
	used1 := time.Now()
	p.setup = used1.Sub(start)

	// In use: the window must end before the first pair goes idle, that
	// is IdleHeartbeatInterval after its last use less a heartbeat (a
	// ping already due at that tick).
	p.inUseWindow = inUse
	if n > 0 {
		fit := used0.Add(t.idleHeartbeat - t.heartbeat - peerMargin).Sub(used1.Add(peerSettle))
		if fit < p.inUseWindow {
			p.inUseWindow = max(fit.Truncate(t.heartbeat), t.heartbeat)
			fmt.Fprintf(os.Stderr, "kvferry-bench: %d peers: the in-use window is cut to %v to end before the peers go idle\n", n, p.inUseWindow)
		}
	}
	sleepUntil(used1.Add(peerSettle))
	st0, err := s.stats()
	if err != nil {
		return p, err
	}
	if p.inUseBps, err = ioRate(s.pid(), p.inUseWindow); err != nil {
		return p, err
	}
	if p.rssKiB, p.anonKiB, p.threads, err = procStatus(s.pid()); err != nil {
		return p, err
	}
	if p.fds, err = countFDs(s.pid()); err != nil {
		return p, err
	}
	st1, err := s.stats()
	if err != nil {
		return p, err
	}
	p.goroutines = int(st1["goroutines"])
	p.heapKiB, p.stackKiB, p.goKiB = float64(st1["heap"])/1024, float64(st1["stacks"])/1024, float64(st1["gosys"])/1024
	p.paths, p.dataConns = int(st1["paths"]), int(st1["dataconns"])
	p.controlIn, p.controlOut = int(st1["controlconns"]), int(st1["controlpeers"])
	if n == 0 {
		p.idleBps, p.idleWindow = p.inUseBps, p.inUseWindow
		return p, nil
	}
	p.inUsePings = float64(st1["heartbeats"]-st0["heartbeats"]) / float64(n)

	// Idle: a pair's last in-use ping falls within a heartbeat before
	// IdleHeartbeatInterval after its last use, its first idle ping
	// IdleHeartbeatInterval after that, give or take a heartbeat. The
	// window, one IdleHeartbeatInterval long, starts after the last
	// in-use ping of every pair and ends after the first idle ping of
	// every pair and before the second of any.
	if spread := used1.Sub(used0); spread+2*t.heartbeat+peerMargin >= t.idleHeartbeat {
		return p, fmt.Errorf("the last round of transfers took %v: too long to measure one idle ping of each pair within IdleHeartbeatInterval (%v)", spread, t.idleHeartbeat)
	}
	sleepUntil(used1.Add(t.idleHeartbeat + t.heartbeat + peerMargin))
	p.idleWindow = t.idleHeartbeat
	st0, err = s.stats()
	if err != nil {
		return p, err
	}
	if p.idleBps, err = ioRate(s.pid(), p.idleWindow); err != nil {
		return p, err
	}
	st1, err = s.stats()
	if err != nil {
		return p, err
	}
	p.idlePings = float64(st1["heartbeats"]-st0["heartbeats"]) / float64(n)
	p.refused, p.trimmed = int(st1["controlrefused"]), int(st1["pathsclosed"])
	return p, nil
}

// sleepUntil waits for t: the engines' heartbeat schedule is a matter of
// time, so waiting it out is what is measured.
func sleepUntil(t time.Time) {
	if d := time.Until(t); d > 0 {
		time.Sleep(d)
	}
}

// peer is one peer engine of the bench process and its segment of the
// subject.
type peer struct {
	e       *engine.Engine
	buf     []byte
	subject *engine.Segment
}

// startPeers starts n peer engines; each opens the subject and writes to
// it, and the subject opens each and writes to it. On error the peers
// started so far are returned too, for the caller to close.
func startPeers(ctx context.Context, c config, n int, s *peerSubject) ([]*peer, error) {
	peers := make([]*peer, 0, n)
	for range n {
		e, err := engine.New(peerEngineOptions(c))
		if err != nil {
			return peers, fmt.Errorf("start peer %d: %w", len(peers), err)
		}
		p := &peer{e: e}
		peers = append(peers, p)
		if p.buf, err = e.AllocBuffer(peerBufSize, "cpu"); err != nil {
			return peers, fmt.Errorf("peer %s: %w", e.Name(), err)
		}
	}
	err := forEachPeer(peers, func(i int, p *peer) error {
		seg, err := p.e.OpenSegment(ctx, s.name)
		if err != nil {
			return fmt.Errorf("peer %s: open the subject: %w", p.e.Name(), err)
		}
		p.subject = seg
		return p.writeSubject(ctx, i, s)
	})
	if err != nil {
		return peers, err
	}
	for _, p := range peers {
		if _, err := s.ask(fmt.Sprintf("open %s %x", p.e.Name(), engine.AddrOf(p.buf))); err != nil {
			return peers, err
		}
	}
	return peers, nil
}

// writeSubject writes peerWriteSize bytes to the subject, at a place of
// the subject's buffer that depends on i, so that peers writing at once
// write to different bytes.
func (p *peer) writeSubject(ctx context.Context, i int, s *peerSubject) error {
	remote := s.buf + uint64(i%(peerBufSize/peerWriteSize))*peerWriteSize
	if err := writeOnce(ctx, p.e, p.buf[:peerWriteSize], p.subject, remote); err != nil {
		return fmt.Errorf("peer %s: write to the subject: %w", p.e.Name(), err)
	}
	return nil
}

// touchPeers has every peer write to the subject and the subject to
// every peer, all at once.
func touchPeers(ctx context.Context, peers []*peer, s *peerSubject) error {
	if len(peers) == 0 {
		return nil
	}
	done := make(chan error, 1)
	go func() { _, err := s.ask("touch"); done <- err }()
	err := forEachPeer(peers, func(i int, p *peer) error { return p.writeSubject(ctx, i, s) })
	return errors.Join(err, <-done)
}

// forEachPeer runs f for every peer at once and returns their errors.
func forEachPeer(peers []*peer, f func(i int, p *peer) error) error {
	errs := make([]error, len(peers))
	var wg sync.WaitGroup
	for i, p := range peers {
		wg.Go(func() { errs[i] = f(i, p) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// closePeers closes the peer engines, all at once, and frees their
// buffers, which outlive Close.
func closePeers(peers []*peer) {
	_ = forEachPeer(peers, func(_ int, p *peer) error {
		_ = p.e.Close()
		if p.buf != nil {
			_ = p.e.FreeBuffer(engine.AddrOf(p.buf))
		}
		return nil
	})
}

// writeOnce writes local to remote in seg and waits for it.
func writeOnce(ctx context.Context, e *engine.Engine, local []byte, seg *engine.Segment, remote uint64) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	res, err := e.Transfer(ctx, []engine.Request{{Op: engine.Write, Local: engine.AddrOf(local), Segment: seg, Remote: remote, Length: uint64(len(local))}})
	if err != nil {
		return err
	}
	if res[0].Status != engine.Completed {
		return fmt.Errorf("%v: %w", res[0].Status, res[0].Err)
	}
	return nil
}

// ioRate returns the bytes per second the process's read and write system
// calls moved during d.
func ioRate(pid int, d time.Duration) (float64, error) {
	a, err := procIO(pid)
	if err != nil {
		return 0, err
	}
	start := time.Now()
	time.Sleep(d) // the measurement window
	b, err := procIO(pid)
	if err != nil {
		return 0, err
	}
	return float64(b-a) / time.Since(start).Seconds(), nil
}

// procIO returns rchar+wchar of the process: the bytes all its read and
// write system calls moved, sockets and pipes included.
func procIO(pid int) (uint64, error) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/io", pid))
	if err != nil {
		return 0, fmt.Errorf("read the subject's io counters: %w", err)
	}
	var total uint64
	for _, line := range strings.Split(string(raw), "\n") {
		k, v, ok := strings.Cut(line, ": ")
		if ok && (k == "rchar" || k == "wchar") {
			n, err := strconv.ParseUint(v, 10, 64)
			if err != nil {
				return 0, fmt.Errorf("/proc/%d/io: %s: %w", pid, k, err)
			}
			total += n
		}
	}
	return total, nil
}

// procStatus reads VmRSS, RssAnon (KiB) and Threads of the process.
func procStatus(pid int) (rssKiB, anonKiB float64, threads int, err error) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, 0, 0, fmt.Errorf("read the subject's status: %w", err)
	}
	for _, line := range strings.Split(string(raw), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		switch f[0] {
		case "VmRSS:":
			rssKiB, _ = strconv.ParseFloat(f[1], 64)
		case "RssAnon:":
			anonKiB, _ = strconv.ParseFloat(f[1], 64)
		case "Threads:":
			threads, _ = strconv.Atoi(f[1])
		}
	}
	return rssKiB, anonKiB, threads, nil
}

func countFDs(pid int) (int, error) {
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		return 0, fmt.Errorf("count the subject's descriptors: %w", err)
	}
	return len(ents), nil
}

// peerSubject is the subject process, driven over its stdin and stdout.
type peerSubject struct {
	cmd  *exec.Cmd
	in   io.WriteCloser
	out  *bufio.Scanner
	name string // its segment
	buf  uint64 // its buffer's address
}

// startPeerSubject starts this program as the subject (--mode
// peers-subject) and reads its first line: its segment and buffer.
func startPeerSubject(c config) (*peerSubject, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("find this program to start the subject: %w", err)
	}
	args := []string{"--mode", "peers-subject", "--host", c.host}
	if c.pathsGiven {
		args = append(args, "--paths", strconv.Itoa(c.pathCount))
	}
	cmd := exec.Command(exe, args...)
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start the subject: %w", err)
	}
	s := &peerSubject{cmd: cmd, in: in, out: bufio.NewScanner(out)}
	if !s.out.Scan() {
		_ = s.quit()
		return nil, fmt.Errorf("the subject ended before it was ready")
	}
	if _, err := fmt.Sscanf(s.out.Text(), "subject %s %x", &s.name, &s.buf); err != nil {
		_ = s.quit()
		return nil, fmt.Errorf("the subject said %q", s.out.Text())
	}
	return s, nil
}

func (s *peerSubject) pid() int { return s.cmd.Process.Pid }

// ask sends one command and returns the subject's answer, once it has
// carried the command out.
func (s *peerSubject) ask(line string) (string, error) {
	if _, err := fmt.Fprintln(s.in, line); err != nil {
		return "", fmt.Errorf("subject: %s: %w", line, err)
	}
	if !s.out.Scan() {
		return "", fmt.Errorf("subject: %s: it ended (%v)", line, s.out.Err())
	}
	reply := s.out.Text()
	if msg, ok := strings.CutPrefix(reply, "error "); ok {
		return "", fmt.Errorf("subject: %s: %s", line, msg)
	}
	return reply, nil
}

// stats asks the subject for its "stats" line as a map.
func (s *peerSubject) stats() (map[string]int64, error) {
	reply, err := s.ask("stats")
	if err != nil {
		return nil, err
	}
	f := strings.Fields(reply)
	if len(f) == 0 || f[0] != "stats" {
		return nil, fmt.Errorf("subject: stats: it said %q", reply)
	}
	m := make(map[string]int64, len(f)-1)
	for _, kv := range f[1:] {
		k, v, _ := strings.Cut(kv, "=")
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("subject: stats: %q: %w", kv, err)
		}
		m[k] = n
	}
	return m, nil
}

// quit tells the subject to close its engine and end, and reaps it; one
// that does not end in time is killed.
func (s *peerSubject) quit() error {
	_, err := s.ask("quit")
	_ = s.in.Close() // EOF ends a subject that missed the command
	done := make(chan error, 1)
	go func() { done <- s.cmd.Wait() }()
	select {
	case werr := <-done:
		if err == nil && werr != nil {
			err = fmt.Errorf("subject: %w", werr)
		}
	case <-time.After(20 * time.Second):
		_ = s.cmd.Process.Kill()
		<-done
		if err == nil {
			err = errors.New("subject: did not end within 20 s of quit; killed")
		}
	}
	return err
}

// runPeersSubject is the subject of peers mode: one engine with a buffer,
// whose segment and buffer address it prints first ("subject <segment>
// <hex addr>"). It then carries out commands read from stdin, one a line,
// and answers each once it is done:
//
//	open <segment> <hex addr>  open the segment and WRITE 64 KiB to addr: "ok"
//	touch                      WRITE 64 KiB to every opened segment, all at once: "ok"
//	stats                      "stats goroutines=N heartbeats=N ..." (see below)
//	quit                       "ok", then close the engine and end (as at EOF)
//
// A command that fails is answered "error <why>". Like the peers, the
// engine reads the KVFERRY_* variables.
func runPeersSubject(c config) error {
	e, err := engine.New(peerEngineOptions(c))
	if err != nil {
		return err
	}
	defer e.Close()
	buf, err := e.AllocBuffer(peerBufSize, "cpu")
	if err != nil {
		return err
	}
	fmt.Printf("subject %s %x\n", e.Name(), engine.AddrOf(buf))
	type opened struct {
		seg  *engine.Segment
		addr uint64
	}
	var segs []opened
	ctx := context.Background()
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		switch {
		case len(f) == 3 && f[0] == "open":
			addr, err := strconv.ParseUint(f[2], 16, 64)
			if err != nil {
				answerError(fmt.Errorf("open: address %q: %w", f[2], err))
				continue
			}
			seg, err := e.OpenSegment(ctx, f[1])
			if err == nil {
				err = writeOnce(ctx, e, buf[:peerWriteSize], seg, addr)
			}
			if err != nil {
				answerError(fmt.Errorf("open %s: %w", f[1], err))
				continue
			}
			segs = append(segs, opened{seg, addr})
			fmt.Println("ok")
		case len(f) == 1 && f[0] == "touch":
			errs := make([]error, len(segs))
			var wg sync.WaitGroup
			for i, s := range segs {
				wg.Go(func() { errs[i] = writeOnce(ctx, e, buf[:peerWriteSize], s.seg, s.addr) })
			}
			wg.Wait()
			if err := errors.Join(errs...); err != nil {
				answerError(fmt.Errorf("touch: %w", err))
				continue
			}
			fmt.Println("ok")
		case len(f) == 1 && f[0] == "stats":
			// A collection first, so that the heap figure is what is
			// live rather than what awaits collection.
			runtime.GC()
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			st := e.Stats()
			fmt.Printf("stats goroutines=%d heartbeats=%d paths=%d dataconns=%d controlconns=%d controlpeers=%d "+
				"controlrefused=%d controlcut=%d pathsclosed=%d heap=%d stacks=%d gosys=%d\n",
				runtime.NumGoroutine(), st.Heartbeats, st.OpenPaths, st.DataConns, st.ControlConns, st.ControlPeers,
				st.ControlConnsRefused, st.ControlConnsCut, st.PathsClosedIdle, ms.HeapInuse, ms.StackInuse, ms.Sys-ms.HeapReleased)
		case len(f) == 1 && f[0] == "quit":
			fmt.Println("ok")
			return nil
		default:
			answerError(fmt.Errorf("unknown command %q", sc.Text()))
		}
	}
	return sc.Err()
}

// answerError answers a command with its error, on one line as the
// parent reads one line per command.
func answerError(err error) {
	fmt.Println("error", strings.ReplaceAll(err.Error(), "\n", "; "))
}
