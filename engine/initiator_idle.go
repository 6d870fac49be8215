package engine

import (
	"errors"
	"slices"
	"time"
)

// errPathIdle ends a path closed because its peer was idle; nothing was on
// it.
var errPathIdle = errors.New("path closed: peer idle")

// pingDue reports whether the heartbeats ping s at this tick: a segment in
// use every tick, an idle one (nothing in flight, nothing submitted for
// idleEvery) once every idleEvery, so that many idle peers cost little
// traffic. It records the ping.
func (s *Segment) pingDue(now int64, idleEvery time.Duration) bool {
	every := idleEvery.Nanoseconds()
	idle := s.inflight.Load() == 0 && now-s.lastUsed.Load() >= every
	if last := s.lastPing.Load(); idle && last != 0 && now-last < every {
		return false
	}
	s.lastPing.Store(now)
	return true
}

// openPaths counts the segment's dialed paths.
func (s *Segment) openPaths() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, p := range s.paths {
		if p != nil {
			n++
		}
	}
	return n
}

// closeIdlePaths closes the segment's paths when nothing is in flight to it
// and no dial is under way; the next transfer dials again. Submit counts a
// task in before it asks for a path, and path() reads the slots under s.mu,
// so a transfer either is counted here or finds the slots empty.
func (s *Segment) closeIdlePaths() int {
	s.mu.Lock()
	if s.inflight.Load() != 0 || s.closed != nil {
		s.mu.Unlock()
		return 0
	}
	for _, d := range s.dialing {
		if d != nil {
			s.mu.Unlock()
			return 0
		}
	}
	var cut []*pathRef
	for i, p := range s.paths {
		if p != nil {
			cut = append(cut, p)
			s.paths[i] = nil
		}
	}
	s.mu.Unlock()
	for _, p := range cut {
		p.ep.Abort(errPathIdle)
	}
	return len(cut)
}

// trimIdle closes the paths of segments idle past PathIdleTimeout, then
// those of the least recently used idle segments until the paths kept to
// idle segments fit IdlePaths.
func (e *Engine) trimIdle(now int64, segs []*Segment) {
	type idleSeg struct {
		s     *Segment
		used  int64
		paths int
	}
	var idle []idleSeg
	kept := 0
	for _, s := range segs {
		if s.inflight.Load() != 0 {
			continue
		}
		n := s.openPaths()
		if n == 0 {
			continue
		}
		used := s.lastUsed.Load()
		if now-used >= e.opts.PathIdleTimeout.Nanoseconds() {
			e.stats.pathsClosedIdle.Add(uint64(s.closeIdlePaths()))
			continue
		}
		idle = append(idle, idleSeg{s, used, n})
		kept += n
	}
	if kept <= e.opts.IdlePaths {
		return
	}
	slices.SortFunc(idle, func(a, b idleSeg) int { return int(min(max(a.used-b.used, -1), 1)) })
	for _, x := range idle {
		if kept <= e.opts.IdlePaths {
			break
		}
		closed := x.s.closeIdlePaths()
		e.stats.pathsClosedIdle.Add(uint64(closed))
		kept -= closed
	}
}

// openPathCount counts the paths to peers open now.
func (e *Engine) openPathCount() int {
	e.segMu.Lock()
	segs := make([]*Segment, 0, len(e.segments))
	for _, s := range e.segments {
		if !s.self {
			segs = append(segs, s)
		}
	}
	e.segMu.Unlock()
	n := 0
	for _, s := range segs {
		n += s.openPaths()
	}
	return n
}
