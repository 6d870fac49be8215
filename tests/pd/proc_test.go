package pd

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/internal/childproc"
	"github.com/kvferry/kvferry/internal/fakeverbs"
)

// outcome is the prefill's "done" line for one request.
type outcome struct {
	status string // a task status (COMPLETED, ABORTED, ...) or SUBMIT_FAILED
	moved  uint64 // bytes the prefill's engine confirmed landed
	tasks  int    // the request's tasks (a page of a layer each)
	fenced int    // tasks refused as fenced (engine.ErrFenced)
	others int    // tasks that did not complete for another reason
	line   string
}

// fencedOnly reports whether the request ended refused by a fence: some
// of its tasks fenced, every other one completed.
func (o outcome) fencedOnly() bool {
	return o.status == "FAILED" && o.fenced > 0 && o.others == 0
}

// prefillProc is the running prefill process, seen from decode: the
// bootstrap channel (its stdin and stdout) and its segment name.
type prefillProc struct {
	proc *childproc.Proc
	name string // its segment name

	mu      sync.Mutex
	waiters map[uint64]chan outcome
	planned map[uint64]chan struct{} // closed at the request's "planned" line
	strays  []string                 // lines that matched nothing: reported by finish

	bye chan string // the "bye" line
}

// startPrefill runs the test binary as the prefill process, tells it
// decode's segment name and waits for its own. The process is stopped
// (resumed if paused, stdin closed, killed if it lingers) when the test
// ends.
func startPrefill(t *testing.T, cfg prefillConfig, decodeName string) *prefillProc {
	t.Helper()
	p := &prefillProc{waiters: map[uint64]chan outcome{}, planned: map[uint64]chan struct{}{}, bye: make(chan string, 1)}
	p.proc = childproc.Start(t, childproc.Config{Name: "prefill", Env: cfg.env(), OnLine: p.dispatch})
	l := p.proc.First(t, 60*time.Second)
	f := strings.Fields(l)
	if len(f) != 2 || f[0] != "prefill" {
		t.Fatalf("prefill said %q first", l)
	}
	p.name = f[1]
	p.sendLine(t, "segment "+decodeName)
	return p
}

// startSlowPrefill slows the placement of rdma WRITEs at decode's
// devices to delayUs per 64 KiB (fakeverbs.SlowPlacement), so that they
// are certainly in flight when decode acts, and starts the prefill.
func startSlowPrefill(t *testing.T, cfg prefillConfig, d *engine.Engine, delayUs int) *prefillProc {
	t.Helper()
	fakeverbs.SlowPlacement(t, delayUs)
	return startPrefill(t, cfg, d.Name())
}

// exited is closed once the prefill's stdout ended.
func (p *prefillProc) exited() <-chan struct{} { return p.proc.Exited() }

// dispatch takes the prefill's stdout lines after the first: "done" lines
// go to the request's waiter, "planned" lines to the request's planned
// channel, "bye" to p.bye.
func (p *prefillProc) dispatch(l string) {
	f := strings.Fields(l)
	switch {
	case len(f) >= 7 && f[0] == "done":
		rid, err1 := strconv.ParseUint(f[1], 10, 64)
		moved, err2 := strconv.ParseUint(f[3], 10, 64)
		tasks, err3 := strconv.Atoi(f[4])
		fenced, err4 := strconv.Atoi(f[5])
		others, err5 := strconv.Atoi(f[6])
		p.mu.Lock()
		ch := p.waiters[rid]
		delete(p.waiters, rid)
		if pl := p.planned[rid]; pl != nil {
			close(pl) // a request that ended is planned, whatever it said
			delete(p.planned, rid)
		}
		if ch == nil || errors.Join(err1, err2, err3, err4, err5) != nil {
			p.strays = append(p.strays, l)
		}
		p.mu.Unlock()
		if ch != nil {
			ch <- outcome{status: f[2], moved: moved, tasks: tasks, fenced: fenced, others: others, line: l}
		}
	case len(f) == 2 && f[0] == "planned":
		rid, err := strconv.ParseUint(f[1], 10, 64)
		p.mu.Lock()
		if pl := p.planned[rid]; pl != nil && err == nil {
			close(pl)
			delete(p.planned, rid)
		} else {
			p.strays = append(p.strays, l)
		}
		p.mu.Unlock()
	case len(f) >= 1 && f[0] == "bye":
		p.bye <- l
	default:
		p.mu.Lock()
		p.strays = append(p.strays, l)
		p.mu.Unlock()
	}
}

func (p *prefillProc) sendLine(t *testing.T, l string) {
	if err := p.proc.Send(l); err != nil {
		t.Errorf("write to prefill: %v", err)
	}
}

// send asks the prefill to write request rid at gen into addrs (layer-major)
// and returns the channel its outcome arrives on.
func (p *prefillProc) send(t *testing.T, rid uint64, gen uint32, layers, pages, pageSize int, addrs []uint64) <-chan outcome {
	ch, _ := p.sendPlanned(t, rid, gen, layers, pages, pageSize, addrs)
	return ch
}

// sendPlanned is send, and also returns a channel closed once the prefill
// planned every transfer of the request (its "planned" line, or its end).
func (p *prefillProc) sendPlanned(t *testing.T, rid uint64, gen uint32, layers, pages, pageSize int, addrs []uint64) (<-chan outcome, <-chan struct{}) {
	ch, pl := make(chan outcome, 1), make(chan struct{})
	p.mu.Lock()
	p.waiters[rid] = ch
	p.planned[rid] = pl
	p.mu.Unlock()
	var sb strings.Builder
	fmt.Fprintf(&sb, "request %d %d %d %d %d", rid, gen, layers, pages, pageSize)
	for _, a := range addrs {
		sb.WriteByte(' ')
		sb.WriteString(strconv.FormatUint(a, 10))
	}
	p.sendLine(t, sb.String())
	return ch, pl
}

// finish closes the prefill's stdin, waits for its "bye" line and its exit,
// and returns the bye line's key=value pairs. Lines that matched no request
// are errors.
func (p *prefillProc) finish(t *testing.T, d time.Duration) map[string]int64 {
	t.Helper()
	p.proc.CloseStdin()
	var l string
	select {
	case l = <-p.bye:
	case <-time.After(d):
		t.Fatalf("prefill did not say bye within %v of its stdin closing", d)
	}
	if err := p.proc.Finish(t, d); err != nil {
		t.Errorf("prefill exited: %v", err)
	}
	p.mu.Lock()
	for _, s := range p.strays {
		t.Errorf("prefill said %q, which matched no request", s)
	}
	p.mu.Unlock()
	kv := map[string]int64{}
	for _, f := range strings.Fields(l)[1:] {
		k, v, ok := strings.Cut(f, "=")
		n, err := strconv.ParseInt(v, 10, 64)
		if !ok || err != nil {
			t.Errorf("prefill's bye line %q: bad field %q", l, f)
			continue
		}
		kv[k] = n
	}
	return kv
}
