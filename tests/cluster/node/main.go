// Command node is one host of the simulated cluster of tests/cluster: a
// kvferry engine on the host's own address, whose segment metadata is in
// etcd, playing decode (it owns a buffer of pages that requests are written
// into) or prefill (it writes requests' KV into decode nodes' pages). The
// test drives it over stdin and stdout, one line per command and one per
// answer; commands run concurrently, so every answer starts with the
// command's name and the key it answers for.
//
// Decode:
//
//	reserve <rid> <npages>  -> reserve <rid> ok <corrupt> <addr,addr,...> | reserve <rid> full
//	verify <rid>            -> verify <rid> <good> <bad>
//	abort <rid> abort|fence <initiator>
//	                        -> abort <rid> safe|notsafe <ms> [reason]
//
// Prefill:
//
//	write <rid> <segment> <timeout_ms> <addr,addr,...>
//	                        -> write <rid> <status> <kind> <ms> [error]
//	open <segment> <timeout_ms>
//	                        -> open <segment> ok|err <ms> [error]
//
// The first line is "ready <role> <segment name> <engine's data transport>".
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/internal/wordpattern"
)

// Sentinel is what a free page holds: a page handed to a reservation must
// still hold it, else something wrote into it while it was free (a late
// write of an aborted request).
const sentinel = 0x5EA15EA15EA15EA1

func main() {
	role := flag.String("role", "", "decode or prefill")
	host := flag.String("host", "", "address to listen on")
	port := flag.Int("port", 7000, "control port")
	meta := flag.String("metadata", "", "etcd://host:port/prefix")
	bufMiB := flag.Int("buffer-mib", 64, "registered buffer, MiB")
	pageKiB := flag.Int("page-kib", 256, "page size, KiB")
	flag.Parse()

	e, err := engine.New(engine.Options{Host: *host, Port: *port, Protocol: "tcp", Metadata: *meta, IgnoreEnv: true})
	if err != nil {
		fmt.Fprintf(os.Stderr, "node %s: %v\n", *host, err)
		os.Exit(1)
	}
	defer e.Close()
	buf, err := e.AllocBuffer(*bufMiB<<20, "cpu")
	if err != nil {
		fmt.Fprintf(os.Stderr, "node %s: alloc: %v\n", *host, err)
		os.Exit(1)
	}
	n := &node{e: e, buf: buf, page: *pageKiB << 10, reqs: map[uint64][]int{}, how: map[uint64]string{}}
	n.last = make([]string, len(buf)/n.page)
	n.out = bufio.NewWriter(os.Stdout)
	switch *role {
	case "decode":
		for p := len(buf)/n.page - 1; p >= 0; p-- {
			n.fillSentinel(p)
			n.free = append(n.free, p)
		}
	case "prefill":
		// Source slots as large as the largest request: each write fills
		// its own, so concurrent writes never share source memory.
		n.slots = make(chan []byte, len(buf)/(8*n.page))
		for s := 0; s+8*n.page <= len(buf); s += 8 * n.page {
			n.slots <- buf[s : s+8*n.page]
		}
		n.segs = map[string]*engine.Segment{}
	default:
		fmt.Fprintf(os.Stderr, "node: -role must be decode or prefill, not %q\n", *role)
		os.Exit(2)
	}
	n.say("ready %s %s tcp", *role, e.Name())

	var wg sync.WaitGroup
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 0 {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			n.handle(f)
		}()
	}
	// Stdin closed: the test is done with us (or gone).
	wg.Wait()
}

type node struct {
	e    *engine.Engine
	buf  []byte
	page int

	outMu sync.Mutex
	out   *bufio.Writer

	mu   sync.Mutex
	free []int            // decode: free pages; the last is handed out first
	reqs map[uint64][]int // decode: pages of each reserved request
	last []string         // decode: per page, the request that held it last and how it ended
	how  map[uint64]string

	slots chan []byte // prefill: source slots
	segMu sync.Mutex
	segs  map[string]*engine.Segment // prefill: segments opened once, kept (as a serving framework keeps them)
}

func (n *node) say(format string, args ...any) {
	n.outMu.Lock()
	defer n.outMu.Unlock()
	fmt.Fprintf(n.out, format+"\n", args...)
	_ = n.out.Flush()
}

func (n *node) handle(f []string) {
	u := func(i int) uint64 {
		if i >= len(f) {
			return 0
		}
		v, _ := strconv.ParseUint(f[i], 10, 64)
		return v
	}
	switch f[0] {
	case "reserve":
		n.reserve(u(1), int(u(2)))
	case "verify":
		n.verify(u(1))
	case "abort":
		if len(f) < 4 {
			n.say("error bad command %q", strings.Join(f, " "))
			return
		}
		n.abort(u(1), f[2], f[3])
	case "write":
		if len(f) < 5 {
			n.say("error bad command %q", strings.Join(f, " "))
			return
		}
		n.write(u(1), f[2], time.Duration(u(3))*time.Millisecond, f[4])
	case "open":
		n.open(f[1], time.Duration(u(2))*time.Millisecond)
	default:
		n.say("error unknown command %q", f[0])
	}
}

func (n *node) pageBytes(p int) []byte { return n.buf[p*n.page : (p+1)*n.page] }

func (n *node) fillSentinel(p int) {
	w := wordpattern.Words(n.pageBytes(p))
	for i := range w {
		w[i] = sentinel
	}
}

// notSentinel counts the bytes of page p that differ from the sentinel.
func (n *node) notSentinel(p int) uint64 {
	var bad uint64
	for _, v := range wordpattern.Words(n.pageBytes(p)) {
		if v != sentinel {
			bad += wordpattern.DiffBytes(v, sentinel)
		}
	}
	return bad
}

// patternBase is the first word of page j of request rid (then +Step a word).
func patternBase(rid uint64, j int) uint64 {
	return wordpattern.Mix(rid ^ wordpattern.Mix(uint64(j)+1))
}

func (n *node) reserve(rid uint64, np int) {
	n.mu.Lock()
	if np <= 0 || np > len(n.free) {
		n.mu.Unlock()
		n.say("reserve %d full", rid)
		return
	}
	pages := append([]int(nil), n.free[len(n.free)-np:]...)
	n.free = n.free[:len(n.free)-np]
	n.reqs[rid] = pages
	n.mu.Unlock()
	var corrupt uint64
	var prev []string
	addrs := make([]string, len(pages))
	for i, p := range pages {
		if c := n.notSentinel(p); c > 0 {
			corrupt += c
			n.mu.Lock()
			prev = append(prev, fmt.Sprintf("page %d (last held by %s): %d bytes", p, n.last[p], c))
			n.mu.Unlock()
		}
		addrs[i] = strconv.FormatUint(engine.AddrOf(n.pageBytes(p)), 10)
	}
	n.say("reserve %d ok %d %s %s", rid, corrupt, strings.Join(addrs, ","), strings.Join(prev, "; "))
}

// release gives the pages back, holding the sentinel again, at the end of
// the free list: the next reservation takes them first, so a late write
// into them would be seen by its check or by its verify.
func (n *node) release(rid uint64) {
	n.mu.Lock()
	pages := n.reqs[rid]
	delete(n.reqs, rid)
	n.mu.Unlock()
	for _, p := range pages {
		n.fillSentinel(p)
	}
	n.mu.Lock()
	for _, p := range pages {
		n.last[p] = fmt.Sprintf("rid %d, %s", rid, n.how[rid])
	}
	delete(n.how, rid)
	n.free = append(n.free, pages...)
	n.mu.Unlock()
}

func (n *node) verify(rid uint64) {
	n.mu.Lock()
	pages, ok := n.reqs[rid]
	n.mu.Unlock()
	if !ok {
		n.say("verify %d 0 0 unknown", rid)
		return
	}
	var good, bad uint64
	for j, p := range pages {
		exp := patternBase(rid, j)
		for _, v := range wordpattern.Words(n.pageBytes(p)) {
			d := wordpattern.DiffBytes(v, exp)
			bad += d
			good += 8 - d
			exp += wordpattern.Step
		}
	}
	n.mu.Lock()
	n.how[rid] = "verified"
	n.mu.Unlock()
	n.release(rid)
	n.say("verify %d %d %d", rid, good, bad)
}

// abort stops request rid as the owner of its pages, by its request id or
// by fencing its pages, and frees them only when the engine says Safe:
// otherwise they stay out of use (a late write could still land there).
func (n *node) abort(rid uint64, how, initiator string) {
	n.mu.Lock()
	pages, ok := n.reqs[rid]
	n.mu.Unlock()
	if !ok {
		n.say("abort %d notsafe 0 unknown request", rid)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	start := time.Now()
	var safe bool
	var reason error
	var err error
	var unacked []string // planners told of the fence that did not acknowledge it within FenceGrace
	if how == "fence" {
		ranges := make([]engine.FenceRange, len(pages))
		for i, p := range pages {
			ranges[i] = engine.FenceRange{Addr: engine.AddrOf(n.pageBytes(p)), Len: uint64(n.page)}
		}
		var res engine.FenceResult
		res, err = n.e.Fence(ctx, ranges)
		safe, reason = res.Safe, res.Reason
		for _, told := range res.Told {
			if !slices.Contains(res.Acked, told) {
				unacked = append(unacked, told)
			}
		}
	} else {
		var res engine.AbortResult
		res, err = n.e.Abort(ctx, rid, []string{initiator})
		safe, reason = res.Safe, res.Reason
	}
	ms := time.Since(start).Milliseconds()
	switch {
	case err != nil:
		n.say("abort %d notsafe %d call failed: %v", rid, ms, oneLine(err))
	case !safe:
		n.say("abort %d notsafe %d %v", rid, ms, oneLine(reason))
	default:
		n.mu.Lock()
		n.how[rid] = how + " Safe after " + time.Since(start).String()
		n.mu.Unlock()
		// Said before the pages go back: the driver learns which
		// prefills missed the notice before any of them is written again.
		n.say("abort %d safe %d unacked=%s", rid, ms, strings.Join(unacked, ","))
		n.release(rid)
	}
}

func (n *node) segment(ctx context.Context, name string) (*engine.Segment, error) {
	n.segMu.Lock()
	s := n.segs[name]
	n.segMu.Unlock()
	if s != nil {
		return s, nil
	}
	s, err := n.e.OpenSegment(ctx, name)
	if err != nil {
		return nil, err
	}
	n.segMu.Lock()
	n.segs[name] = s
	n.segMu.Unlock()
	return s, nil
}

func (n *node) write(rid uint64, seg string, timeout time.Duration, list string) {
	start := time.Now()
	var addrs []uint64
	for _, a := range strings.Split(list, ",") {
		v, err := strconv.ParseUint(a, 10, 64)
		if err != nil {
			n.say("write %d failed badarg 0 %v", rid, err)
			return
		}
		addrs = append(addrs, v)
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	s, err := n.segment(ctx, seg)
	if err != nil {
		n.say("write %d failed %s %d %v", rid, kind(err), time.Since(start).Milliseconds(), oneLine(err))
		return
	}
	src := <-n.slots
	defer func() {
		if src != nil {
			n.slots <- src
		}
	}()
	reqs := make([]engine.Request, len(addrs))
	for j, a := range addrs {
		pg := src[j*n.page : (j+1)*n.page]
		wordpattern.Fill(pg, patternBase(rid, j), wordpattern.Step)
		reqs[j] = engine.Request{Op: engine.Write, Local: engine.AddrOf(pg), Segment: s, Remote: a,
			Length: uint64(n.page), RequestID: rid}
	}
	// Submit plans the transfers (their fence epoch is taken then); the
	// test fences a request's pages only after it heard "submitted", as a
	// decode fences only pages it told a writer about (SAFETY.md promise 7).
	b, err := n.e.AllocateBatch(len(reqs))
	if err != nil {
		n.say("write %d FAILED %s %d %v", rid, kind(err), time.Since(start).Milliseconds(), oneLine(err))
		return
	}
	if err := b.Submit(ctx, reqs); err != nil {
		n.say("submitted %d err", rid)
		_ = b.Cancel()
		_ = b.Free()
		n.say("write %d FAILED %s %d %v", rid, kind(err), time.Since(start).Milliseconds(), oneLine(err))
		return
	}
	n.say("submitted %d ok", rid)
	if err = b.Wait(ctx); err != nil {
		// Cancel returns once the engine no longer reads the source slot.
		if cerr := b.Cancel(); cerr != nil {
			n.say("write %d FAILED memoryinuse %d %v", rid, time.Since(start).Milliseconds(), oneLine(cerr))
			src = nil // never reused: the engine may still read it
			return
		}
	}
	res := b.Results()
	_ = b.Free()
	ms := time.Since(start).Milliseconds()
	// The request's status: COMPLETED only when every page did; else the
	// first page that did not, with its error.
	for _, r := range res {
		if r.Status != engine.Completed {
			e := r.Err
			if e == nil {
				e = err
			}
			n.say("write %d %s %s %d %v", rid, r.Status, kind(e), ms, oneLine(e))
			return
		}
	}
	if err != nil || len(res) != len(reqs) {
		n.say("write %d FAILED %s %d %v", rid, kind(err), ms, oneLine(err))
		return
	}
	n.say("write %d COMPLETED - %d", rid, ms)
}

func (n *node) open(seg string, timeout time.Duration) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	_, err := n.segment(ctx, seg)
	ms := time.Since(start).Milliseconds()
	if err != nil {
		n.say("open %s err %d %v", seg, ms, oneLine(err))
		return
	}
	n.say("open %s ok %d", seg, ms)
}

// kind names an error's class for the test's report.
func kind(err error) string {
	switch {
	case err == nil:
		return "none"
	case errors.Is(err, engine.ErrAborted):
		return "aborted"
	case errors.Is(err, engine.ErrFenced):
		return "fenced"
	case errors.Is(err, engine.ErrPeerDead):
		return "peerdead"
	case errors.Is(err, engine.ErrSegmentUnknown):
		return "segunknown"
	case errors.Is(err, engine.ErrRefused):
		return "refused"
	case errors.Is(err, engine.ErrUnreachable):
		return "unreachable"
	case errors.Is(err, engine.ErrConnection):
		return "connection"
	case errors.Is(err, engine.ErrTimeout), errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.Is(err, engine.ErrStaleKey):
		return "stalekey"
	case errors.Is(err, engine.ErrRemoteRange):
		return "remoterange"
	}
	return "other"
}

func oneLine(err error) string {
	if err == nil {
		return "<nil>"
	}
	return strings.ReplaceAll(err.Error(), "\n", " ")
}
