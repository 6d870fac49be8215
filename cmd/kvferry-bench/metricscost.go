package main

import (
	"fmt"
	"sort"
	"sync"
)

// runMetricsCost measures what the engine's metrics cost on the data path.
// Runs one after the other differ here by several percent, more than the
// cost to be measured, so two loopback pairs run side by side instead, at
// the same time, on the same cores: one counting (metrics on), one not. They
// share whatever the machine does meanwhile, and the one whose data path
// costs more CPU per byte moves fewer bytes. Each round gives the ratio
// on/off; the medians of the rounds are reported, with the same measurement
// of two pairs both counting (on/on) as the floor of what it can tell apart.
func runMetricsCost(c config) error {
	if c.rounds < 1 {
		return fmt.Errorf("--rounds %d: want at least 1", c.rounds)
	}
	c.mode = "loopback"
	var cost, floor []float64
	for r := 0; r < c.rounds; r++ {
		ratio, err := sideBySide(c, false, true)
		if err != nil {
			return err
		}
		cost = append(cost, ratio)
		same, err := sideBySide(c, false, false)
		if err != nil {
			return err
		}
		floor = append(floor, same)
		fmt.Printf("round %d on_over_off=%.4f on_over_on=%.4f\n", r+1, ratio, same)
	}
	mc, mf := medianOf(cost), medianOf(floor)
	fmt.Printf("RESULT mode=metrics-cost block=%d threads=%d rounds=%d on_over_off=%.4f cost_pct=%.2f on_over_on=%.4f floor_pct=%.2f\n",
		c.blockSize, c.threads, c.rounds, mc, (1-mc)*100, mf, (1-mf)*100)
	return nil
}

// sideBySide times two loopback pairs at once, the first with metrics off
// as aOff says, the second as bOff says, and returns the first's GB/s over
// the second's.
func sideBySide(c config, aOff, bOff bool) (float64, error) {
	var ready sync.WaitGroup
	gate := make(chan struct{})
	ready.Add(2)
	var g [2]float64
	var errs [2]error
	var wg sync.WaitGroup
	for i, off := range []bool{aOff, bOff} {
		var once sync.Once
		cc := c
		cc.metricsOff, cc.gate = off, gate
		cc.ready = func() { once.Do(ready.Done) }
		wg.Add(1)
		go func() {
			defer wg.Done()
			g[i], errs[i] = loopback(cc)
			// A pair that failed before it was ready must not leave
			// the other waiting at the gate.
			cc.ready()
		}()
	}
	ready.Wait()
	close(gate)
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return 0, err
		}
	}
	return g[0] / g[1], nil
}

func medianOf(v []float64) float64 {
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}
