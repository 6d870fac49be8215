package metrics

import "testing"

// seriesKey names one Prometheus series of the peer table.
type seriesKey struct{ kind, peer, op, transport, status string }

func scrapeTable(t *PeerTable) map[seriesKey]uint64 {
	bs, ts := t.Snapshot()
	out := map[seriesKey]uint64{}
	for _, s := range bs {
		out[seriesKey{"bytes", s.Peer, s.Op, s.Transport, ""}] = s.Value
	}
	for _, s := range ts {
		out[seriesKey{"tasks", s.Peer, s.Op, s.Transport, s.Status}] = s.Value
	}
	return out
}

// A counter that rises between two scrapes says that something happened
// between them: rate() and increase() add the rise up. When a labeled peer
// goes idle and gives its label up, nothing was transferred, yet folding its
// lifetime counts into peer="other" makes "other" rise by all of them, so
// sum(rate(kvferry_transfer_bytes_total)) shows a burst of every byte the
// peer ever moved (already counted once, under its own label).
func TestRetiringAnIdlePeerRaisesNoCounterWhileNothingIsTransferred(t *testing.T) {
	tab := NewPeerTable(1)
	count(tab, "busy-then-idle", 1<<30) // takes the one label
	count(tab, "unlabeled", 7)          // counts under other
	tab.Rebalance()                     // both were active: nothing moves
	before := scrapeTable(tab)

	// Nothing is transferred from here on.
	tab.Rebalance() // "busy-then-idle" was idle for an interval: retired and folded
	after := scrapeTable(tab)

	for k, v := range after {
		if old, ok := before[k]; ok && v != old {
			t.Errorf("%+v went from %d to %d between two scrapes with no transfer in between", k, old, v)
		}
	}
}
