// Cancel: slices their caller gave up on are dropped when not yet posted,
// waited for when posted, and the pairs holding them broken after a grace.

package rdma

import (
	"context"
	"fmt"
	"time"

	"github.com/kvferry/kvferry/engine/transport"
)

// cancelGrace is how long Cancel waits for a canceled slice's work
// requests to complete before it flushes the NIC paths holding them.
const cancelGrace = 50 * time.Millisecond

// Cancel implements transport.SliceCanceler: slices not yet posted are
// dropped, posted ones are waited for, and after cancelGrace the pairs
// still holding their work requests are broken (their QPs go to the error
// state, which flushes them; the other work on those pairs moves to other
// pairs, as after any failure). It returns once every slice ended, or
// with ErrInUse at ctx's deadline.
func (e *Endpoint) Cancel(ctx context.Context, ss []*transport.Slice) error {
	e.mu.Lock()
	for _, s := range ss {
		e.canceled[s]++
		if e.asking == s {
			e.stopAsk()
		}
	}
	e.mu.Unlock()
	defer func() {
		e.mu.Lock()
		for _, s := range ss {
			if e.canceled[s]--; e.canceled[s] <= 0 {
				delete(e.canceled, s)
			}
		}
		e.mu.Unlock()
	}()
	defer e.wakeOn(ctx)()
	grace := time.Now().Add(cancelGrace)
	flushed := false
	for {
		var left []*transport.Slice
		for _, s := range ss {
			if st := s.State(); st != transport.StateDone && st != transport.StateCanceled {
				left = append(left, s)
			}
		}
		if len(left) == 0 {
			return nil
		}
		for _, s := range left {
			// Back in the queue (its pair broke, or a new key epoch):
			// no work request of it is out, so it ends here, unless the
			// sender takes it first (then postOn drops it).
			s.FinishFrom(transport.StateQueued, fmt.Errorf("rdma: %w", transport.ErrCanceled))
		}
		dead := e.Dead()
		if dead {
			// Abort returns once the flush is seen or timed out.
			select {
			case <-e.finished:
			case <-ctx.Done():
			}
		} else if !flushed && !time.Now().Before(grace) {
			e.breakPairsOf(left)
			flushed = true
		}
		if ctx.Err() != nil || dead {
			if n := countLive(left); n > 0 {
				return fmt.Errorf("rdma path to %s: %w: %d canceled slices' work requests neither completed nor flushed", e.peer, transport.ErrInUse, n)
			}
			return nil
		}
		wait := 10 * time.Millisecond // completions wake us; this bounds a missed one
		if d := time.Until(grace); d > 0 {
			wait = min(wait, d+time.Millisecond)
		}
		e.mu.Lock()
		e.waitCond(wait)
		e.mu.Unlock()
	}
}

func countLive(ss []*transport.Slice) int {
	n := 0
	for _, s := range ss {
		if st := s.State(); st != transport.StateDone && st != transport.StateCanceled {
			n++
		}
	}
	return n
}

// breakPairsOf breaks the pairs holding work requests of slices.
func (e *Endpoint) breakPairsOf(ss []*transport.Slice) {
	want := make(map[*transport.Slice]bool, len(ss))
	for _, s := range ss {
		want[s] = true
	}
	pairs := map[*pair]bool{}
	e.t.wrMu.Lock()
	for _, c := range e.t.wrs {
		if c.ep == e && c.ws != nil && want[c.ws.s] {
			pairs[c.pair] = true
		}
	}
	e.t.wrMu.Unlock()
	e.mu.Lock()
	for p := range pairs {
		e.breakPair(p, fmt.Errorf("%w: canceled work requests did not complete within %v", transport.ErrCanceled, cancelGrace))
	}
	e.mu.Unlock()
}
