package netfault

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/internal/childproc"
)

// The peer process's configuration travels in these variables.
const (
	sizeEnv  = "KVFERRY_NETFAULT_SIZE"  // bytes of its registered buffer
	sliceEnv = "KVFERRY_NETFAULT_SLICE" // Options.SliceSize (0: default)
	pathsEnv = "KVFERRY_NETFAULT_PATHS" // Options.PathsPerPeer (0: default)
	delayEnv = "KVFERRY_NETFAULT_DELAY" // Options.Testing.ApplyDelay, a Go duration
)

// poisonSeed fills a READ's destination before the READ, so that bytes
// that never arrived are told from the source's.
const poisonSeed = 0xdead_beef_0bad_f00d

// peerConfig configures a peer process.
type peerConfig struct {
	size         int
	slice, paths int
	applyDelay   time.Duration
}

func (c peerConfig) env() []string {
	return []string{roleEnv + "=peer", sizeEnv + "=" + strconv.Itoa(c.size), sliceEnv + "=" + strconv.Itoa(c.slice),
		pathsEnv + "=" + strconv.Itoa(c.paths), delayEnv + "=" + c.applyDelay.String()}
}

// options are an engine's options for c: tcp, whatever devices the machine
// has, and no KVFERRY_* variable.
func (c peerConfig) options() engine.Options {
	return engine.Options{IgnoreEnv: true, Protocol: "tcp", SliceSize: c.slice, PathsPerPeer: c.paths,
		Testing: engine.Testing{ApplyDelay: c.applyDelay}}
}

// ---------------------------------------------------------------------------
// The peer process.
//
// It prints "peer <segment name> <tcp data address> <buffer address>
// <buffer length>", then answers each line "<id> <verb> <args>..." on its
// stdin with a line "<id> <reply>..." (commands run concurrently; a quoted
// error or reason, when any, ends the reply):
//
//	fill <off> <len> <seed>                     ok
//	check <off> <len> <seed> <reuse seed>       checked <bad bytes> <reuse words> <first bad> <got> <want>
//	classify <off> <len> <seed>...              classified <words of each seed>... <mixed words> <other words>
//	open <segment> <deadline ms>                opened "<error>"
//	xfer <read|write> <segment> <rid> <gen> <local off> <remote addr> <len> <deadline ms> <seed> <reuse seed>
//	                                            done <status> <transferred> <took ns> <bad bytes> <reuse words> "<error>"
//	abort <initiator> <rid> <deadline ms> <off> <len> <seed>
//	                                            aborted <safe 0|1> <took ns> <generation> "<reason>"
//	stats                                       stats <key>=<value>...
//
// xfer WRITEs seed's pattern from its buffer, or READs into it (poisoned
// first) and checks what arrived against seed's pattern, counting words of
// reuse's apart. abort fills the range with seed's pattern once the abort
// is Safe, as an owner reuses the memory. At stdin's end it closes its
// engine and exits.

func runPeer() int {
	fail := func(format string, args ...any) int {
		fmt.Fprintf(os.Stderr, "netfault peer: "+format+"\n", args...)
		return 2
	}
	var cfg peerConfig
	var err error
	if cfg.size, err = strconv.Atoi(os.Getenv(sizeEnv)); err != nil || cfg.size <= 0 || cfg.size%8 != 0 {
		return fail("%s=%q", sizeEnv, os.Getenv(sizeEnv))
	}
	cfg.slice, _ = strconv.Atoi(os.Getenv(sliceEnv))
	cfg.paths, _ = strconv.Atoi(os.Getenv(pathsEnv))
	if cfg.applyDelay, err = time.ParseDuration(os.Getenv(delayEnv)); err != nil {
		return fail("%s=%q", delayEnv, os.Getenv(delayEnv))
	}
	e, err := engine.New(cfg.options())
	if err != nil {
		return fail("new engine: %v", err)
	}
	buf, err := e.AllocBuffer(cfg.size, "cpu")
	if err != nil {
		return fail("alloc: %v", err)
	}
	evDone := make(chan struct{})
	go func() { // an application takes its events
		defer close(evDone)
		for range e.Events() {
		}
	}()
	data, ok := e.Descriptor().Transport("tcp")
	if !ok {
		return fail("own descriptor names no tcp transport")
	}
	out := childproc.NewLineWriter(os.Stdout)
	out.Printf("peer %s %s %d %d", e.Name(), data, engine.AddrOf(buf), len(buf))

	pc := &peerCmds{e: e, buf: buf, segs: map[string]*engine.Segment{}}
	in := bufio.NewScanner(os.Stdin)
	var wg sync.WaitGroup
	for in.Scan() {
		f := strings.Fields(in.Text())
		if len(f) < 2 {
			return fail("line %q", in.Text())
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			out.Printf("%s %s", f[0], pc.do(f[1], f[2:]))
		}()
	}
	wg.Wait()
	if err := e.Close(); err != nil {
		return fail("close: %v", err)
	}
	<-evDone
	if err := e.FreeBuffer(engine.AddrOf(buf)); err != nil {
		return fail("free: %v", err)
	}
	return 0
}

// peerCmds runs the peer's commands.
type peerCmds struct {
	e   *engine.Engine
	buf []byte

	mu   sync.Mutex
	segs map[string]*engine.Segment
}

func (pc *peerCmds) do(verb string, a []string) string {
	var n []uint64 // a's numbers, where the verb takes numbers
	nums := func(from, count int) error {
		if len(a) != from+count {
			return fmt.Errorf("%s takes %d arguments, got %d", verb, from+count, len(a))
		}
		for _, s := range a[from:] {
			v, err := strconv.ParseUint(s, 10, 64)
			if err != nil {
				return err
			}
			n = append(n, v)
		}
		return nil
	}
	rng := func(off, length uint64) ([]byte, error) {
		if off%8 != 0 || length%8 != 0 || off > uint64(len(pc.buf)) || length > uint64(len(pc.buf))-off {
			return nil, fmt.Errorf("range [%d, +%d) of a %d-byte buffer", off, length, len(pc.buf))
		}
		return pc.buf[off : off+length : off+length], nil
	}
	// rangeArgs parses count numbers, the first two a range of the buffer,
	// and returns the range.
	rangeArgs := func(count int) ([]byte, error) {
		if err := nums(0, count); err != nil {
			return nil, err
		}
		return rng(n[0], n[1])
	}
	bad := func(err error) string { return fmt.Sprintf("error %q", err.Error()) }
	ms := func(v uint64) time.Duration { return time.Duration(v) * time.Millisecond }
	switch verb {
	case "fill":
		b, err := rangeArgs(3)
		if err != nil {
			return bad(err)
		}
		fillPattern(b, n[2])
		return "ok"
	case "check":
		b, err := rangeArgs(4)
		if err != nil {
			return bad(err)
		}
		m := checkPattern(b, n[2], n[3])
		return fmt.Sprintf("checked %d %d %d %d %d", m.bad, m.reuse, m.at, m.got, m.exp)
	case "classify":
		if len(a) < 3 {
			return bad(fmt.Errorf("classify takes a range and seeds"))
		}
		b, err := rangeArgs(len(a))
		if err != nil {
			return bad(err)
		}
		c := classify(b, n[2:])
		return "classified " + strings.Trim(fmt.Sprint(c), "[]")
	case "open":
		if err := nums(1, 1); err != nil {
			return bad(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), ms(n[0]))
		defer cancel()
		seg, err := pc.e.OpenSegment(ctx, a[0])
		msg := ""
		if err != nil {
			msg = err.Error()
		} else {
			pc.mu.Lock()
			pc.segs[a[0]] = seg
			pc.mu.Unlock()
		}
		return fmt.Sprintf("opened %q", msg)
	case "xfer":
		if err := nums(2, 8); err != nil {
			return bad(err)
		}
		op := engine.Read
		switch a[0] {
		case "read":
		case "write":
			op = engine.Write
		default:
			return bad(fmt.Errorf("op %q", a[0]))
		}
		pc.mu.Lock()
		seg := pc.segs[a[1]]
		pc.mu.Unlock()
		if seg == nil {
			return bad(fmt.Errorf("segment %s not opened", a[1]))
		}
		rid, gen, loff, raddr, length, deadline, seed, reuse := n[0], uint32(n[1]), n[2], n[3], n[4], ms(n[5]), n[6], n[7]
		local, err := rng(loff, length)
		if err != nil {
			return bad(err)
		}
		if op == engine.Write {
			fillPattern(local, seed)
		} else {
			fillPattern(local, poisonSeed)
		}
		ctx, cancel := context.WithTimeout(context.Background(), deadline)
		defer cancel()
		start := time.Now()
		res, err := pc.e.Transfer(ctx, []engine.Request{{Op: op, Local: engine.AddrOf(local), Segment: seg,
			Remote: raddr, Length: length, RequestID: rid, Generation: gen}})
		took := time.Since(start)
		status, moved := "SUBMIT_FAILED", uint64(0)
		if len(res) == 1 {
			status, moved = res[0].Status.String(), res[0].Transferred
		}
		var m mismatch
		if op == engine.Read {
			m = checkPattern(local, seed, reuse)
		}
		msg := ""
		if err != nil {
			msg = err.Error()
		}
		return fmt.Sprintf("done %s %d %d %d %d %q", status, moved, took.Nanoseconds(), m.bad, m.reuse, msg)
	case "abort":
		if err := nums(1, 5); err != nil {
			return bad(err)
		}
		rid, deadline := n[0], ms(n[1])
		reuse, err := rng(n[2], n[3])
		if err != nil {
			return bad(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), deadline)
		defer cancel()
		start := time.Now()
		ar, err := pc.e.Abort(ctx, rid, []string{a[0]})
		took := time.Since(start)
		if err == nil && ar.Safe {
			fillPattern(reuse, n[4])
		}
		safe, reason := 0, ""
		switch {
		case err != nil:
			reason = err.Error()
		case ar.Safe:
			safe = 1
		case ar.Reason != nil:
			reason = ar.Reason.Error()
		}
		return fmt.Sprintf("aborted %d %d %d %q", safe, took.Nanoseconds(), ar.Generation, reason)
	case "stats":
		st := pc.e.Stats()
		fds, _ := os.ReadDir("/proc/self/fd")
		return fmt.Sprintf("stats owner_in=%d owner_out=%d refused=%d refused_in_flight=%d aborts_safe=%d aborts_not_safe=%d "+
			"abort_acks=%d control_conns=%d tasks_aborted=%d tasks_in_flight=%d retries=%d fds=%d goroutines=%d",
			st.OwnerBytesIn, st.OwnerBytesOut, st.OwnerRefused, st.RefusedInFlight, st.AbortsSafe, st.AbortsNotSafe,
			st.AbortAcks, st.ControlConns, st.TasksAborted, st.TasksInFlight, st.Retries, len(fds)-1, runtime.NumGoroutine())
	}
	return bad(fmt.Errorf("unknown verb %q", verb))
}
