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
	l := New(slog.New(slog.NewTextHandler(&buf, nil)))
	now := time.Unix(1000, 0)
	l.now = func() time.Time { return now }
	logged := 0
	for i := 0; i < 1000; i++ {
		if l.Warn("peer-a", "bad message", "i", i) {
			logged++
		}
	}
	if logged != DefaultBurst {
		t.Fatalf("logged %d lines of 1000, want the burst %d", logged, DefaultBurst)
	}
	if got := l.Suppressed(); got != 1000-DefaultBurst {
		t.Fatalf("suppressed %d, want %d", got, 1000-DefaultBurst)
	}
	now = now.Add(DefaultInterval)
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
	l := New(slog.New(slog.NewTextHandler(&buf, nil)))
	now := time.Unix(1000, 0)
	l.now = func() time.Time { return now }
	logged := 0
	for i := 0; i < 100000; i++ {
		if l.Warn(fmt.Sprint("peer-", i), "bad message") {
			logged++
		}
	}
	if logged > maxKeys+DefaultBurst {
		t.Fatalf("%d distinct keys logged %d lines; want at most %d", 100000, logged, maxKeys+DefaultBurst)
	}
	if len(l.keys) > maxKeys+1 {
		t.Fatalf("the limiter remembers %d keys, cap %d", len(l.keys), maxKeys)
	}
}
