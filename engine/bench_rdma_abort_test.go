package engine_test

// Benchmarks of what safety costs on rdma (the fake provider by default,
// real devices with KVFERRY_TEST_RDMA=1): how long an Abort takes to report
// Safe while other traffic runs, and what a new request id costs a
// transfer. Run with:
//
//	go test ./engine -run '^$' -bench 'RDMAAbortToSafe|RDMANewRequestID' -benchtime 200x
//
// They report ratios and percentiles measured in the same run; the figures
// depend on the machine.

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/internal/fakeverbs"
)

func benchRDMAPair(b *testing.B, n int, fenceGrace time.Duration) (owner, init *engine.Engine, dst, src []byte, seg *engine.Segment) {
	b.Helper()
	opts := engine.Options{IgnoreEnv: true, Protocol: "rdma", RDMALibrary: fakeverbs.Library(b), RDMADevices: fakeverbs.Devices(""),
		Logger: slog.New(slog.DiscardHandler), RDMAFenceGrace: fenceGrace}
	mk := func() *engine.Engine {
		e, err := engine.New(opts)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = e.Close() })
		return e
	}
	owner, init = mk(), mk()
	var err error
	if dst, err = owner.AllocBuffer(n, "cpu"); err != nil {
		b.Fatal(err)
	}
	if src, err = init.AllocBuffer(n, "cpu"); err != nil {
		b.Fatal(err)
	}
	if seg, err = init.OpenSegment(context.Background(), owner.Name()); err != nil {
		b.Fatal(err)
	}
	return owner, init, dst, src, seg
}

// BenchmarkRDMAAbortToSafe measures, per abort, the time from Abort's call
// to its Safe result, for a request with a 1 MiB WRITE submitted 0 to 2 ms
// before,
// while another goroutine of the same initiator writes 4 MiB requests of
// request id 0 to the same owner at about 1 GB/s. It reports the 50th and
// 99th percentiles and the background throughput reached, for the default
// (a drained ACK within RDMAFenceGrace, else the fence) and for the fence
// at once.
func BenchmarkRDMAAbortToSafe(b *testing.B) {
	b.Run("ack-or-fence", func(b *testing.B) { benchAbortToSafe(b, 0) })
	b.Run("fence-at-once", func(b *testing.B) { benchAbortToSafe(b, -1) })
}

func benchAbortToSafe(b *testing.B, fenceGrace time.Duration) {
	const slot, bg = 1 << 20, 4 << 20
	owner, init, dst, src, seg := benchRDMAPair(b, 2*slot+bg, fenceGrace)
	base := engine.AddrOf(dst)
	ctx, stop := context.WithCancel(context.Background())
	var moved, failed atomic.Uint64
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // ~1 GB/s of other traffic: one 4 MiB WRITE every 4 ms
		defer wg.Done()
		tick := time.NewTicker(4 * time.Millisecond)
		defer tick.Stop()
		req := engine.Request{Op: engine.Write, Local: engine.AddrOf(src[2*slot:]), Segment: seg, Remote: base + 2*slot, Length: bg}
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			tctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			if _, err := init.Transfer(tctx, []engine.Request{req}); err == nil {
				moved.Add(bg)
			} else if failed.Add(1) == 1 {
				b.Logf("background transfer: %v", err)
			}
			cancel()
		}
	}()
	for moved.Load() == 0 && failed.Load() == 0 {
		// Polls the counters until the background traffic has moved (or
		// failed) once, so that it runs before the first abort; each
		// background transfer has a 5 s deadline, so one of them moves.
		time.Sleep(time.Millisecond)
	}
	lat := make([]time.Duration, 0, b.N)
	notSafe := 0
	rng := rand.New(rand.NewPCG(1, 2))
	start := time.Now()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		rid := uint64(1000 + i)
		ba, err := init.AllocateBatch(1)
		if err != nil {
			b.Fatal(err)
		}
		off := uint64(i%2) * slot
		req := engine.Request{Op: engine.Write, Local: engine.AddrOf(src[off:]), Segment: seg, Remote: base + off, Length: slot, RequestID: rid}
		if err := ba.Submit(context.Background(), []engine.Request{req}); err != nil {
			b.Fatal(err)
		}
		// Abort at a random moment of the request's flight (fixed seed).
		time.Sleep(time.Duration(rng.IntN(2000)) * time.Microsecond) // elapsed time, deliberately: the abort's moment
		actx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		t0 := time.Now()
		res, err := owner.Abort(actx, rid, []string{init.Name()})
		d := time.Since(t0)
		cancel()
		if err != nil {
			b.Fatal(err)
		}
		if !res.Safe {
			notSafe++
		}
		lat = append(lat, d)
		_ = ba.Wait(context.Background())
		_ = ba.Free()
	}
	b.StopTimer()
	elapsed := time.Since(start)
	stop()
	wg.Wait()
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-us")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "p99-us")
	b.ReportMetric(float64(moved.Load())/elapsed.Seconds()/1e9, "bg-GB/s")
	b.ReportMetric(float64(notSafe), "not-safe")
	b.ReportMetric(float64(failed.Load()), "bg-failed")
}

// BenchmarkRDMANewRequestID measures a 64 KiB WRITE with a new request id
// each time against the same WRITE under one request id: the owner admits
// each new request id before its first byte moves (one control-plane round
// trip), so the difference is what a new request id costs.
func BenchmarkRDMANewRequestID(b *testing.B) {
	const n = 64 << 10
	for _, tc := range []struct {
		name string
		rid  func(i int) uint64
	}{
		{"same-id", func(int) uint64 { return 7 }},
		{"new-id", func(i int) uint64 { return uint64(1_000_000 + i) }},
		{"no-id", func(int) uint64 { return 0 }},
	} {
		b.Run(tc.name, func(b *testing.B) {
			_, init, dst, src, seg := benchRDMAPair(b, n, 0)
			b.SetBytes(n)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				req := engine.Request{Op: engine.Write, Local: engine.AddrOf(src), Segment: seg, Remote: engine.AddrOf(dst), Length: n, RequestID: tc.rid(i)}
				if _, err := init.Transfer(context.Background(), []engine.Request{req}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
