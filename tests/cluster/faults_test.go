package cluster

import (
	"fmt"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestAllToAllTrafficKeepsEveryByteIntactThroughHostLinkAndEtcdFaults builds
// the cluster, runs prefill-to-decode traffic with aborts and fences through
// a clean warm-up, a decode host killed and restarted, a link cut, packet
// loss with a rate limit, and etcd killed and restarted, and prints what
// each phase moved, lost and took to recover. It fails on any corrupted
// byte, any failure no fault explains, a fresh resolution that succeeds
// without etcd, and a cluster that does not recover.
func TestAllToAllTrafficKeepsEveryByteIntactThroughHostLinkAndEtcdFaults(t *testing.T) {
	requireCluster(t)
	runStart := time.Now()
	tp := newTopo(t, hostCount(t))
	d := &driver{t: t, tp: tp, faulted: map[*host]int{}, down: map[*host]bool{}, late: map[[2]string]bool{}}
	var report []string
	say := func(format string, args ...any) { report = append(report, fmt.Sprintf(format, args...)) }
	defer func() { printReport(t, tp, d, report, time.Since(runStart)) }()

	// Start every node at once; each publishes itself in etcd.
	var wg sync.WaitGroup
	errs := make([]error, len(tp.hosts))
	for i, h := range tp.hosts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			h.node, errs[i] = tp.startNode(h)
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	say("engine: %s (every node: %s)", strings.TrimPrefix(tp.hosts[0].node.ready, "ready "), "tcp data plane, etcd metadata at "+tp.metadataURL())
	prefills, decodes := tp.of("prefill"), tp.of("decode")

	runPhase := func(name string, dur time.Duration, during func(p *phase)) *phase {
		t.Helper()
		ph := d.begin(name)
		stop := make(chan struct{})
		wg := d.traffic(stop)
		if during != nil {
			during(ph)
		} else {
			time.Sleep(dur) // traffic runs for the phase's length
		}
		close(stop)
		wg.Wait()
		return ph
	}

	// 1. Warm-up: every pair resolved through etcd, clean traffic.
	runPhase("warm-up", 0, func(ph *phase) {
		for _, p := range prefills {
			for _, dec := range decodes {
				if err := d.probe(p, dec, 10*time.Second); err != nil {
					t.Errorf("warm-up %s -> %s: %v", p.name(), dec.name(), err)
				}
			}
		}
		time.Sleep(6 * time.Second) // traffic runs for the phase's length
	})

	// 2. A decode host's process killed and started again, same address.
	victim := decodes[len(decodes)-1]
	runPhase("decode killed", 0, func(ph *phase) {
		waitCompleted(t, ph, 0, 100) // traffic running, some to the victim, when it dies
		d.setFault(victim, true)
		oldBase := firstPageAddr(t, d, victim)
		killed := time.Now()
		victim.node.kill()
		// Requests in flight to it fail (expected); new ones go elsewhere.
		d.mu.Lock()
		d.down[victim] = true
		d.mu.Unlock()
		// Time to detect: a prefill writing to the dead incarnation's
		// memory sees its transfer fail; then, writing on, the peer
		// declared dead (or not, within the bound: the failure says why).
		p := prefills[0]
		var firstFail, dead time.Duration
		var firstKind, lastKind, lastMsg string
		for time.Since(killed) < 15*time.Second {
			rid := d.rid.Add(1)
			a, err := d.write(p, victim, rid, oldBase, 2*time.Second)
			if err != nil {
				t.Fatalf("probe of the dead decode: %v", err)
			}
			if a.status != "COMPLETED" && firstFail == 0 {
				firstFail, firstKind = time.Since(killed), a.kind
			}
			lastKind, lastMsg = a.kind, a.msg
			if a.kind == "peerdead" {
				dead = time.Since(killed)
				break
			}
			time.Sleep(100 * time.Millisecond) // a probe every 100 ms: the sampling period of the measure
		}
		say("decode killed: time to detect a dead peer: first transfer failed after %v (%s)", firstFail.Round(time.Millisecond), firstKind)
		if dead > 0 {
			say("decode killed: peer declared dead (ErrPeerDead) after %v", dead.Round(time.Millisecond))
		} else {
			say("decode killed: peer not declared dead within 15 s; transfers failed with %s: %s", lastKind, lastMsg)
		}
		restarted := time.Now()
		n, err := tp.startNode(victim)
		if err != nil {
			t.Fatalf("restart %s: %v", victim.name(), err)
		}
		victim.node = n
		took, err := d.recoverAll([]*host{victim}, restarted)
		if err != nil {
			t.Errorf("decode killed: no recovery: %v", err)
			return
		}
		say("decode killed: time to recover (restart to a verified transfer from every prefill to the new incarnation): %v", took.Round(time.Millisecond))
		d.mu.Lock()
		d.down[victim] = false
		d.mu.Unlock()
		d.setFault(victim, false)
		time.Sleep(3 * time.Second) // traffic runs on, after recovery
	})

	// 3. A link cut for 3 s.
	cut := decodes[0]
	runPhase("link cut 3s", 0, func(ph *phase) {
		time.Sleep(2 * time.Second)
		d.setFault(cut, true)
		if err := tp.cutLink(cut); err != nil {
			t.Fatal(err)
		}
		time.Sleep(3 * time.Second) // the cut's length
		if err := tp.healLink(cut); err != nil {
			t.Fatal(err)
		}
		healed := time.Now()
		took, err := d.recoverAll([]*host{cut}, healed)
		if err != nil {
			t.Errorf("link cut: no recovery: %v", err)
			return
		}
		say("link cut 3s on %s: time to recover (link back to a verified transfer from every prefill): %v", cut.name(), took.Round(time.Millisecond))
		d.setFault(cut, false)
		time.Sleep(3 * time.Second)
	})

	// 4. 1% loss on every host's incoming packets, and a rate limit on one.
	if ok, err := tp.netemAvailable(prefills[0]); ok {
		say("netem present: delay and reordering are not part of this test yet")
	} else {
		say("netem missing: delay and reordering not tested here (%v)", firstLine(err))
	}
	shaped := decodes[1%len(decodes)]
	runPhase("1% loss + tbf", 0, func(ph *phase) {
		for _, h := range tp.hosts {
			d.setFault(h, true)
			if err := tp.addLoss(h, 1); err != nil {
				t.Fatal(err)
			}
		}
		if err := tp.shape(shaped, "200mbit"); err != nil {
			t.Fatal(err)
		}
		time.Sleep(10 * time.Second) // traffic runs under loss
		for _, h := range tp.hosts {
			if err := tp.removeLoss(h); err != nil {
				t.Fatal(err)
			}
		}
		if err := tp.unshape(shaped); err != nil {
			t.Fatal(err)
		}
		healed := time.Now()
		took, err := d.recoverAll(decodes, healed)
		if err != nil {
			t.Errorf("loss: no recovery: %v", err)
			return
		}
		say("1%% loss on all %d hosts, %s shaped to 200mbit for 10 s: time to recover (every pair verified): %v", len(tp.hosts), shaped.name(), took.Round(time.Millisecond))
		for _, h := range tp.hosts {
			d.setFault(h, false)
		}
		time.Sleep(2 * time.Second)
	})

	// 5. etcd killed: resolved peers go on, new resolutions fail by their
	// deadline; then etcd again.
	runPhase("etcd killed", 0, func(ph *phase) {
		time.Sleep(1 * time.Second)
		killed := time.Now()
		tp.killEtcd()
		ph.mu.Lock()
		doneBefore := ph.completed
		ph.mu.Unlock()
		// Traffic between resolved peers, etcd gone: wait for it rather
		// than for a time, so a slow machine cannot pass this check
		// with nothing moved.
		waitCompleted(t, ph, doneBefore, 50)
		// A resolution never made before: a prefill opens another
		// prefill's segment.
		l, err := prefills[0].node.ask(fmt.Sprintf("open %s 3000", prefills[1%len(prefills)].seg()),
			"open "+prefills[1%len(prefills)].seg(), 30*time.Second)
		if err != nil {
			t.Fatalf("fresh resolution without etcd: %v", err)
		}
		f := strings.SplitN(l, " ", 5)
		if len(f) < 4 || f[2] != "err" {
			t.Errorf("fresh resolution without etcd did not fail: %s", l)
		} else {
			msg := ""
			if len(f) == 5 {
				msg = f[4]
			}
			say("etcd killed: fresh resolution (3 s deadline) failed after %s ms: %s", f[3], msg)
		}
		// Transfers between resolved peers went on: any failure of one
		// is counted unexpected (no host is under a fault), and some
		// completed.
		ph.mu.Lock()
		during, failedDuring := ph.completed-doneBefore, len(ph.unexpected)
		ph.mu.Unlock()
		say("etcd killed: %d requests between resolved peers completed and were verified while etcd was down (%d unexpected failures)", during, failedDuring)
		if during == 0 {
			t.Errorf("etcd killed: no transfer between resolved peers completed while etcd was down")
		}
		restarted := time.Now()
		tp.startEtcd()
		// Recovered: a fresh resolution passes again.
		other := prefills[len(prefills)-1]
		if len(prefills) > 2 {
			other = prefills[2]
		}
		deadline := time.Now().Add(recoverLimit)
		for {
			l, err := prefills[0].node.ask(fmt.Sprintf("open %s 2000", other.seg()), "open "+other.seg(), 30*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			if strings.HasPrefix(l, "open "+other.seg()+" ok") {
				break
			}
			if time.Now().After(deadline) {
				t.Errorf("etcd restarted: fresh resolution still fails after %v: %s", recoverLimit, l)
				return
			}
		}
		say("etcd killed for %v: time to recover (etcd restart to a fresh resolution): %v",
			restarted.Sub(killed).Round(time.Millisecond), time.Since(restarted).Round(time.Millisecond))
		time.Sleep(2 * time.Second)
	})

	// 6. Clean traffic again.
	runPhase("after faults", 4*time.Second, nil)

	var total uint64
	for _, ph := range d.phases {
		total += ph.corrupted
		for _, u := range ph.unexpected {
			t.Errorf("%s: unexpected failure: %s", ph.name, u)
		}
		for _, n := range ph.notes {
			t.Errorf("%s: %s", ph.name, n)
		}
	}
	if total > 0 {
		t.Errorf("%d bytes corrupted", total)
	}
}

// firstPageAddr reserves and gives back one page of dec: an address of its
// memory for writes to a dead incarnation.
func firstPageAddr(t *testing.T, d *driver, dec *host) string {
	t.Helper()
	rid := d.rid.Add(1)
	addrs, _, err := d.reserve(dec, rid, 1)
	if err != nil || addrs == "" {
		t.Fatalf("reserve on %s: %v", dec.name(), err)
	}
	if _, _, err := d.abort(dec, dec, rid, "abort"); err != nil {
		t.Fatal(err)
	}
	return addrs
}

func firstLine(err error) string {
	if err == nil {
		return ""
	}
	s := err.Error()
	if i := strings.LastIndex(s, ": "); i >= 0 {
		return strings.TrimSpace(s[i+2:])
	}
	return s
}

func printReport(t *testing.T, tp *topo, d *driver, lines []string, wall time.Duration) {
	var b strings.Builder
	fmt.Fprintf(&b, "\n==== kvferry cluster report: %d hosts (%d prefill, %d decode) + etcd, subnet %s.0/24, pages of %d KiB ====\n",
		len(tp.hosts), len(tp.of("prefill")), len(tp.of("decode")), tp.net, pageSize>>10)
	fmt.Fprintf(&b, "%-14s %6s %6s %9s %9s %6s %11s %5s %11s %11s %12s %9s\n",
		"phase", "reqs", "done", "moved MiB", "verif MiB", "failed", "exp(us/flt)", "unexp", "aborts safe", "fences safe", "cleanup safe", "corrupted")
	var tot phase
	row := func(p *phase) {
		fmt.Fprintf(&b, "%-14s %6d %6d %9.1f %9.1f %6d %11s %5d %5d/%-5d %5d/%-5d %6d/%-5d %9d\n",
			p.name, p.requests, p.completed, float64(p.bytesMoved)/(1<<20), float64(p.bytesVerif)/(1<<20),
			p.failed, fmt.Sprintf("%d(%d/%d)", p.expected, p.byUs, p.byFault), len(p.unexpected), p.abortsSafe, p.aborts, p.fencesSafe, p.fences,
			p.cleanupsSafe, p.cleanups, p.corrupted)
	}
	d.mu.Lock()
	phases := append([]*phase(nil), d.phases...)
	d.mu.Unlock()
	for _, p := range phases {
		p.mu.Lock()
		row(p)
		tot.requests += p.requests
		tot.completed += p.completed
		tot.bytesMoved += p.bytesMoved
		tot.bytesVerif += p.bytesVerif
		tot.failed += p.failed
		tot.expected += p.expected
		tot.byUs += p.byUs
		tot.byFault += p.byFault
		tot.lateNotice += p.lateNotice
		tot.unexpected = append(tot.unexpected, p.unexpected...)
		tot.aborts += p.aborts
		tot.abortsSafe += p.abortsSafe
		tot.fences += p.fences
		tot.fencesSafe += p.fencesSafe
		tot.cleanups += p.cleanups
		tot.cleanupsSafe += p.cleanupsSafe
		tot.corrupted += p.corrupted
		tot.full += p.full
		tot.decodeDown += p.decodeDown
		p.mu.Unlock()
	}
	tot.name = "TOTAL"
	row(&tot)
	fmt.Fprintf(&b, "(reqs: requests given pages; exp: failures of requests we aborted or fenced (us) or that a fault touched (flt);\n"+
		" cleanup: aborts that take back a failed request's pages; reserve refused for lack of free pages: %d; reserve on a dead decode: %d;\n"+
		" expected besides us/flt: %d transfers refused as fenced because their prefill had not acknowledged an earlier fence of\n"+
		" that decode within FenceGrace (FenceResult.Acked lacked it; documented: the first stale transfer is refused))\n",
		tot.full, tot.decodeDown, tot.lateNotice)
	fmt.Fprintf(&b, "failures by status/kind:\n")
	for _, p := range phases {
		p.mu.Lock()
		var ks []string
		for k, v := range p.failKinds {
			ks = append(ks, fmt.Sprintf("%s=%d", k, v))
		}
		p.mu.Unlock()
		sort.Strings(ks)
		if len(ks) > 0 {
			fmt.Fprintf(&b, "  %-14s %s\n", p.name, strings.Join(ks, " "))
		}
	}
	for _, l := range lines {
		fmt.Fprintf(&b, "%s\n", l)
	}
	fmt.Fprintf(&b, "wall time: %v\n", wall.Round(time.Millisecond))
	t.Log(b.String())
}

// waitCompleted waits until the phase completed n requests more than from
// (bounded by recoverLimit, failing the test past it): traffic that a check
// counts on has moved, however slow the machine.
func waitCompleted(t *testing.T, ph *phase, from, n int) {
	t.Helper()
	deadline := time.Now().Add(recoverLimit)
	for {
		ph.mu.Lock()
		done := ph.completed
		ph.mu.Unlock()
		if done-from >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("phase %s: %d requests completed in %v, %d awaited", ph.name, done-from, recoverLimit, n)
		}
		time.Sleep(10 * time.Millisecond) // polling the counter: the condition itself is awaited
	}
}
