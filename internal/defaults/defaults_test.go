package defaults

import (
	"testing"
	"time"
)

// filled is what Fill leaves in a field holding in, for def.
func filled[T Number](in, def T) T {
	Fill(&in, def)
	return in
}

func TestFillReplacesZeroAndNegativeAndKeepsPositive(t *testing.T) {
	for _, c := range []struct{ name, got, want any }{
		{"int 0", filled(0, 7), 7},
		{"int -1", filled(-1, 7), 7},
		{"int -2^62", filled(-1<<62, 7), 7},
		{"int 1", filled(1, 7), 1},
		{"uint64 0", filled[uint64](0, 9), uint64(9)},
		{"uint64 max", filled[uint64](1<<64-1, 9), uint64(1<<64 - 1)},
		{"Duration 0", filled(0, time.Second), time.Second},
		{"Duration -1ns", filled(-time.Nanosecond, time.Second), time.Second},
		{"Duration 1ns", filled(time.Nanosecond, time.Second), time.Nanosecond},
		{"float64 -0.25", filled(-0.25, 0.5), 0.5},
		{"float64 1e-9", filled(1e-9, 0.5), 1e-9},
	} {
		if c.got != c.want {
			t.Errorf("%s: %v, want %v", c.name, c.got, c.want)
		}
	}
}
