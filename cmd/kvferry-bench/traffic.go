package main

import (
	"time"

	"github.com/kvferry/kvferry/engine"
)

// threadRequests is thread th's request of the abort and fence modes: the
// --block-size bytes at offset th * --block-size of local, written to the
// same offset of remote on seg, cut into --batch-size pieces (the last one
// takes the remainder).
func threadRequests(c config, th int, local uint64, seg *engine.Segment, remote uint64) []engine.Request {
	pieces := min(c.batchSize, c.blockSize)
	base := uint64(th) * uint64(c.blockSize)
	reqs := make([]engine.Request, pieces)
	piece := uint64(c.blockSize / pieces)
	for i := range reqs {
		n := piece
		if i == pieces-1 {
			n = uint64(c.blockSize) - piece*uint64(pieces-1)
		}
		off := base + uint64(i)*piece
		reqs[i] = engine.Request{Op: engine.Write, Local: local + off, Segment: seg, Remote: remote + off, Length: n}
	}
	return reqs
}

// pacer spaces one thread's requests so that they move perSec bytes per
// second, until stop.
type pacer struct {
	next, stop time.Time
	perSec     float64
}

func newPacer(perSec float64, stop time.Time) *pacer {
	return &pacer{next: time.Now(), stop: stop, perSec: perSec}
}

// due waits until the next request is due and reports whether it is, false
// once stop has come. The sleep paces load; it never runs past stop, so a
// slow rate cannot overrun the run. A thread that fell behind by more than
// 50 ms starts afresh instead of bursting to catch up.
func (p *pacer) due() bool {
	for {
		now := time.Now()
		if !now.Before(p.stop) {
			return false
		}
		d := p.next.Sub(now)
		if d > 0 {
			time.Sleep(min(d, p.stop.Sub(now)))
			continue
		}
		if d < -50*time.Millisecond {
			p.next = now
		}
		return true
	}
}

// spent counts n bytes moved against the rate: the next request is due
// that much later.
func (p *pacer) spent(n uint64) {
	p.next = p.next.Add(time.Duration(float64(n) / p.perSec * float64(time.Second)))
}
