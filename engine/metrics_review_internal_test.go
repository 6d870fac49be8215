package engine

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvferry/kvferry/engine/metrics"
)

// peerLabeled reports whether name has a series of its own in tab.
func peerLabeled(tab *metrics.PeerTable, name string) bool {
	_, tasks := tab.Snapshot()
	for _, s := range tasks {
		if s.Peer == name {
			return true
		}
	}
	return false
}

// The engine rebalances its peer labels from a scrape, at most once per
// interval. Scrapes run concurrently (the listener, MetricsText from the C
// API or Python, a host registry): two that find the interval elapsed at
// the same time must not both rebalance, or the second, a moment after the
// first, finds every peer "idle since the last rebalance" and takes the
// label of a peer that is moving data.
func TestConcurrentScrapesRebalanceThePeerTableOncePerInterval(t *testing.T) {
	e, err := New(Options{IgnoreEnv: true, Protocol: "tcp", MetricsPeers: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	const active = "10.0.0.1:5000"
	slot := metrics.Slot{Op: 1}
	deadline := time.Now().Add(5 * time.Second)
	for attempt := 0; time.Now().Before(deadline) && attempt < 50000; attempt++ {
		tab := metrics.NewPeerTable(1)
		e.metrics.peers = tab
		// The peer moved data since the last rebalance: a rebalance now
		// must leave it its label.
		p := tab.Acquire(active, slot)
		p.Count(slot, 0, 4096)
		p.Release(slot)
		e.metrics.rebalanced.Store(time.Now().Add(-2 * peerRebalanceInterval).UnixNano())

		start := make(chan struct{})
		var wg sync.WaitGroup
		for range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ch := make(chan prometheus.Metric, 4096)
				<-start
				engineCollector{e}.Collect(ch)
			}()
		}
		close(start)
		wg.Wait()
		if !peerLabeled(tab, active) {
			t.Fatalf("attempt %d: concurrent scrapes rebalanced twice in one interval: the active peer %s lost its label", attempt, active)
		}
	}
}

// A task's transport and start time are written by Submit after the task
// is listed in its batch and in the task index, where a concurrent Cancel
// (or an owner's ABORT, or Close) can end it: finish then reads them
// unsynchronized (the race detector reports it) and may count the
// transfer under transport 0 ("tcp") whatever carried it, and name "tcp" in
// its error. Every transfer here goes to our own segment ("local").
func TestCancelRacingSubmitCountsTasksUnderTheirOwnTransport(t *testing.T) {
	e, err := New(Options{IgnoreEnv: true, Protocol: "tcp"})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	buf, err := e.AllocBuffer(1<<20, "cpu")
	if err != nil {
		t.Fatal(err)
	}
	self, err := e.OpenSegment(context.Background(), e.Name())
	if err != nil {
		t.Fatal(err)
	}
	rs := make([]Request, 64)
	for i := range rs {
		rs[i] = Request{Op: Write, Local: AddrOf(buf) + uint64(i)<<12, Segment: self, Remote: AddrOf(buf) + 512<<10 + uint64(i)<<12, Length: 4096}
	}
	deadline := time.Now().Add(5 * time.Second)
	for attempt := 0; time.Now().Before(deadline) && attempt < 50000; attempt++ {
		b, err := e.AllocateBatch(len(rs))
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			for {
				select {
				case <-done:
					return
				default:
				}
				b.mu.Lock()
				n := len(b.tasks)
				b.mu.Unlock()
				if n > 0 {
					_ = b.Cancel()
					return
				}
			}
		}()
		if err := b.Submit(context.Background(), rs); err != nil {
			t.Fatal(err)
		}
		<-done
		_ = b.Wait(context.Background())
		for i, r := range b.Results() {
			if r.Err != nil && !strings.Contains(r.Err.Error(), "over local") {
				t.Fatalf("attempt %d: task %d to our own segment: %v (want it named \"over local\")", attempt, i, r.Err)
			}
		}
		_ = b.Free()
	}
	byts, tasks := e.metrics.peers.Snapshot()
	for _, s := range append(byts, tasks...) {
		if s.Transport != "local" {
			t.Errorf("a transfer to our own segment counted under transport %q: %+v", s.Transport, s)
		}
	}
}
