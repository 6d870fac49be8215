package ratelog

import (
	"bytes"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"
)

func TestBurstThenSuppressedThenReported(t *testing.T) {
	var buf bytes.Buffer
	l, now := testLimiter(&buf)
	logged := warnEach(l, 1000, func(int) string { return "peer-a" })
	if logged != DefaultBurst {
		t.Fatalf("logged %d lines of 1000, want the burst %d", logged, DefaultBurst)
	}
	if got := l.Suppressed(); got != 1000-DefaultBurst {
		t.Fatalf("suppressed %d, want %d", got, 1000-DefaultBurst)
	}
	*now = now.Add(DefaultInterval)
	if !l.Warn("peer-a", "bad message") {
		t.Fatal("a line after the interval was suppressed")
	}
	if !strings.Contains(buf.String(), fmt.Sprintf("suppressed_before=%d", 1000-DefaultBurst)) {
		t.Fatalf("the first line after the interval does not report the suppressed count:\n%s", buf.String())
	}
	if l.Suppressed() != 0 {
		t.Fatalf("suppressed %d after reporting, want 0", l.Suppressed())
	}
}

func TestManyKeysShareOneBudgetPastTheCap(t *testing.T) {
	var buf bytes.Buffer
	l, _ := testLimiter(&buf)
	logged := warnEach(l, 100000, func(i int) string { return fmt.Sprint("peer-", i) })
	if logged > maxKeys+DefaultBurst {
		t.Fatalf("%d distinct keys logged %d lines; want at most %d", 100000, logged, maxKeys+DefaultBurst)
	}
	if len(l.keys) > maxKeys+1 {
		t.Fatalf("the limiter remembers %d keys, cap %d", len(l.keys), maxKeys)
	}
}

// testLimiter returns a limiter writing text lines to buf, on a clock that
// moves only when the test moves *now.
func testLimiter(buf *bytes.Buffer) (*Limiter, *time.Time) {
	l := New(slog.New(slog.NewTextHandler(buf, nil)))
	now := time.Unix(1000, 0)
	l.now = func() time.Time { return now }
	return l, &now
}

// warnEach warns n times, the i-th under key(i) with attribute i, and
// returns how many lines were logged.
func warnEach(l *Limiter, n int, key func(i int) string) int {
	logged := 0
	for i := 0; i < n; i++ {
		if l.Warn(key(i), "bad message", "i", i) {
			logged++
		}
	}
	return logged
}
