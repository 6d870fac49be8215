package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"time"

	"github.com/kvferry/kvferry/engine"
)

// runAuthCompare measures what authentication costs, in one run so the
// figures compare: the time to open a peer (control handshake and
// descriptor) and to move its first block (data connections' handshakes),
// and loopback throughput at 64 KiB, 1 MiB and 4 MiB blocks, without and
// with a cluster secret, in rounds that alternate which goes first.
func runAuthCompare(c config) error {
	secret := c.clusterSecret
	if secret == "" {
		dir, err := os.MkdirTemp("", "kvferry-bench-auth")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		secret = filepath.Join(dir, "cluster.secret")
		if err := os.WriteFile(secret, []byte("kvferry-bench cluster secret, 32 bytes\n"), 0o600); err != nil {
			return err
		}
	}
	const handshakes = 15
	for _, on := range []bool{false, true} {
		cc := c
		if on {
			cc.clusterSecret = secret
		} else {
			cc.clusterSecret = ""
		}
		var opens, firsts []time.Duration
		for range handshakes {
			open, first, err := handshakeTimes(cc)
			if err != nil {
				return fmt.Errorf("handshake (authentication %v): %w", on, err)
			}
			opens, firsts = append(opens, open), append(firsts, first)
		}
		fmt.Printf("RESULT mode=auth what=handshake auth=%v open_segment_us=%d first_block_us=%d (medians of %d)\n",
			on, median(opens).Microseconds(), median(firsts).Microseconds(), handshakes)
	}
	const rounds = 3
	for _, size := range []int{64 << 10, 1 << 20, 4 << 20} {
		var off, on []float64
		for round := range rounds {
			order := []bool{false, true}
			if round%2 == 1 {
				order = []bool{true, false}
			}
			for _, auth := range order {
				cc := c
				cc.blockSize, cc.clusterSecret = size, ""
				if auth {
					cc.clusterSecret = secret
				}
				if cc.bufferSize < cc.threads*cc.blockSize {
					return fmt.Errorf("--buffer-size %d is smaller than --threads x %d", cc.bufferSize, size)
				}
				gbps, err := loopback(cc)
				if err != nil {
					return fmt.Errorf("block %d, authentication %v: %w", size, auth, err)
				}
				if auth {
					on = append(on, gbps)
				} else {
					off = append(off, gbps)
				}
			}
		}
		mo, mn := medianF(off), medianF(on)
		fmt.Printf("RESULT mode=auth what=throughput op=%s block=%d off_gbps=%.3f on_gbps=%.3f on_over_off=%.3f (medians of %d rounds)\n",
			c.op, size, mo, mn, mn/mo, rounds)
	}
	return nil
}

// handshakeTimes starts a target and an initiator, and returns how long
// opening the target's segment took and how long the first 4 KiB write
// took (it dials the data connection).
func handshakeTimes(c config) (open, first time.Duration, err error) {
	target, buf, err := c.newEngine(1 << 20)
	if err != nil {
		return 0, 0, err
	}
	defer target.Close()
	init, local, err := c.newEngine(1 << 20)
	if err != nil {
		return 0, 0, err
	}
	defer init.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	t0 := time.Now()
	seg, err := init.OpenSegment(ctx, target.Name())
	if err != nil {
		return 0, 0, err
	}
	open = time.Since(t0)
	t0 = time.Now()
	_, err = init.Transfer(ctx, []engine.Request{{Op: engine.Write, Local: engine.AddrOf(local), Segment: seg,
		Remote: engine.AddrOf(buf), Length: 4096}})
	return open, time.Since(t0), err
}

func median(d []time.Duration) time.Duration {
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	return d[len(d)/2]
}

func medianF(f []float64) float64 {
	sort.Float64s(f)
	return f[len(f)/2]
}
