package metrics

// SizeClasses are the labels transfer latencies are kept by: a 4 KiB and a
// 64 MiB transfer have latencies three orders apart, and one histogram of
// both would say nothing of either.
var SizeClasses = [...]string{"le_64KiB", "le_1MiB", "le_16MiB", "gt_16MiB"}

// SizeClass returns the index into SizeClasses of a transfer of n bytes.
func SizeClass(n uint64) int {
	switch {
	case n <= 64<<10:
		return 0
	case n <= 1<<20:
		return 1
	case n <= 16<<20:
		return 2
	}
	return 3
}

// LatencyBuckets are the bounds, in seconds, of the latency histograms:
// 10 µs (a small same-host copy) to about 84 s (past the default 30 s
// timeout), doubling.
var LatencyBuckets = func() []float64 {
	b := make([]float64, 24)
	v := 10e-6
	for i := range b {
		b[i] = v
		v *= 2
	}
	return b
}()
