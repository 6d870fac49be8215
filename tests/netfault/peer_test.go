package netfault

import (
	"fmt"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/internal/childproc"
)

// The peer process, seen from the test process: it runs the commands
// peerproc_test.go describes.

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
	var ok bool
	if p.addr, ok = childproc.ParseBuffer(f[3:], cfg.size); !ok {
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

// replyNums checks that r is a want reply of skip fields and n numbers
// after its first field, and parses the numbers; what names the command
// in the error.
func replyNums(r reply, want, what string, skip, n int) ([]uint64, error) {
	if len(r.f) != 1+skip+n || r.f[0] != want {
		return nil, fmt.Errorf("peer answered %s with %v %q", what, r.f, r.msg)
	}
	return parseNums(r.f[1+skip:], n)
}

func abortOf(r reply) (abortResult, error) {
	v, err := replyNums(r, "aborted", "an abort", 0, 3)
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
	v, err := replyNums(r, "done", "a transfer", 1, 4)
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
