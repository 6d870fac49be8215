// Completions: a poller per NIC, the work requests in flight, and the
// watchdog that breaks paths whose work stopped completing.

package rdma

import (
	"time"

	"github.com/kvferry/kvferry/verbs"
)

// wrCtx is one posted work request: a slice's, a notification's SEND, or
// a receive for notifications.
type wrCtx struct {
	ep    *Endpoint
	pair  *pair
	ws    *wslice
	bytes uint64
	send  *sendCtx
	recv  *recvCtx
}

// watchdog breaks NIC paths that hold work requests of which none
// completed within CompletionTimeout. A provider that never completes a
// request (a peer gone quiet under a retry count the provider reads as
// "for ever", a stuck device) would otherwise hold every wait on it for
// good; breaking the path moves its QP to the error state, whose flush
// completes what was posted, and the work moves to another path.
func (t *Transport) watchdog() {
	defer t.wg.Done()
	tick := time.NewTicker(min(max(t.opts.CompletionTimeout/4, 10*time.Millisecond), time.Second))
	defer tick.Stop()
	for {
		select {
		case <-tick.C:
			t.breakStalledPaths()
		case <-t.closed:
			return
		}
	}
}

// breakStalledPaths breaks, on every live endpoint, the paths whose work
// requests stopped completing for longer than CompletionTimeout.
func (t *Transport) breakStalledPaths() {
	t.opMu.Lock()
	eps := make([]*Endpoint, 0, len(t.eps))
	for e := range t.eps {
		eps = append(eps, e)
	}
	t.opMu.Unlock()
	now := time.Now()
	for _, e := range eps {
		e.breakStalled(now, t.opts.CompletionTimeout)
	}
}

func (n *NIC) kick() {
	select {
	case n.poll <- struct{}{}:
	default:
	}
}

// poller takes the NIC's completions in batches. It spins briefly while
// work is outstanding, sleeps with backoff after that, and blocks when
// nothing is outstanding, so an idle engine costs no CPU.
func (t *Transport) poller(n *NIC) {
	defer t.wg.Done()
	wcs := make([]verbs.WC, 64)
	idle := 0
	for {
		select {
		case <-t.closed:
			return
		default:
		}
		k := n.cq.Poll(wcs)
		if k < 0 {
			t.log.Error("kvferry: rdma poll failed", "nic", n.Name, "rc", k)
			k = 0
		}
		if k > 0 {
			idle = 0
			t.complete(n, wcs[:k])
			continue
		}
		if n.inflight.Load() == 0 {
			// Idle. Receives for notifications may still complete: look
			// every millisecond while any is posted (no completion
			// channel), else only when work is posted.
			wait := 50 * time.Millisecond
			if n.recvs.Load() > 0 {
				wait = time.Millisecond
			}
			select {
			case <-t.closed:
				return
			case <-n.poll:
			case <-time.After(wait):
			}
			continue
		}
		idle++
		switch {
		case idle < 64:
			// spin: a completion is usually microseconds away
		case idle < 256:
			time.Sleep(20 * time.Microsecond)
		default:
			time.Sleep(200 * time.Microsecond)
		}
	}
}

func (t *Transport) complete(n *NIC, wcs []verbs.WC) {
	for i := range wcs {
		wc := &wcs[i]
		t.wrMu.Lock()
		c := t.wrs[wc.ID]
		delete(t.wrs, wc.ID)
		t.wrMu.Unlock()
		if c == nil {
			continue
		}
		if c.recv == nil {
			n.inflight.Add(-1)
		}
		t.stats.Completed.Add(1)
		if wc.Status != verbs.WCSuccess {
			t.stats.ErrorCompletions.Add(1)
		}
		switch {
		case c.recv != nil:
			t.received(c.recv, wc)
		case c.send != nil:
			c.ep.sent(c, wc.Status)
		default:
			c.ep.completed(c, wc.Status, t.lib.WCStatusString(wc.Status))
		}
	}
}

func (t *Transport) track(c *wrCtx) uint64 {
	t.wrMu.Lock()
	t.nextWR++
	id := t.nextWR
	t.wrs[id] = c
	t.wrMu.Unlock()
	return id
}

func (t *Transport) untrack(id uint64) { t.untrackIf(id) }

// untrackIf forgets a work request and reports whether it was still
// tracked (a completion or dropRecvs may have taken it first).
func (t *Transport) untrackIf(id uint64) bool {
	t.wrMu.Lock()
	_, ok := t.wrs[id]
	delete(t.wrs, id)
	t.wrMu.Unlock()
	return ok
}
