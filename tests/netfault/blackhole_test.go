package netfault

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/internal/childproc"
)

// deadlineSlack is how long past its deadline a call may return (SAFETY.md
// promise 3: "returns by it, plus a small documented bound"); the same bound
// as engine/stoppedpeer_test.go's against a stopped peer.
const deadlineSlack = 500 * time.Millisecond

// peerDeadAfter is when an engine declares a silent peer dead with the
// default options (HeartbeatInterval x HeartbeatMisses): its transfers in
// flight then fail, where a shorter silence lets them go on.
const peerDeadAfter = 5 * time.Second

// TestBlackholeCallsKeepDeadlinesAndTransfersResume: every packet between
// the two engines (every port of both: a partition) is dropped for 3 s,
// then for 12 s. Meanwhile:
//
//   - Transfer (WRITE and READ), Notify, OpenSegment (from a third engine),
//     Batch.Submit and Batch.Wait, called again and again with short
//     deadlines, each fail and return by their deadline + deadlineSlack, and
//     Batch.Cancel returns within deadlineSlack; none completes;
//   - the target (owner) aborts a request whose WRITE is stuck in the hole:
//     the Abort is Safe by its deadline + deadlineSlack without any word from
//     the initiator, and the target reuses the range at once;
//   - a WRITE submitted into the hole with a long deadline completes intact
//     when the hole is shorter than peerDeadAfter, and fails before the hole
//     ends when it is longer (the peer was declared dead) instead of hanging.
//
// Once the rules are gone a transfer completes again within a minute (the
// time it took is logged); the aborted request's WRITE never lands in the
// reused range (when its paths survived the hole, its first frames, stuck
// in the sockets, arrive and are refused, and the initiator's WRITE ends
// ABORTED); no timed-out WRITE sent bytes of its source written after the
// call returned, and no timed-out READ wrote into its destination after it
// returned; new data moves intact both ways.
func TestBlackholeCallsKeepDeadlinesAndTransfersResume(t *testing.T) {
	requireSuite(t)
	for _, hole := range []time.Duration{3 * time.Second, 12 * time.Second} {
		t.Run(hole.String(), func(t *testing.T) { testBlackhole(t, hole) })
	}
}

func testBlackhole(t *testing.T, hole time.Duration) {
	f := useFaults(t)
	const (
		mb   = 1 << 20
		size = 64 * mb
		// Patterns.
		seedOld, seedCall, seedMarker, seedMarkerR, seedIn, seedAborted, seedReuse, seedFinal = 21, 22, 23, 24, 25, 26, 27, 28
		// Request ids.
		ridIn, ridAborted, ridNotify = 1, 2, 3
		abortDeadline                = 2 * time.Second
	)
	// Ranges, the same in the initiator's buffer and the target's.
	type span struct{ lo, hi int }
	var (
		callW    = span{0, 8 * mb} // Transfer WRITEs with short deadlines
		callR    = span{8 * mb, 16 * mb}
		batchW   = span{16 * mb, 24 * mb} // Batch.Submit/Wait/Cancel WRITEs
		inFlight = span{24 * mb, 40 * mb} // WRITE submitted into the hole, long deadline
		aborted  = span{40 * mb, 56 * mb} // WRITE submitted into the hole, aborted by the target
		probe    = span{56 * mb, 64 * mb} // warm-up, recovery and the final check
	)
	tp := startPeer(t, peerConfig{size: size})
	e := newEngine(t, engine.Options{})
	other := newEngine(t, engine.Options{})
	local := alloc(t, e, size)
	mem := func(s span) []byte { return local[s.lo:s.hi] }
	at := func(s span) uint64 { return tp.addr + uint64(s.lo) }
	seg := openSegment(t, e, tp.name)
	// Patterns start at each range's first byte.
	for _, s := range []span{callW, callR, batchW, inFlight, aborted, probe} {
		tp.fill(s.lo, s.hi-s.lo, seedOld)
	}
	// Every path dialed and carrying data before the hole.
	transfer(t, e, 30*time.Second, req(engine.Read, mem(probe), seg, at(probe)))

	eData, _ := e.Descriptor().Transport("tcp")
	ports := append(tp.ports(), portOf(t, e.Name()), portOf(t, eData))

	type outcome struct {
		res engine.TaskResult
		at  time.Duration // since the hole began
	}
	fillPattern(mem(inFlight), seedIn)
	fillPattern(mem(aborted), seedAborted)
	f.drop(ports, 100)
	start := time.Now()
	end := start.Add(hole)
	// submit starts a WRITE of s as request rid, into the hole, and
	// reports its outcome.
	submit := func(rid uint64, s span) <-chan outcome {
		b, err := e.AllocateBatch(1)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		r := req(engine.Write, mem(s), seg, at(s))
		r.RequestID = rid
		if err := b.Submit(ctx, []engine.Request{r}); err != nil {
			t.Fatalf("submit request %d into the hole: %v", rid, err)
		}
		ch := make(chan outcome, 1)
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), hole+time.Minute)
			defer cancel()
			if b.Wait(ctx) != nil {
				_ = b.Cancel()
			}
			ch <- outcome{b.Results()[0], time.Since(start)}
			_ = b.Free()
		}()
		return ch
	}
	// The WRITE to be aborted first: its first slices are at the head of
	// every path, in the sockets' buffers when the rest of both waits.
	abortedDone := submit(ridAborted, aborted)
	inFlightDone := submit(ridIn, inFlight)
	abortReply := tp.async("abort %s %d %d %d %d %d", e.Name(), ridAborted, abortDeadline.Milliseconds(), aborted.lo, aborted.hi-aborted.lo, seedReuse)

	// Calls with short deadlines, over and over, until the hole ends; none
	// is started unless it ends, slack included, before the hole does.
	var lat lateness
	var wg sync.WaitGroup
	loop := func(kind string, deadline time.Duration, call func(ctx context.Context) error) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Until(end) > deadline+deadlineSlack {
				ctx, cancel := context.WithTimeout(context.Background(), deadline)
				began := time.Now()
				err := call(ctx)
				took := time.Since(began)
				cancel()
				lat.add(kind, took, deadline)
				if err == nil {
					t.Errorf("%s succeeded %v into the blackhole", kind, began.Sub(start))
				}
				if took > deadline+deadlineSlack {
					t.Errorf("%s returned %v past its %v deadline (%v into the hole): %v", kind, took-deadline, deadline, began.Sub(start), err)
				}
				// Calls failing at once (the peer declared dead) are not
				// repeated more than ten times a second.
				time.Sleep(time.Until(began.Add(100 * time.Millisecond)))
			}
		}()
	}
	loop("Transfer WRITE 8 MiB, 400 ms", 400*time.Millisecond, func(ctx context.Context) error {
		fillPattern(mem(callW), seedCall)
		_, err := e.Transfer(ctx, []engine.Request{req(engine.Write, mem(callW), seg, at(callW))})
		// The call returned: the engine must not read the source any more.
		fillPattern(mem(callW), seedMarker)
		return err
	})
	loop("Transfer READ 8 MiB, 600 ms", 600*time.Millisecond, func(ctx context.Context) error {
		_, err := e.Transfer(ctx, []engine.Request{req(engine.Read, mem(callR), seg, at(callR))})
		// The call returned: nothing may land in the destination any more.
		fillPattern(mem(callR), seedMarkerR)
		return err
	})
	loop("Notify, 300 ms", 300*time.Millisecond, func(ctx context.Context) error {
		return e.Notify(ctx, seg, ridNotify, []byte("kv ready"))
	})
	loop("OpenSegment from another engine, 500 ms", 500*time.Millisecond, func(ctx context.Context) error {
		_, err := other.OpenSegment(ctx, tp.name)
		return err
	})
	loop("Batch.Submit + Batch.Wait 8 MiB WRITE, 300 ms", 300*time.Millisecond, func(ctx context.Context) error {
		b, err := e.AllocateBatch(1)
		if err != nil {
			t.Errorf("AllocateBatch: %v", err)
			return err
		}
		defer func() { _ = b.Free() }()
		fillPattern(mem(batchW), seedCall)
		if err := b.Submit(ctx, []engine.Request{req(engine.Write, mem(batchW), seg, at(batchW))}); err != nil {
			fillPattern(mem(batchW), seedMarker)
			return err
		}
		err = b.Wait(ctx)
		began := time.Now()
		cerr := b.Cancel()
		took := time.Since(began)
		lat.add("Batch.Cancel", took, 0)
		if took > deadlineSlack || cerr != nil {
			t.Errorf("Batch.Cancel in the hole: %v after %v, want nil within %v", cerr, took, deadlineSlack)
		}
		fillPattern(mem(batchW), seedMarker)
		if err == nil {
			if r := b.Results()[0]; r.Status != engine.Completed {
				err = r.Err // ended before the deadline, failed (peer declared dead)
			}
		}
		return err
	})
	wg.Wait()
	time.Sleep(time.Until(end)) // the rest of the hole: the fault itself
	f.clear()
	lifted := time.Now()
	seen, dropped := f.counts()

	// The target's abort, made in the hole.
	r, ok := tp.await(abortReply, time.Minute)
	if !ok {
		t.Fatal("the target never answered its abort")
	}
	ar, err := abortOf(r)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("the target's Abort of request %d, in the hole: safe %v after %v (deadline %v) %s", ridAborted, ar.safe, ar.took, abortDeadline, ar.reason)
	if !ar.safe {
		t.Errorf("the target's Abort in the hole was not Safe: %s", ar.reason)
	}
	lat.add("Abort (owner side), 2 s", ar.took, abortDeadline)
	if ar.took > abortDeadline+deadlineSlack {
		t.Errorf("the target's Abort returned %v past its deadline", ar.took-abortDeadline)
	}

	// Recovery: a 1 MiB READ with a 1 s deadline, until one completes.
	attempts := 0
	for {
		attempts++
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		began := time.Now()
		_, err := e.Transfer(ctx, []engine.Request{req(engine.Read, mem(probe)[:mb], seg, at(probe))})
		cancel()
		lat.add("Transfer READ 1 MiB, 1 s (after the hole)", time.Since(began), time.Second)
		if err == nil {
			break
		}
		if time.Since(lifted) > time.Minute {
			t.Fatalf("no transfer completed within a minute of the hole's end (%d attempts; last: %v)", attempts, err)
		}
		time.Sleep(time.Until(began.Add(100 * time.Millisecond))) // paces the attempts: ten a second at most
	}
	recovered := time.Since(lifted)
	t.Logf("%v blackhole on ports %v (%s): %d of %d packets dropped; a transfer completed again %v after it ended (%d attempts)",
		hole, ports, where, dropped, seen, recovered.Round(time.Millisecond), attempts)
	t.Logf("calls in the hole: %v", &lat)

	// The WRITEs submitted into the hole.
	wait := func(name string, ch <-chan outcome) outcome {
		o, ok := childproc.Receive(ch, 2*time.Minute)
		if !ok {
			t.Fatalf("the %s WRITE never ended", name)
		}
		return o
	}
	in := wait("in-flight", inFlightDone)
	t.Logf("the WRITE submitted into the hole: %v %v after the hole began (%v)", in.res.Status, in.at.Round(time.Millisecond), in.res.Err)
	if hole < peerDeadAfter {
		if in.res.Status != engine.Completed {
			t.Errorf("the WRITE submitted into a %v hole with a long deadline: %v (%v), want COMPLETED once the hole ended", hole, in.res.Status, in.res.Err)
		} else if m := tp.check(inFlight.lo, inFlight.hi-inFlight.lo, seedIn, 0); m.bad != 0 {
			t.Errorf("the WRITE submitted into the hole completed, but the target holds: %v", m)
		}
	} else if in.res.Status == engine.Completed || in.at > hole {
		t.Errorf("the WRITE submitted into a %v hole: %v after %v, want it failed before the hole ended (the peer declared dead after %v)",
			hole, in.res.Status, in.at, peerDeadAfter)
	}
	ab := wait("aborted", abortedDone)
	t.Logf("the WRITE the target aborted: %v %v after the hole began (%v)", ab.res.Status, ab.at.Round(time.Millisecond), ab.res.Err)
	switch {
	case ab.res.Status == engine.Completed:
		t.Errorf("the WRITE of request %d completed after the target's Safe abort", ridAborted)
	case hole < peerDeadAfter && ab.res.Status != engine.Aborted:
		// Its paths survived the hole: its frames reached the target,
		// which refused them, and the initiator learned of the abort.
		t.Errorf("the aborted WRITE ended %v (%v), want ABORTED (promise 4: the initiator learns)", ab.res.Status, ab.res.Err)
	}
	if st := tp.stats(); hole < peerDeadAfter && st["refused"] == 0 {
		t.Errorf("the target refused nothing: the aborted request's first frames, stuck in the hole, should have been refused when they arrived")
	}
	// Nothing of the aborted request in the range the target reused.
	if m := tp.check(aborted.lo, aborted.hi-aborted.lo, seedReuse, 0); m.bad != 0 {
		t.Errorf("the range the target reused after its Safe abort: %v", m)
	}
	for _, s := range []span{callW, batchW} {
		// Words of the source: the old ones, those the timed-out WRITEs
		// sent before returning (landing late is allowed), partial words
		// of a cut frame; never the marker written after each returned.
		c := tp.classify(s.lo, s.hi-s.lo, seedOld, seedCall, seedMarker)
		t.Logf("target [%d MiB, %d MiB) after the timed-out WRITEs: %d words old, %d sent by them, %d of the source after they returned, %d mixed, %d other",
			s.lo/mb, s.hi/mb, c[0], c[1], c[2], c[3], c[4])
		if c[2] != 0 || c[4] != 0 {
			t.Errorf("target [%d MiB, %d MiB): %d words of the source written after the WRITEs returned, %d words of nothing sent",
				s.lo/mb, s.hi/mb, c[2], c[4])
		}
	}
	if n := countPattern(mem(callR), seedMarkerR); n != uint64(len(mem(callR))/8) {
		t.Errorf("the timed-out READs' destination: %d of %d words changed after they returned", uint64(len(mem(callR))/8)-n, len(mem(callR))/8)
	}

	// New work, both ways, intact; the third engine opens the segment.
	fillPattern(mem(probe), seedFinal)
	transfer(t, e, 30*time.Second, req(engine.Write, mem(probe), seg, at(probe)))
	if m := tp.check(probe.lo, probe.hi-probe.lo, seedFinal, 0); m.bad != 0 {
		t.Errorf("a WRITE after the hole: the target holds %v", m)
	}
	fillPattern(mem(probe), poisonSeed)
	transfer(t, e, 30*time.Second, req(engine.Read, mem(probe), seg, at(probe)))
	if m := checkPattern(mem(probe), seedFinal, 0); m.bad != 0 {
		t.Errorf("a READ after the hole: %v", m)
	}
	openSegment(t, other, tp.name)
}
