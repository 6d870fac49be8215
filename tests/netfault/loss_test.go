package netfault

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
)

// TestLossKeepsTransfersIntact: with 1%, then 10%, of the packets to and
// from the target's ports (its control plane's and its data plane's)
// dropped at random, a batch of READs and a batch of WRITEs of 64 MiB, cut
// into requests of random lengths (so that slices and requests end at odd
// bytes), complete, and every byte is where it belongs: the READ's
// destination holds the target's pattern, and the target, checking its own
// memory, finds the WRITE's; three times each way. Each run moves the same
// data without loss first and logs the throughput of both.
func TestLossKeepsTransfersIntact(t *testing.T) {
	requireSuite(t)
	for _, pct := range []int{1, 10} {
		t.Run(fmt.Sprintf("%d%%", pct), func(t *testing.T) { testLoss(t, pct) })
	}
}

func testLoss(t *testing.T, pct int) {
	f := useFaults(t)
	const size = 64 << 20
	tp := startPeer(t, peerConfig{size: size})
	e := newEngine(t, engine.Options{})
	src, dst := alloc(t, e, size), alloc(t, e, size)
	seg := openSegment(t, e, tp.name)
	if addr, _ := seg.Descriptor().Transport("tcp"); addr != tp.data {
		t.Fatalf("the target's descriptor names its data plane %q, it said %q", addr, tp.data)
	}
	// Requests of 1 byte to 3 MiB, back to back over the whole range.
	rng := rand.New(rand.NewPCG(uint64(pct), 0x1055))
	var pieces [][2]int // offset, length
	for off := 0; off < size; {
		n := min(size-off, 1+rng.IntN(3<<20))
		pieces = append(pieces, [2]int{off, n})
		off += n
	}
	reqs := func(op engine.Op, local []byte) []engine.Request {
		r := make([]engine.Request, len(pieces))
		for i, p := range pieces {
			r[i] = req(op, local[p[0]:p[0]+p[1]], seg, tp.addr+uint64(p[0]))
		}
		return r
	}
	// round READs the target's pattern seedR and WRITEs seedW, checks
	// both, and returns how long each took.
	round := func(label string, seedR, seedW uint64) (read, write time.Duration) {
		tp.fill(0, size, seedR)
		fillPattern(dst, poisonSeed)
		read = transfer(t, e, 2*time.Minute, reqs(engine.Read, dst)...)
		if m := checkPattern(dst, seedR, 0); m.bad != 0 {
			t.Errorf("%s: the READ's destination: %v", label, m)
		}
		fillPattern(src, seedW)
		write = transfer(t, e, 2*time.Minute, reqs(engine.Write, src)...)
		if m := tp.check(0, size, seedW, 0); m.bad != 0 {
			t.Errorf("%s: the target's memory after the WRITE: %v", label, m)
		}
		return read, write
	}
	// rounds runs n rounds and logs the throughput of each direction, in
	// MB/s, which it returns.
	const n = 3
	rounds := func(label string, seed uint64) (read, write float64) {
		var r, w time.Duration
		for i := range uint64(n) {
			ri, wi := round(label, seed+2*i, seed+2*i+1)
			r, w = r+ri, w+wi
		}
		mbps := func(d time.Duration) float64 { return n * float64(size) / d.Seconds() / 1e6 }
		t.Logf("%s: %d x %d requests of 1 B to 3 MiB, 64 MiB each way: READ %v (%.0f MB/s), WRITE %v (%.0f MB/s)",
			label, n, len(pieces), r.Round(time.Millisecond), mbps(r), w.Round(time.Millisecond), mbps(w))
		return mbps(r), mbps(w)
	}
	round("warm-up", 1, 2) // dials every path and opens the windows
	cleanR, cleanW := rounds("no loss", 10)
	before := e.Stats()
	f.drop(tp.ports(), pct)
	lossR, lossW := rounds(fmt.Sprintf("%d%% loss", pct), 20)
	seen, dropped := f.counts()
	f.clear()
	after := e.Stats()
	rate := 100 * float64(dropped) / float64(max(seen, 1))
	t.Logf("%d%% loss on ports %v (%s): %d of %d packets dropped (%.2f%%); throughput under loss / without: READ %.3f, WRITE %.3f; slices retried %d",
		pct, tp.ports(), where, dropped, seen, rate, lossR/cleanR, lossW/cleanW, after.Retries-before.Retries)
	// The loss must have been what the test claims: the rules saw the
	// transfers' packets and dropped about pct percent of them.
	if seen < 3000 || rate < float64(pct)/3 || rate > float64(pct)*3 {
		t.Errorf("the rules dropped %d of %d packets (%.2f%%), want about %d%% of at least 3000", dropped, seen, rate, pct)
	}
}
