package main

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvferry/kvferry/engine"
)

// runSameHost compares, between two processes on this host and with one
// submitting thread, kvferry over the same-host transport (shm) with
// kvferry over loopback tcp, and with one core's memcpy, in rounds that
// alternate, in one run:
//   - engine-allocated buffers (shareable memory: the owner copies through
//     a view of them) at 64 KiB, 1 MiB and 4 MiB, WRITE and READ;
//   - other registered memory (private anonymous memory: the owner copies
//     by cross-memory attach) at 1 MiB, WRITE and READ;
//   - memcpy of 1 MiB blocks between two buffers of this process.
//
// Each figure is the median of the rounds; the ratios are of figures of
// this run only.
func runSameHost(c config) error {
	const rounds = 3
	const bufSize = 64 << 20
	tc := c
	tc.blockSize = bufSize // the target's buffer
	target, segment, remote, err := startTarget(tc)
	if err != nil {
		return err
	}
	defer stopChild(target)

	type side struct {
		e       *engine.Engine
		seg     *engine.Segment
		shared  []byte // from AllocBuffer
		private []byte // mmap'd here and registered
	}
	sides := map[string]*side{}
	ctx := context.Background()
	for _, proto := range []string{"tcp", "shm"} {
		// The engine's own path count (--paths when given): one thread
		// submits, the engine spreads its slices over the paths.
		paths := 0
		if c.pathsGiven {
			paths = c.pathCount
		}
		e, err := engine.New(engine.Options{Host: c.host, Protocol: proto, IgnoreEnv: true, PathsPerPeer: paths, SliceSize: c.sliceSize})
		if err != nil {
			return fmt.Errorf("engine over %s: %w", proto, err)
		}
		defer e.Close()
		s := &side{e: e}
		if s.shared, err = e.AllocBuffer(bufSize, "cpu"); err != nil {
			return err
		}
		if s.private, err = unix.Mmap(-1, 0, bufSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_POPULATE); err != nil {
			return err
		}
		defer unix.Munmap(s.private)
		if _, err := e.RegisterMemory(s.private, "cpu"); err != nil {
			return err
		}
		if s.seg, err = e.OpenSegment(ctx, segment); err != nil {
			return err
		}
		sides[proto] = s
	}
	// Integrity first, untimed, both ways and both kinds of memory.
	for proto, s := range sides {
		for _, mem := range [][]byte{s.shared, s.private} {
			fill(mem, 0, c.seed^0xa5)
			if err := moveAll(ctx, s.e, s.seg, engine.Write, engine.AddrOf(mem), remote, bufSize); err != nil {
				return fmt.Errorf("%s: integrity write: %w", proto, err)
			}
			clear(mem)
			if err := moveAll(ctx, s.e, s.seg, engine.Read, engine.AddrOf(mem), remote, bufSize); err != nil {
				return fmt.Errorf("%s: integrity read: %w", proto, err)
			}
			if err := verify(mem, 0, c.seed^0xa5); err != nil {
				return fmt.Errorf("%s: data written and read back: %w", proto, err)
			}
		}
	}
	fmt.Printf("integrity: ok (%d bytes written and read back per protocol and kind of memory)\n", bufSize)
	if st := sides["shm"].e.Stats(); st.SHMSharedSlices == 0 || st.SHMAttachSlices == 0 {
		fmt.Printf("note: shm slices through shared buffers %d, by cross-memory attach %d, over tcp %d\n",
			st.SHMSharedSlices, st.SHMAttachSlices, st.SHMFallbackSlices)
	}

	pathsShown := "engine default"
	if c.pathsGiven {
		pathsShown = strconv.Itoa(c.pathCount)
	}
	per := time.Duration(c.duration * float64(time.Second) / float64(2*rounds))
	// timed moves one block after another, batchSize per Transfer, for
	// per, and returns GB/s.
	timed := func(s *side, mem []byte, op engine.Op, block int) (float64, error) {
		reqs := make([]engine.Request, c.batchSize)
		var moved uint64
		off := 0
		start := time.Now()
		for time.Since(start) < per {
			for i := range reqs {
				if off+block > bufSize {
					off = 0
				}
				reqs[i] = engine.Request{Op: op, Local: engine.AddrOf(mem) + uint64(off), Segment: s.seg, Remote: remote + uint64(off), Length: uint64(block)}
				off += block
			}
			if _, err := s.e.Transfer(ctx, reqs); err != nil {
				return 0, err
			}
			moved += uint64(block * len(reqs))
		}
		return float64(moved) / time.Since(start).Seconds() / 1e9, nil
	}
	compare := func(memKind string, op engine.Op, block int) (tcp, shm float64, err error) {
		var t, m []float64
		for r := range rounds {
			order := []string{"tcp", "shm"}
			if r%2 == 1 {
				order = []string{"shm", "tcp"}
			}
			for _, proto := range order {
				s := sides[proto]
				mem := s.shared
				if memKind == "private" {
					mem = s.private
				}
				g, err := timed(s, mem, op, block)
				if err != nil {
					return 0, 0, fmt.Errorf("%s %s %d over %s: %w", memKind, op, block, proto, err)
				}
				if proto == "tcp" {
					t = append(t, g)
				} else {
					m = append(m, g)
				}
			}
		}
		return medianF(t), medianF(m), nil
	}
	// memcpy sweeps two 64 MiB buffers of written memory in 1 MiB
	// blocks, as the transfers do: out of the caches, like them (a block
	// copied over and over from the cache runs about twice as fast).
	memcpyGBps := func() float64 {
		a, b := make([]byte, bufSize), make([]byte, bufSize)
		fill(b, 0, c.seed)
		copy(a, b)
		var g []float64
		for range rounds {
			var moved int
			start := time.Now()
			for off := 0; time.Since(start) < per; off = (off + 1<<20) % bufSize {
				copy(a[off:off+1<<20], b[off:off+1<<20])
				moved += 1 << 20
			}
			g = append(g, float64(moved)/time.Since(start).Seconds()/1e9)
		}
		return medianF(g)
	}

	fmt.Printf("kvferry-bench: mode=samehost segment=%s batch=%d threads=1 paths=%s rounds=%d duration=%gs\n",
		segment, c.batchSize, pathsShown, rounds, c.duration)
	fmt.Printf("%-6s %-8s %-9s %9s %9s %7s\n", "op", "memory", "block", "tcp GB/s", "shm GB/s", "shm/tcp")
	var shm1M float64
	for _, row := range []struct {
		mem   string
		block int
	}{{"engine", 64 << 10}, {"engine", 1 << 20}, {"engine", 4 << 20}, {"private", 1 << 20}} {
		for _, op := range []engine.Op{engine.Write, engine.Read} {
			kind := "shared"
			if row.mem == "private" {
				kind = "private"
			}
			t, m, err := compare(kind, op, row.block)
			if err != nil {
				return err
			}
			if row.mem == "engine" && row.block == 1<<20 && op == engine.Write {
				shm1M = m
			}
			name := strings.ToLower(op.String())
			fmt.Printf("%-6s %-8s %-9d %9.3f %9.3f %6.2fx\n", name, row.mem, row.block, t, m, m/t)
			fmt.Printf("RESULT mode=samehost op=%s memory=%s block=%d tcp_gbps=%.3f shm_gbps=%.3f shm_over_tcp=%.2f\n", name, row.mem, row.block, t, m, m/t)
		}
	}
	mc := memcpyGBps()
	fmt.Printf("memcpy, one core, 1 MiB blocks over 64 MiB: %.3f GB/s; shm WRITE of engine buffers at 1 MiB is %.2fx of it\n", mc, shm1M/mc)
	fmt.Printf("RESULT mode=samehost what=memcpy block=1048576 gbps=%.3f shm_write_over_memcpy=%.2f\n", mc, shm1M/mc)
	return nil
}
