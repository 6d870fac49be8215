package main

import (
	"fmt"
	"sort"
)

// runMetricsCost measures what the engine's metrics cost on the data path:
// loopback runs with per-task counting on and off, alternating (on, off,
// then off, on, ...) so that drift over the run falls on both, and compares
// the medians as a ratio. Identical runs here differ by up to 1.6x, so only
// figures from one run are compared.
func runMetricsCost(c config) error {
	if c.rounds < 1 {
		return fmt.Errorf("--rounds %d: want at least 1", c.rounds)
	}
	c.mode = "loopback"
	var on, off []float64
	for r := 0; r < c.rounds; r++ {
		order := []bool{false, true} // metricsOff values
		if r%2 == 1 {
			order = []bool{true, false}
		}
		for _, metricsOff := range order {
			cc := c
			cc.metricsOff = metricsOff
			g, err := loopback(cc)
			if err != nil {
				return err
			}
			if metricsOff {
				off = append(off, g)
			} else {
				on = append(on, g)
			}
		}
	}
	mOn, mOff := medianOf(on), medianOf(off)
	fmt.Printf("RESULT mode=metrics-cost block=%d threads=%d rounds=%d metrics_on_gbps=%.3f metrics_off_gbps=%.3f on_over_off=%.4f cost_pct=%.2f\n",
		c.blockSize, c.threads, c.rounds, mOn, mOff, mOn/mOff, (1-mOn/mOff)*100)
	return nil
}

func medianOf(v []float64) float64 {
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}
