package metrics

import (
	"fmt"
	"sync"
	"testing"
)

func count(t *PeerTable, name string, bytes uint64) {
	slot := Slot{Op: 1}
	p := t.Acquire(name, slot)
	p.Count(slot, 0, bytes)
	p.Release(slot)
}

func totals(t *PeerTable) (bytes map[string]uint64, sum uint64) {
	bs, _ := t.Snapshot()
	bytes = map[string]uint64{}
	for _, s := range bs {
		bytes[s.Peer] += s.Value
		sum += s.Value
	}
	return bytes, sum
}

func TestAThousandPeersMakeAtMostMaxLabelsPlusOtherAndLoseNothing(t *testing.T) {
	const max, peers = 32, 1000
	tab := NewPeerTable(max)
	var want uint64
	for round := range 3 {
		for i := range peers {
			count(tab, fmt.Sprintf("10.0.%d.%d:5000", i/256, i%256), uint64(i+1))
			want += uint64(i + 1)
		}
		if round == 1 {
			tab.Rebalance() // every peer was active: nobody loses a label
		}
	}
	bytes, sum := totals(tab)
	if len(bytes) > max+1 {
		t.Fatalf("%d peer labels for %d peers, want at most %d", len(bytes), peers, max+1)
	}
	if _, ok := bytes[OtherPeer]; !ok {
		t.Fatal("no other series")
	}
	if sum != want {
		t.Fatalf("bytes over all labels = %d, want %d", sum, want)
	}
	tab.candMu.Lock()
	cands := len(tab.candidates)
	tab.candMu.Unlock()
	if cands > candidateFactor*max {
		t.Fatalf("%d candidates remembered, want at most %d", cands, candidateFactor*max)
	}
}

func TestAnIdlePeerGivesItsLabelToTheBusiestOtherAndItsSeriesEnds(t *testing.T) {
	tab := NewPeerTable(2)
	count(tab, "a", 100)
	count(tab, "b", 100)
	count(tab, "c", 5) // no label free: other
	count(tab, "d", 7)
	count(tab, "d", 7)
	tab.Rebalance() // a and b were active since their labels were given
	before, _ := totals(tab)
	if before[OtherPeer] != 19 || before["a"] != 100 || before["b"] != 100 {
		t.Fatalf("before: %v", before)
	}

	count(tab, "b", 1)
	count(tab, "d", 7) // busiest under other since the last rebalance
	count(tab, "d", 7)
	count(tab, "c", 5)
	tab.Rebalance() // a was idle: its series ends, d takes its label
	after, _ := totals(tab)
	if _, ok := after["a"]; ok {
		t.Errorf("idle peer a kept its label: %v", after)
	}
	// other rose by what moved under it (c's 5, d's 14), not by a's 100.
	if after[OtherPeer] != 19+19 || after["b"] != 101 {
		t.Errorf("after: %v, want other 38 and b 101", after)
	}
	count(tab, "d", 3)
	got, _ := totals(tab)
	if got["d"] != 3 {
		t.Errorf("d after it took a's label: %d, want 3 (its earlier bytes stay in other)", got["d"])
	}
}

func TestAPeerRetiredWhileACountIsUnderWayIsShownUntilItEnds(t *testing.T) {
	tab := NewPeerTable(1)
	count(tab, "a", 1)
	tab.Rebalance()
	slot := Slot{Shard: 3, Op: 1}
	held := tab.Acquire("a", slot) // a count under way across the next rebalance
	tab.Rebalance()                // a idle since the last one: retired, but held
	count(tab, "a", 5)             // a new count goes to other, not to the retiring a
	held.Count(slot, 0, 10)
	bytes, _ := totals(tab)
	if bytes["a"] != 11 || bytes[OtherPeer] != 5 {
		t.Fatalf("while held: %v, want a 11 (the raced count shown) and other 5", bytes)
	}
	held.Release(slot)
	tab.Rebalance() // now unheld: its series ends
	bytes, _ = totals(tab)
	if _, ok := bytes["a"]; ok || bytes[OtherPeer] != 5 {
		t.Fatalf("after: %v, want a gone and other 5", bytes)
	}
}

func TestConcurrentCountsAndRebalancesNeverMakeASeriesGoDownOrTwice(t *testing.T) {
	tab := NewPeerTable(4)
	const workers, each = 8, 2000
	var wg sync.WaitGroup
	stop := make(chan struct{})
	var checker sync.WaitGroup
	checker.Add(1)
	var problem string
	go func() {
		defer checker.Done()
		prev := map[seriesKey]uint64{}
		for {
			select {
			case <-stop:
				return
			default:
			}
			tab.Rebalance()
			bs, ts := tab.Snapshot()
			cur := map[seriesKey]uint64{}
			for _, x := range bs {
				k := seriesKey{"bytes", x.Peer, x.Op, x.Transport, ""}
				if _, dup := cur[k]; dup && problem == "" {
					problem = fmt.Sprintf("series %+v twice in one snapshot", k)
				}
				cur[k] = x.Value
			}
			for _, x := range ts {
				k := seriesKey{"tasks", x.Peer, x.Op, x.Transport, x.Status}
				if _, dup := cur[k]; dup && problem == "" {
					problem = fmt.Sprintf("series %+v twice in one snapshot", k)
				}
				cur[k] = x.Value
			}
			for k, v := range cur {
				if old, ok := prev[k]; ok && v < old && problem == "" {
					problem = fmt.Sprintf("series %+v went down from %d to %d", k, old, v)
				}
			}
			prev = cur
		}
	}()
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				slot := Slot{Shard: w + i, Op: i % 2, Transport: w % 4}
				p := tab.Acquire(fmt.Sprintf("peer-%d", (w*each+i)%13), slot)
				p.Count(slot, 0, 1)
				p.Release(slot)
			}
		}()
	}
	wg.Wait()
	close(stop)
	checker.Wait()
	tab.Rebalance() // no count under way now: none stays retiring
	if problem != "" {
		t.Fatal(problem)
	}
	if n := len(tab.retiring); n != 0 {
		t.Fatalf("%d peers still retiring with no count under way", n)
	}
}

func TestSizeClasses(t *testing.T) {
	for _, c := range []struct {
		n    uint64
		want string
	}{{1, "le_64KiB"}, {64 << 10, "le_64KiB"}, {64<<10 + 1, "le_1MiB"}, {1 << 20, "le_1MiB"}, {16 << 20, "le_16MiB"}, {16<<20 + 1, "gt_16MiB"}} {
		if got := SizeClasses[SizeClass(c.n)]; got != c.want {
			t.Errorf("SizeClass(%d) = %s, want %s", c.n, got, c.want)
		}
	}
}
