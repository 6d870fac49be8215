package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvferry/kvferry/engine"
)

// runPeers measures what peers cost one engine (the subject, a process of
// its own): its memory, file descriptors, threads and goroutines, and the
// bytes its read and write system calls move while no transfer runs (the
// heartbeats and other background control traffic), with N peers for each
// N of --peers. Each peer and the subject write 64 KiB to each other first,
// so every path both ways has been dialed, as between prefill and decode.
// The traffic is measured twice: right after the transfers (the peers in
// use: pinged every HeartbeatInterval) and once they count as idle (after
// IdleHeartbeatInterval: pinged that seldom). KVFERRY_* variables reach the
// subject and the peers (KVFERRY_IDLE_HEARTBEAT_MS, KVFERRY_HEARTBEAT_MS...).
func runPeers(c config) error {
	counts, err := parsePeerCounts(c.peerCounts)
	if err != nil {
		return err
	}
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err == nil {
		// Each peer engine here holds a few listeners, its paths and
		// control sockets: about 16 descriptors.
		if need := uint64(slicesMax(counts))*24 + 256; lim.Cur < need {
			return fmt.Errorf("the file descriptor limit is %d; %d peers need about %d (ulimit -n)", lim.Cur, slicesMax(counts), need)
		}
	}
	idleAfter := 15 * time.Second
	if v := os.Getenv("KVFERRY_IDLE_HEARTBEAT_MS"); v != "" {
		if ms, err := strconv.Atoi(v); err == nil && ms > 0 {
			idleAfter = time.Duration(ms) * time.Millisecond
		}
	}
	window := time.Duration(c.peerWindow * float64(time.Second))
	fmt.Printf("kvferry-bench --mode peers --peers %s --idle %g (host %s, tcp)\n", c.peerCounts, c.peerWindow, c.host)
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "KVFERRY_") {
			fmt.Println("  env", kv)
		}
	}
	fmt.Printf("subject: one engine in a process of its own; each peer an engine of this process. Columns:\n" +
		"  RSS, fds, threads: /proc/<subject>/status and fd; goroutines: runtime.NumGoroutine in the subject;\n" +
		"  B/s in use, idle: bytes the subject's read and write system calls moved per second (/proc/<subject>/io\n" +
		"  rchar+wchar) in a window with no transfer, right after the transfers (--idle s) and after IdleHeartbeatInterval\n" +
		"  (for IdleHeartbeatInterval + 1 s at least);\n" +
		"  fds idle: at the end of the idle window (paths idle past PathIdleTimeout are closed by then);\n" +
		"  per peer: (value at N - value with no peer) / N.\n\n")
	fmt.Printf("%6s %9s %9s %6s %8s %7s %6s %8s %10s %9s %10s %9s %9s\n", "peers", "RSS MiB", "KiB/peer", "fds", "fds/peer", "threads",
		"gorout", "gor/peer", "B/s in use", "per peer", "B/s idle", "per peer", "fds idle")
	var base peerPoint
	for i, n := range append([]int{0}, counts...) {
		p, err := measurePeers(c, n, window, idleAfter)
		if err != nil {
			return fmt.Errorf("%d peers: %w", n, err)
		}
		if i == 0 {
			base = p
		}
		per := func(v, b float64) string {
			if n == 0 {
				return "-"
			}
			return fmt.Sprintf("%.1f", (v-b)/float64(n))
		}
		fmt.Printf("%6d %9.1f %9s %6d %8s %7d %6d %8s %10.0f %9s %10.0f %9s %9d\n", n, p.rssKiB/1024, per(p.rssKiB, base.rssKiB),
			p.fds, per(float64(p.fds), float64(base.fds)), p.threads, p.goroutines, per(float64(p.goroutines), float64(base.goroutines)),
			p.busyBps, per(p.busyBps, base.busyBps), p.idleBps, per(p.idleBps, base.idleBps), p.idleFDs)
	}
	return nil
}

func slicesMax(v []int) int {
	m := 0
	for _, x := range v {
		m = max(m, x)
	}
	return m
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

type peerPoint struct {
	rssKiB           float64
	fds, threads     int
	idleFDs          int // at the end of the idle window: paths closed past PathIdleTimeout
	goroutines       int
	busyBps, idleBps float64
}

// peerSubject is the subject process, driven over its stdin and stdout.
type peerSubject struct {
	cmd  *exec.Cmd
	in   io.WriteCloser
	out  *bufio.Scanner
	name string
	buf  uint64
}

func (s *peerSubject) ask(line string) (string, error) {
	if _, err := fmt.Fprintln(s.in, line); err != nil {
		return "", err
	}
	if !s.out.Scan() {
		return "", fmt.Errorf("the subject ended (%v)", s.out.Err())
	}
	reply := s.out.Text()
	if strings.HasPrefix(reply, "error ") {
		return "", fmt.Errorf("subject: %s", reply)
	}
	return reply, nil
}

func measurePeers(c config, n int, window, idleAfter time.Duration) (peerPoint, error) {
	exe, err := os.Executable()
	if err != nil {
		return peerPoint{}, err
	}
	cmd := exec.Command(exe, "--mode", "peers-subject", "--host", c.host)
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		return peerPoint{}, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return peerPoint{}, err
	}
	if err := cmd.Start(); err != nil {
		return peerPoint{}, err
	}
	s := &peerSubject{cmd: cmd, in: in, out: bufio.NewScanner(out)}
	defer func() {
		_ = in.Close() // EOF ends the subject
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	}()
	if !s.out.Scan() {
		return peerPoint{}, fmt.Errorf("the subject did not start")
	}
	if _, err := fmt.Sscanf(s.out.Text(), "subject %s %x", &s.name, &s.buf); err != nil {
		return peerPoint{}, fmt.Errorf("the subject said %q", s.out.Text())
	}
	ctx := context.Background()
	peers := make([]*engine.Engine, 0, n)
	defer func() {
		for _, p := range peers {
			_ = p.Close()
		}
	}()
	for range n {
		p, err := engine.New(engine.Options{Host: c.host, Protocol: "tcp"})
		if err != nil {
			return peerPoint{}, err
		}
		peers = append(peers, p)
		b, err := p.AllocBuffer(1<<20, "cpu")
		if err != nil {
			return peerPoint{}, err
		}
		seg, err := p.OpenSegment(ctx, s.name)
		if err != nil {
			return peerPoint{}, err
		}
		if _, err := p.Transfer(ctx, []engine.Request{{Op: engine.Write, Local: engine.AddrOf(b), Segment: seg, Remote: s.buf, Length: 64 << 10}}); err != nil {
			return peerPoint{}, err
		}
		if _, err := s.ask(fmt.Sprintf("open %s %x", p.Name(), engine.AddrOf(b))); err != nil {
			return peerPoint{}, err
		}
	}
	used := time.Now()
	var pt peerPoint
	// Settled: the goroutines the transfers started have ended.
	if pt.busyBps, err = ioRate(cmd.Process.Pid, window); err != nil {
		return pt, err
	}
	if pt.rssKiB, pt.threads, err = procStatus(cmd.Process.Pid); err != nil {
		return pt, err
	}
	if pt.fds, err = countFDs(cmd.Process.Pid); err != nil {
		return pt, err
	}
	reply, err := s.ask("stats")
	if err != nil {
		return pt, err
	}
	if _, err := fmt.Sscanf(reply, "goroutines %d", &pt.goroutines); err != nil {
		return pt, fmt.Errorf("the subject said %q", reply)
	}
	// Idle: past IdleHeartbeatInterval since the last transfer, and one
	// heartbeat tick more.
	if wait := time.Until(used.Add(idleAfter + 2*time.Second)); wait > 0 {
		time.Sleep(wait) // the engines' idle threshold is a time: waiting it out is what is measured
	}
	// Idle segments are pinged once per IdleHeartbeatInterval, all at
	// about the same moment here (they went idle together): a shorter
	// window would catch or miss those bursts by chance.
	if pt.idleBps, err = ioRate(cmd.Process.Pid, max(window, idleAfter+time.Second)); err != nil {
		return pt, err
	}
	if pt.idleFDs, err = countFDs(cmd.Process.Pid); err != nil {
		return pt, err
	}
	return pt, nil
}

// ioRate returns the bytes per second the process's read and write system
// calls moved during d.
func ioRate(pid int, d time.Duration) (float64, error) {
	a, err := procIO(pid)
	if err != nil {
		return 0, err
	}
	start := time.Now()
	time.Sleep(d) // a measurement window
	b, err := procIO(pid)
	if err != nil {
		return 0, err
	}
	return float64(b-a) / time.Since(start).Seconds(), nil
}

func procIO(pid int) (uint64, error) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/io", pid))
	if err != nil {
		return 0, err
	}
	var total uint64
	for _, line := range strings.Split(string(raw), "\n") {
		k, v, ok := strings.Cut(line, ": ")
		if ok && (k == "rchar" || k == "wchar") {
			n, _ := strconv.ParseUint(v, 10, 64)
			total += n
		}
	}
	return total, nil
}

func procStatus(pid int) (rssKiB float64, threads int, err error) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, 0, err
	}
	for _, line := range strings.Split(string(raw), "\n") {
		f := strings.Fields(line)
		if len(f) >= 2 && f[0] == "VmRSS:" {
			rssKiB, _ = strconv.ParseFloat(f[1], 64)
		}
		if len(f) >= 2 && f[0] == "Threads:" {
			threads, _ = strconv.Atoi(f[1])
		}
	}
	return rssKiB, threads, nil
}

func countFDs(pid int) (int, error) {
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	return len(ents), err
}

// runPeersSubject is the subject of peers mode: one engine, driven over
// stdin ("open <segment> <hex addr>": open it and write 64 KiB there;
// "stats": its goroutine count), answering one line per command, until
// stdin ends.
func runPeersSubject(c config) error {
	e, err := engine.New(engine.Options{Host: c.host, Protocol: "tcp"})
	if err != nil {
		return err
	}
	defer e.Close()
	buf, err := e.AllocBuffer(4<<20, "cpu")
	if err != nil {
		return err
	}
	fmt.Printf("subject %s %x\n", e.Name(), engine.AddrOf(buf))
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		switch {
		case len(f) == 3 && f[0] == "open":
			addr, _ := strconv.ParseUint(f[2], 16, 64)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			seg, err := e.OpenSegment(ctx, f[1])
			if err == nil {
				var res []engine.TaskResult
				res, err = e.Transfer(ctx, []engine.Request{{Op: engine.Write, Local: engine.AddrOf(buf), Segment: seg, Remote: addr, Length: 64 << 10}})
				if err == nil && res[0].Status != engine.Completed {
					err = res[0].Err
				}
			}
			cancel()
			if err != nil {
				fmt.Println("error", err)
				continue
			}
			fmt.Println("ok")
		case len(f) == 1 && f[0] == "stats":
			runtime.GC()
			fmt.Printf("goroutines %d\n", runtime.NumGoroutine())
		default:
			fmt.Println("error unknown command", sc.Text())
		}
	}
	return nil
}
