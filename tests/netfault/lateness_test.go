package netfault

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"
)

// lateness keeps, per kind of call, the most a call returned past its
// deadline.
type lateness struct {
	mu    sync.Mutex
	max   map[string]time.Duration
	calls map[string]int
}

func (l *lateness) add(kind string, took, deadline time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.max == nil {
		l.max, l.calls = map[string]time.Duration{}, map[string]int{}
	}
	l.calls[kind]++
	if late := took - deadline; late > l.max[kind] || l.calls[kind] == 1 {
		l.max[kind] = late
	}
}

// worst is the most any call returned past its deadline.
func (l *lateness) worst() time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	w := time.Duration(-1 << 63)
	for _, v := range l.max {
		w = max(w, v)
	}
	return w
}

func (l *lateness) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var parts []string
	for k, v := range l.max {
		if v > 0 {
			parts = append(parts, fmt.Sprintf("%s: %d calls, the latest %v past its deadline", k, l.calls[k], v.Round(time.Microsecond)))
		} else {
			parts = append(parts, fmt.Sprintf("%s: %d calls, all by their deadline (the latest %v before it)", k, l.calls[k], (-v).Round(time.Microsecond)))
		}
	}
	slices.Sort(parts)
	return strings.Join(parts, "; ")
}
