// Package ratelog rate-limits log lines that a peer can cause, so that a
// peer sending garbage cannot fill the host's logs or spend its CPU on
// formatting: each key may log a burst of lines per interval, and the lines
// suppressed are counted and reported with the next line that is allowed.
package ratelog

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// Default limits: a burst of 5 lines per key every 10 s.
const (
	DefaultBurst    = 5
	DefaultInterval = 10 * time.Second
	// maxKeys caps the keys remembered; past it every key shares one
	// budget, so a peer that varies its key cannot grow the table.
	maxKeys = 1024
)

// Limiter decides which lines are logged. The zero value is not usable;
// make one with New. It is safe for concurrent use.
type Limiter struct {
	log      *slog.Logger
	burst    int
	interval time.Duration

	mu        sync.Mutex
	keys      map[string]*window
	lastSweep time.Time
	now       func() time.Time // for tests
}

type window struct {
	start      time.Time
	logged     int
	suppressed uint64
}

// New returns a Limiter logging to log (slog.Default when nil) with the
// default burst and interval.
func New(log *slog.Logger) *Limiter {
	if log == nil {
		log = slog.Default()
	}
	return &Limiter{log: log, burst: DefaultBurst, interval: DefaultInterval, keys: map[string]*window{}, now: time.Now}
}

// Warn logs msg at warning level unless key has used its burst in the
// current interval; args are slog key-value pairs. It reports whether the
// line was logged.
func (l *Limiter) Warn(key, msg string, args ...any) bool {
	return l.logAt(slog.LevelWarn, key, msg, args...)
}

// Suppressed returns the lines suppressed so far and not yet reported.
func (l *Limiter) Suppressed() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	var n uint64
	for _, w := range l.keys {
		n += w.suppressed
	}
	return n
}

func (l *Limiter) logAt(level slog.Level, key, msg string, args ...any) bool {
	if !l.log.Enabled(context.Background(), level) {
		return false
	}
	now := l.now()
	l.mu.Lock()
	w := l.keys[key]
	if w == nil {
		if len(l.keys) >= maxKeys && now.Sub(l.lastSweep) >= l.interval {
			// Forget windows that ended, at most once an interval so that
			// a flood of new keys costs O(1) each.
			l.lastSweep = now
			for k, old := range l.keys {
				if now.Sub(old.start) >= l.interval && old.suppressed == 0 {
					delete(l.keys, k)
				}
			}
		}
		if len(l.keys) >= maxKeys {
			key = "\x00overflow" // every new key shares one budget
		}
		if w = l.keys[key]; w == nil {
			w = &window{start: now}
			l.keys[key] = w
		}
	}
	if now.Sub(w.start) >= l.interval {
		w.start, w.logged = now, 0
	}
	if w.logged >= l.burst {
		w.suppressed++
		l.mu.Unlock()
		return false
	}
	w.logged++
	suppressed := w.suppressed
	w.suppressed = 0
	l.mu.Unlock()
	if suppressed > 0 {
		args = append(args, "suppressed_before", suppressed)
	}
	l.log.Log(context.Background(), level, msg, args...)
	return true
}
