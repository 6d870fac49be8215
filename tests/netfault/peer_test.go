package netfault

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
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
	bad := func(err error) string { return fmt.Sprintf("error %q", err.Error()) }
	ms := func(v uint64) time.Duration { return time.Duration(v) * time.Millisecond }
	switch verb {
	case "fill":
		if err := nums(0, 3); err != nil {
			return bad(err)
		}
		b, err := rng(n[0], n[1])
		if err != nil {
			return bad(err)
		}
		fillPattern(b, n[2])
		return "ok"
	case "check":
		if err := nums(0, 4); err != nil {
			return bad(err)
		}
		b, err := rng(n[0], n[1])
		if err != nil {
			return bad(err)
		}
		m := checkPattern(b, n[2], n[3])
		return fmt.Sprintf("checked %d %d %d %d %d", m.bad, m.reuse, m.at, m.got, m.exp)
	case "classify":
		if len(a) < 3 {
			return bad(fmt.Errorf("classify takes a range and seeds"))
		}
		if err := nums(0, len(a)); err != nil {
			return bad(err)
		}
		b, err := rng(n[0], n[1])
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

// ---------------------------------------------------------------------------
// The peer, seen from the test process.

// peer is a running peer process.
type peer struct {
	t    *testing.T
	proc *childproc.Proc
	name string // its segment name
	data string // its tcp data-plane address, from its own descriptor
	addr uint64 // its buffer
	size int

	mu      sync.Mutex
	nextID  int
	waiters map[int]chan reply
	strays  []string
}

// reply is a peer's answer: its fields, and the quoted message that ends
// it, if any.
type reply struct {
	f   []string
	msg string
}

// startPeer runs a peer process and waits for its first line. It is
// stopped (resumed if paused, stdin closed, killed if it lingers) when the
// test ends, and killed if the test process dies first.
func startPeer(t *testing.T, cfg peerConfig) *peer {
	t.Helper()
	p := &peer{t: t, size: cfg.size, waiters: map[int]chan reply{}}
	p.proc = childproc.Start(t, childproc.Config{Name: "peer", Env: cfg.env(), KillWithParent: true, OnLine: p.dispatch})
	l := p.proc.First(t, 60*time.Second)
	f := strings.Fields(l)
	if len(f) != 5 || f[0] != "peer" {
		t.Fatalf("peer said %q first", l)
	}
	p.name, p.data = f[1], f[2]
	var err error
	if p.addr, err = strconv.ParseUint(f[3], 10, 64); err != nil {
		t.Fatalf("peer said %q", l)
	}
	if n, err := strconv.Atoi(f[4]); err != nil || n != cfg.size {
		t.Fatalf("peer said %q", l)
	}
	return p
}

// exited is closed once the peer's stdout ended.
func (p *peer) exited() <-chan struct{} { return p.proc.Exited() }

// dispatch hands a line of the peer (after its first) to its command's
// waiter.
func (p *peer) dispatch(l string) {
	head, msg := l, ""
	if i := strings.IndexByte(l, '"'); i >= 0 {
		head = l[:i]
		var err error
		if msg, err = strconv.Unquote(l[i:]); err != nil {
			msg = l[i:]
		}
	}
	f := strings.Fields(head)
	id := -1
	if len(f) > 0 {
		id, _ = strconv.Atoi(f[0])
	}
	p.mu.Lock()
	ch := p.waiters[id]
	delete(p.waiters, id)
	if ch == nil {
		p.strays = append(p.strays, l)
	}
	p.mu.Unlock()
	if ch != nil {
		ch <- reply{f: f[1:], msg: msg}
	}
}

// async sends a command and returns the channel its reply arrives on.
func (p *peer) async(format string, args ...any) <-chan reply {
	ch := make(chan reply, 1)
	p.mu.Lock()
	p.nextID++
	id := p.nextID
	p.waiters[id] = ch
	p.mu.Unlock()
	if err := p.proc.Send(fmt.Sprintf("%d "+format, append([]any{id}, args...)...)); err != nil {
		p.t.Errorf("write to peer: %v", err)
	}
	return ch
}

// await waits for a reply of the peer; ok is false when the peer exited
// first or d passed.
func (p *peer) await(ch <-chan reply, d time.Duration) (reply, bool) {
	select {
	case r := <-ch:
		return r, true
	case <-p.exited():
		select {
		case r := <-ch:
			return r, true
		default:
			return reply{}, false
		}
	case <-time.After(d):
		return reply{}, false
	}
}

// try sends a command and waits for its reply, which must start with
// want, for at most two minutes.
func (p *peer) try(want string, format string, args ...any) (reply, error) {
	r, ok := p.await(p.async(format, args...), 2*time.Minute)
	if !ok {
		return r, fmt.Errorf("peer: no reply to %q", fmt.Sprintf(format, args...))
	}
	if len(r.f) == 0 || r.f[0] != want {
		return r, fmt.Errorf("peer answered %q with %v %q, want %s", fmt.Sprintf(format, args...), r.f, r.msg, want)
	}
	return r, nil
}

// call is try, failing the test on an error.
func (p *peer) call(want string, format string, args ...any) reply {
	p.t.Helper()
	r, err := p.try(want, format, args...)
	if err != nil {
		p.t.Fatal(err)
	}
	return r
}

func (p *peer) fill(off, n int, seed uint64) {
	p.t.Helper()
	p.call("ok", "fill %d %d %d", off, n, seed)
}

func (p *peer) check(off, n int, seed, reuse uint64) mismatch {
	p.t.Helper()
	m, err := p.tryCheck(off, n, seed, reuse)
	if err != nil {
		p.t.Fatal(err)
	}
	return m
}

func (p *peer) tryCheck(off, n int, seed, reuse uint64) (mismatch, error) {
	r, err := p.try("checked", "check %d %d %d %d", off, n, seed, reuse)
	if err != nil {
		return mismatch{}, err
	}
	v, err := parseNums(r.f[1:], 5)
	if err != nil {
		return mismatch{}, err
	}
	return mismatch{bad: v[0], reuse: v[1], at: int(int64(v[2])), got: v[3], exp: v[4]}, nil
}

// classify counts the words of [off, +n) of the peer's buffer that are
// each seed's pattern, those whose bytes each are one of the seeds', and
// the others (see classify).
func (p *peer) classify(off, n int, seeds ...uint64) []uint64 {
	p.t.Helper()
	args := fmt.Sprintf("classify %d %d", off, n)
	for _, s := range seeds {
		args += " " + strconv.FormatUint(s, 10)
	}
	r := p.call("classified", "%s", args)
	return nums(p.t, r.f[1:], len(seeds)+2)
}

func (p *peer) open(name string, deadline time.Duration) {
	p.t.Helper()
	if r := p.call("opened", "open %s %d", name, deadline.Milliseconds()); r.msg != "" {
		p.t.Fatalf("peer: open segment %s: %s", name, r.msg)
	}
}

// abortResult is a peer's abort.
type abortResult struct {
	safe   bool
	took   time.Duration
	gen    uint32
	reason string
}

// abort has the peer abort rid naming initiator, with deadline, and fill
// [off, +n) of its buffer with seed's pattern once the abort is Safe.
func (p *peer) abort(rid uint64, deadline time.Duration, initiator string, off, n int, seed uint64) (abortResult, error) {
	r, ok := p.await(p.async("abort %s %d %d %d %d %d", initiator, rid, deadline.Milliseconds(), off, n, seed), 2*time.Minute)
	if !ok {
		return abortResult{}, fmt.Errorf("peer: no reply to the abort of %d", rid)
	}
	return abortOf(r)
}

func abortOf(r reply) (abortResult, error) {
	if len(r.f) != 4 || r.f[0] != "aborted" {
		return abortResult{}, fmt.Errorf("peer answered an abort with %v %q", r.f, r.msg)
	}
	v, err := parseNums(r.f[1:], 3)
	if err != nil {
		return abortResult{}, err
	}
	return abortResult{safe: v[0] == 1, took: time.Duration(v[1]), gen: uint32(v[2]), reason: r.msg}, nil
}

// xferResult is a peer's transfer.
type xferResult struct {
	status      string
	transferred uint64
	took        time.Duration
	bad, reuse  uint64 // READ: bytes that are not seed's pattern; words of reuse's pattern
	err         string
}

// xfer has the peer READ or WRITE [raddr, +n) of segment from [loff, +n)
// of its buffer as request rid, with deadline; the result arrives on the
// channel, or nothing when the peer dies first.
func (p *peer) xfer(op engine.Op, segment string, rid uint64, loff int, raddr uint64, n int, deadline time.Duration, seed, reuse uint64) <-chan reply {
	verb := "read"
	if op == engine.Write {
		verb = "write"
	}
	return p.async("xfer %s %s %d 0 %d %d %d %d %d %d", verb, segment, rid, loff, raddr, n, deadline.Milliseconds(), seed, reuse)
}

// awaitXfer waits up to d for a transfer's result, failing the test when
// none comes.
func (p *peer) awaitXfer(ch <-chan reply, d time.Duration) xferResult {
	p.t.Helper()
	r, ok := p.await(ch, d)
	if !ok {
		p.t.Fatalf("peer: no transfer result within %v", d)
	}
	x, err := xferOf(r)
	if err != nil {
		p.t.Fatal(err)
	}
	return x
}

func xferOf(r reply) (xferResult, error) {
	if len(r.f) != 6 || r.f[0] != "done" {
		return xferResult{}, fmt.Errorf("peer answered a transfer with %v %q", r.f, r.msg)
	}
	v, err := parseNums(r.f[2:], 4)
	if err != nil {
		return xferResult{}, err
	}
	return xferResult{status: r.f[1], transferred: v[0], took: time.Duration(v[1]), bad: v[2], reuse: v[3], err: r.msg}, nil
}

func (p *peer) stats() map[string]int64 {
	p.t.Helper()
	r := p.call("stats", "stats")
	kv := map[string]int64{}
	for _, f := range r.f[1:] {
		k, v, ok := strings.Cut(f, "=")
		n, err := strconv.ParseInt(v, 10, 64)
		if !ok || err != nil {
			p.t.Fatalf("peer stats field %q", f)
		}
		kv[k] = n
	}
	return kv
}

// ports are the peer's control-plane port (its segment name's) and its tcp
// data-plane port (its descriptor's).
func (p *peer) ports() []int {
	p.t.Helper()
	return []int{portOf(p.t, p.name), portOf(p.t, p.data)}
}

// signal sends sig to the peer; for SIGSTOP it waits until the process is
// stopped, so that nothing it does afterwards can be mistaken for what it
// did before.
func (p *peer) signal(sig syscall.Signal) {
	p.t.Helper()
	p.proc.Signal(p.t, sig)
}

// finish closes the peer's stdin and waits for it to exit cleanly.
func (p *peer) finish() {
	p.t.Helper()
	if err := p.proc.Finish(p.t, 30*time.Second); err != nil {
		p.t.Errorf("peer exited: %v", err)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, s := range p.strays {
		p.t.Errorf("peer said %q, which answered no command", s)
	}
}

func nums(t *testing.T, f []string, n int) []uint64 {
	t.Helper()
	v, err := parseNums(f, n)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// parseNums parses n numbers; a negative one ("first bad" is -1 when
// nothing is bad) as its two's complement.
func parseNums(f []string, n int) ([]uint64, error) {
	if len(f) != n {
		return nil, fmt.Errorf("want %d numbers, got %v", n, f)
	}
	v := make([]uint64, n)
	for i, s := range f {
		var err error
		if v[i], err = strconv.ParseUint(s, 10, 64); err != nil {
			x, err2 := strconv.ParseInt(s, 10, 64)
			if err2 != nil {
				return nil, fmt.Errorf("number %q: %v", s, err)
			}
			v[i] = uint64(x)
		}
	}
	return v, nil
}

// ---------------------------------------------------------------------------
// The test process's own engine.

// newEngine makes an engine for the test, closed when it ends; its events
// are taken as an application would.
func newEngine(t *testing.T, o engine.Options) *engine.Engine {
	t.Helper()
	o.IgnoreEnv, o.Protocol = true, "tcp"
	e, err := engine.New(o)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range e.Events() {
		}
	}()
	t.Cleanup(func() {
		_ = e.Close()
		<-done
	})
	return e
}

// alloc allocates registered memory of e, freed when the test ends.
func alloc(t *testing.T, e *engine.Engine, size int) []byte {
	t.Helper()
	b, err := e.AllocBuffer(size, "cpu")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.FreeBuffer(engine.AddrOf(b)) })
	return b
}

func openSegment(t *testing.T, e *engine.Engine, name string) *engine.Segment {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := e.OpenSegment(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// transfer runs reqs within d and fails the test unless all completed.
func transfer(t *testing.T, e *engine.Engine, d time.Duration, reqs ...engine.Request) time.Duration {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	start := time.Now()
	res, err := e.Transfer(ctx, reqs)
	took := time.Since(start)
	if err != nil {
		t.Fatalf("transfer of %d requests: %v after %v (%s)", len(reqs), err, took, summarize(res))
	}
	return took
}

// summarize counts results by status.
func summarize(res []engine.TaskResult) string {
	n := map[string]int{}
	for _, r := range res {
		n[r.Status.String()]++
	}
	return fmt.Sprint(n)
}

func req(op engine.Op, local []byte, seg *engine.Segment, remote uint64) engine.Request {
	return engine.Request{Op: op, Local: engine.AddrOf(local), Segment: seg, Remote: remote, Length: uint64(len(local))}
}

// waitFor polls cond until it holds or d passed, and reports whether it
// held.
func waitFor(d time.Duration, cond func() bool) bool {
	return childproc.Poll(d, 2*time.Millisecond, cond)
}

// lateness keeps, per kind of call, the most a call returned past its
// deadline.
type lateness struct {
	mu    sync.Mutex
	max   map[string]time.Duration
	calls map[string]int
}

func (l *lateness) add(kind string, took, deadline time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.max == nil {
		l.max, l.calls = map[string]time.Duration{}, map[string]int{}
	}
	l.calls[kind]++
	if late := took - deadline; late > l.max[kind] || l.calls[kind] == 1 {
		l.max[kind] = late
	}
}

// worst is the most any call returned past its deadline.
func (l *lateness) worst() time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	w := time.Duration(-1 << 63)
	for _, v := range l.max {
		w = max(w, v)
	}
	return w
}

func (l *lateness) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var parts []string
	for k, v := range l.max {
		if v > 0 {
			parts = append(parts, fmt.Sprintf("%s: %d calls, the latest %v past its deadline", k, l.calls[k], v.Round(time.Microsecond)))
		} else {
			parts = append(parts, fmt.Sprintf("%s: %d calls, all by their deadline (the latest %v before it)", k, l.calls[k], (-v).Round(time.Microsecond)))
		}
	}
	slices.Sort(parts)
	return strings.Join(parts, "; ")
}
