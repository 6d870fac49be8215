package cluster

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Traffic: requests of 1 to 8 pages of 256 KiB from a random prefill to a
// random decode, workers of them at a time; of every hundred, abortPct
// aborted and fencePct fenced by their decode at a random moment.
const (
	workers      = 6
	maxPages     = 8
	abortPct     = 7
	fencePct     = 3
	writeTimeout = 8 * time.Second
	recoverLimit = 30 * time.Second
)

// phase counts what happened while it ran.
type phase struct {
	name string
	mu   sync.Mutex

	requests, completed    int
	bytesMoved, bytesVerif uint64
	failed, expected       int
	byUs, byFault          int // the expected failures: of requests we aborted or fenced, of requests a fault touched
	// lateNotice counts failures refused as fenced from a prefill that had
	// not acknowledged an earlier fence of that decode within FenceGrace:
	// its first transfer planned under the old epoch is refused, as
	// documented (FenceResult.Told/Acked), and it learns the epoch then.
	lateNotice             int
	unexpected             []string
	aborts, abortsSafe     int
	fences, fencesSafe     int
	cleanups, cleanupsSafe int // aborts of requests that failed, to take their pages back
	corrupted              uint64
	full, decodeDown       int
	failKinds              map[string]int
	notes                  []string
}

func (p *phase) add(f func(p *phase)) {
	p.mu.Lock()
	defer p.mu.Unlock()
	f(p)
}

func (p *phase) note(format string, args ...any) {
	p.add(func(p *phase) { p.notes = append(p.notes, fmt.Sprintf(format, args...)) })
}

// driver runs the traffic and knows which hosts are under a fault: a
// failure of a request touching such a host is expected.
type driver struct {
	t   *testing.T
	tp  *topo
	rid atomic.Uint64

	mu       sync.Mutex
	late     map[[2]string]bool // (decode, prefill): a fence of the decode the prefill did not acknowledge in time
	faulted  map[*host]int      // faults in progress on each host (until its recovery was seen)
	down     map[*host]bool
	cur      *phase
	phases   []*phase
	failedMu sync.Mutex
}

func (d *driver) setFault(h *host, on bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if on {
		d.faulted[h]++
	} else {
		d.faulted[h]--
	}
}

func (d *driver) isFaulted(hs ...*host) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, h := range hs {
		if d.faulted[h] > 0 {
			return true
		}
	}
	return false
}

func (d *driver) phase() *phase {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.cur
}

func (d *driver) begin(name string) *phase {
	p := &phase{name: name, failKinds: map[string]int{}}
	d.mu.Lock()
	d.cur = p
	d.phases = append(d.phases, p)
	d.mu.Unlock()
	return p
}

// pick returns a random prefill and a random decode whose node is up.
func (d *driver) pick(rng *rand.Rand) (*host, *host) {
	ps, ds := d.tp.of("prefill"), d.tp.of("decode")
	d.mu.Lock()
	defer d.mu.Unlock()
	var up []*host
	for _, h := range ds {
		if !d.down[h] {
			up = append(up, h)
		}
	}
	return ps[rng.IntN(len(ps))], up[rng.IntN(len(up))]
}

// traffic runs workers until stop is closed.
func (d *driver) traffic(stop <-chan struct{}) *sync.WaitGroup {
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(seed uint64) {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(seed, uint64(time.Now().UnixNano())))
			for {
				select {
				case <-stop:
					return
				default:
				}
				p, dec := d.pick(rng)
				d.request(rng, p, dec)
			}
		}(uint64(w))
	}
	return &wg
}

// writeAns is a prefill's answer to a write.
type writeAns struct {
	status, kind, msg string
	ms                int
}

func parseWrite(l string) writeAns {
	// write <rid> <status> <kind> <ms> [error]
	f := strings.SplitN(l, " ", 6)
	a := writeAns{status: "?", kind: "?"}
	if len(f) >= 5 {
		a.status, a.kind = f[2], f[3]
		a.ms, _ = strconv.Atoi(f[4])
	}
	if len(f) == 6 {
		a.msg = f[5]
	}
	return a
}

// reserve asks decode dec for n pages for rid; nil addrs with a nil error
// when it has none free.
func (d *driver) reserve(dec *host, rid uint64, n int) (addrs string, corrupt uint64, err error) {
	l, err := dec.node.ask(fmt.Sprintf("reserve %d %d", rid, n), fmt.Sprintf("reserve %d", rid), 10*time.Second)
	if err != nil {
		return "", 0, err
	}
	f := strings.Fields(l)
	if len(f) < 5 || f[2] != "ok" {
		return "", 0, nil
	}
	corrupt, _ = strconv.ParseUint(f[3], 10, 64)
	if corrupt > 0 {
		d.phase().note("rid %d: free pages of %s overwritten before it reserved them (a late write): %s",
			rid, dec.name(), strings.Join(f[5:], " "))
	}
	return f[4], corrupt, nil
}

func (d *driver) write(p, dec *host, rid uint64, addrs string, timeout time.Duration) (writeAns, error) {
	return d.writeNotify(p, dec, rid, addrs, timeout, nil)
}

// writeNotify is write; submitted, when not nil, gets whether the prefill
// submitted the transfers (planned them) once it did or failed to.
func (d *driver) writeNotify(p, dec *host, rid uint64, addrs string, timeout time.Duration, submitted chan<- bool) (writeAns, error) {
	if submitted != nil {
		// Expected before the command goes out, so that the line cannot
		// come first.
		ch := p.node.expect(fmt.Sprintf("submitted %d", rid))
		go func() {
			l, err := p.node.wait(ch, timeout+15*time.Second)
			submitted <- err == nil && strings.HasSuffix(l, " ok")
		}()
	}
	l, err := p.node.ask(fmt.Sprintf("write %d %s %d %s", rid, dec.seg(), timeout.Milliseconds(), addrs),
		fmt.Sprintf("write %d", rid), timeout+15*time.Second)
	if err != nil {
		return writeAns{}, err
	}
	return parseWrite(l), nil
}

// verify has dec check rid's pages and free them: bytes good and bad.
func (d *driver) verify(dec *host, rid uint64) (good, bad uint64, err error) {
	l, err := dec.node.ask(fmt.Sprintf("verify %d", rid), fmt.Sprintf("verify %d", rid), 30*time.Second)
	if err != nil {
		return 0, 0, err
	}
	f := strings.Fields(l)
	if len(f) < 4 {
		return 0, 0, fmt.Errorf("verify answer %q", l)
	}
	good, _ = strconv.ParseUint(f[2], 10, 64)
	bad, _ = strconv.ParseUint(f[3], 10, 64)
	return good, bad, nil
}

// abort has dec abort (or fence) rid: Safe, and the answer.
func (d *driver) abort(dec, p *host, rid uint64, how string) (bool, string, error) {
	l, err := dec.node.ask(fmt.Sprintf("abort %d %s %s", rid, how, p.seg()), fmt.Sprintf("abort %d", rid), 30*time.Second)
	if err != nil {
		return false, "", err
	}
	f := strings.Fields(l)
	for _, x := range f {
		if names, ok := strings.CutPrefix(x, "unacked="); ok && names != "" {
			d.mu.Lock()
			for _, n := range strings.Split(names, ",") {
				d.late[[2]string{dec.seg(), n}] = true
			}
			d.mu.Unlock()
		}
	}
	return len(f) >= 3 && f[2] == "safe", l, nil
}

// takeLate reports, and forgets, that p had not acknowledged a fence of
// dec in time.
func (d *driver) takeLate(dec, p *host) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	k := [2]string{dec.seg(), p.seg()}
	late := d.late[k]
	delete(d.late, k)
	return late
}

// request runs one request from p to dec and counts it in the current phase.
func (d *driver) request(rng *rand.Rand, p, dec *host) {
	ph := d.phase()
	rid := d.rid.Add(1)
	n := 1 + rng.IntN(maxPages)
	start := time.Now()
	addrs, corrupt, err := d.reserve(dec, rid, n)
	if err != nil {
		// The decode's process is gone: only a fault of ours does that.
		ph.add(func(ph *phase) {
			ph.decodeDown++
			if !d.isFaulted(dec) {
				ph.unexpected = append(ph.unexpected, fmt.Sprintf("rid %d: reserve on %s: %v", rid, dec.name(), err))
			}
		})
		return
	}
	if addrs == "" {
		ph.add(func(ph *phase) { ph.full++ })
		return
	}
	ph.add(func(ph *phase) { ph.requests++; ph.corrupted += corrupt })
	how := ""
	switch r := rng.IntN(100); {
	case r < abortPct:
		how = "abort"
	case r < abortPct+fencePct:
		how = "fence"
	}
	type res struct {
		a   writeAns
		err error
	}
	wch := make(chan res, 1)
	var sub chan bool
	if how == "fence" {
		sub = make(chan bool, 1)
	}
	go func() {
		a, err := d.writeNotify(p, dec, rid, addrs, writeTimeout, sub)
		wch <- res{a, err}
	}()
	var abortSafe bool
	var abortLine string
	var abortErr error
	if how == "fence" {
		// A fence covers transfers planned before it: like a decode that
		// fences pages it handed out, fence once the prefill planned.
		<-sub
	}
	if how != "" {
		// A random moment of the transfer (it takes a few milliseconds):
		// the delay picks it, nothing waits on it.
		time.Sleep(time.Duration(rng.IntN(8000)) * time.Microsecond)
		abortSafe, abortLine, abortErr = d.abort(dec, p, rid, how)
	}
	r := <-wch
	faulted := d.isFaulted(p, dec)
	if how != "" {
		ph.add(func(ph *phase) {
			if how == "abort" {
				ph.aborts++
				if abortSafe {
					ph.abortsSafe++
				}
			} else {
				ph.fences++
				if abortSafe {
					ph.fencesSafe++
				}
			}
			switch {
			case r.err != nil:
				ph.failed++
				ph.expected++
				ph.byUs++
				ph.failKinds["driver: "+shortErr(r.err)]++
			case r.a.status == "COMPLETED":
				ph.completed++
			default:
				ph.failed++
				ph.expected++ // we aborted it
				ph.byUs++
				ph.failKinds[r.a.status+"/"+r.a.kind]++
			}
			if abortErr == nil && !abortSafe && !faulted {
				ph.unexpected = append(ph.unexpected, fmt.Sprintf("rid %d: %s of a request on healthy hosts not Safe: %s", rid, how, abortLine))
			}
		})
		return
	}
	if r.err == nil && r.a.status == "COMPLETED" {
		good, bad, err := d.verify(dec, rid)
		ph.add(func(ph *phase) {
			ph.completed++
			ph.bytesMoved += uint64(n) * pageSize
			ph.bytesVerif += good
			ph.corrupted += bad
			if err != nil && !d.isFaulted(dec) {
				ph.unexpected = append(ph.unexpected, fmt.Sprintf("rid %d: verify on %s: %v", rid, dec.name(), err))
			}
		})
		if bad > 0 {
			ph.note("rid %d (%s -> %s, %d pages): %d bytes differ from its pattern after COMPLETED", rid, p.name(), dec.name(), n, bad)
		}
		return
	}
	// Failed: expected when a fault touches either end, then or now, or
	// when it was refused as fenced after the prefill missed a fence
	// notice's grace.
	faulted = faulted || d.isFaulted(p, dec)
	late := r.err == nil && r.a.kind == "fenced" && d.takeLate(dec, p)
	why := shortErr(r.err)
	kind := "driver"
	if r.err == nil {
		why, kind = r.a.status+" "+r.a.msg, r.a.status+"/"+r.a.kind
	}
	// Take the pages back the way a decode would: abort the request, and
	// reuse its pages only if that is Safe.
	safe, line, aerr := d.abort(dec, p, rid, "abort")
	ph.add(func(ph *phase) {
		ph.failed++
		ph.failKinds[kind]++
		switch {
		case faulted:
			ph.expected++
			ph.byFault++
		case late:
			ph.expected++
			ph.lateNotice++
		default:
			ph.unexpected = append(ph.unexpected, fmt.Sprintf("rid %d (%s -> %s, started %s): %s",
				rid, p.name(), dec.name(), start.Format("15:04:05.000"), why))
		}
		if aerr == nil {
			ph.cleanups++
			if safe {
				ph.cleanupsSafe++
			} else if !faulted {
				ph.unexpected = append(ph.unexpected, fmt.Sprintf("rid %d: abort after failure not Safe: %s", rid, line))
			}
		}
	})
}

func shortErr(err error) string {
	if err == nil {
		return ""
	}
	if errors.Is(err, errNodeGone) {
		return "node process gone"
	}
	return err.Error()
}

// probe writes one request from p to dec and verifies it: nil when it
// completed and every byte checked.
func (d *driver) probe(p, dec *host, timeout time.Duration) error {
	rid := d.rid.Add(1)
	addrs, _, err := d.reserve(dec, rid, 1)
	if err != nil {
		return err
	}
	if addrs == "" {
		return errors.New("decode has no free page")
	}
	a, err := d.write(p, dec, rid, addrs, timeout)
	if err != nil {
		return err
	}
	if a.status != "COMPLETED" {
		_, _, _ = d.abort(dec, p, rid, "abort")
		return fmt.Errorf("%s (%s): %s", a.status, a.kind, a.msg)
	}
	good, bad, err := d.verify(dec, rid)
	if err != nil {
		return err
	}
	if bad > 0 || good != pageSize {
		return fmt.Errorf("verify: %d good, %d bad bytes", good, bad)
	}
	return nil
}

// recover probes from every prefill to dec (or every pair touching dec
// when dec is a prefill) until each probe passed once; it returns how long
// that took from since.
func (d *driver) recoverAll(hs []*host, since time.Time) (time.Duration, error) {
	deadline := time.Now().Add(recoverLimit)
	for _, h := range hs {
		var pairs [][2]*host
		if h.role == "decode" {
			for _, p := range d.tp.of("prefill") {
				pairs = append(pairs, [2]*host{p, h})
			}
		} else {
			for _, dec := range d.tp.of("decode") {
				pairs = append(pairs, [2]*host{h, dec})
			}
		}
		for _, pr := range pairs {
			for {
				err := d.probe(pr[0], pr[1], 2*time.Second)
				if err == nil {
					break
				}
				if time.Now().After(deadline) {
					return 0, fmt.Errorf("%s -> %s: no transfer passed within %v: last: %v", pr[0].name(), pr[1].name(), recoverLimit, err)
				}
			}
		}
	}
	return time.Since(since), nil
}

func hostCount(t *testing.T) int {
	n := 8
	if s := os.Getenv(hostsEnv); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v < 2 || v%2 != 0 || v > 200 {
			t.Fatalf("%s=%q: want an even number of hosts, 2 to 200", hostsEnv, s)
		}
		n = v
	}
	return n
}
