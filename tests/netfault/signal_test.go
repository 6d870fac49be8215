package netfault

import (
	"context"
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
)

// What engine/twoprocess_test.go, engine/stoppedpeer_test.go and tests/pd
// already cover of processes paused and killed: the owner killed mid-WRITE and mid-READ (the
// initiator's transfer fails, well before its deadline, and later ones by
// theirs); the owner paused (transfers time out by their deadline and
// leave the initiator's memory alone; dialing and OpenSegment keep their
// deadlines; Close leaves nothing running); the initiator paused or killed
// mid-WRITE (the owner's Abort is Safe by its deadline and the reused slot
// stays intact). What this file adds: the initiator paused or killed
// mid-READ, where the owner is the one sending (its socket writes block
// on a reader that stopped reading), and a short pause of either side that
// in-flight transfers must survive.

// pauseLinkMbit shapes lo while a test waits for a transfer to be under
// way, so that a 256 MiB transfer takes about a second and a signal
// certainly strikes in its middle.
const pauseLinkMbit = 2000

// TestReaderPausedOrKilledMidReadAbortIsSafe: an initiator READs 256 MiB
// of the owner's memory (this process) as request 1 and is paused
// (SIGSTOP), or killed, in the middle. The owner's Abort of the request is
// Safe by its deadline + deadlineSlack without a word from the reader, and
// the owner refills the range with a new pattern at once. Paused, then
// resumed: the reader's READ ends ABORTED (it learns) and not one word of
// the new pattern reached its buffer (no byte left the owner's memory after
// the Safe abort); its next READ completes intact. Killed: the owner drops
// its control connection and serves a new reader intact.
func TestReaderPausedOrKilledMidReadAbortIsSafe(t *testing.T) {
	requireSuite(t)
	for _, sig := range []syscall.Signal{syscall.SIGSTOP, syscall.SIGKILL} {
		t.Run(sigName(sig), func(t *testing.T) { testReaderSignal(t, sig) })
	}
}

func sigName(sig syscall.Signal) string {
	return map[syscall.Signal]string{syscall.SIGSTOP: "SIGSTOP", syscall.SIGKILL: "SIGKILL", syscall.SIGCONT: "SIGCONT"}[sig]
}

func testReaderSignal(t *testing.T, sig syscall.Signal) {
	f := useFaults(t)
	const (
		mb            = 1 << 20
		size          = 256 * mb
		rid, rid2     = 1, 2
		abortDeadline = 2 * time.Second
		seedKV        = 41
		seedReuse     = 42
		seedKV2       = 43
	)
	o := newEngine(t, engine.Options{})
	mem := alloc(t, o, size+mb)
	kv, probe := mem[:size], mem[size:]
	fillPattern(kv, seedKV)
	fillPattern(probe, seedKV2)
	reader := startPeer(t, peerConfig{size: size + mb})
	reader.open(o.Name(), 30*time.Second)
	conns := o.Stats().ControlConns

	f.limit(pauseLinkMbit)
	start := time.Now()
	read := reader.xfer(engine.Read, o.Name(), rid, 0, engine.AddrOf(kv), size, time.Minute, seedKV, seedReuse)
	if !waitFor(30*time.Second, func() bool { return o.Stats().OwnerBytesOut > 0 || len(read) > 0 }) {
		t.Fatal("no byte of the READ left the owner within 30s")
	}
	if len(read) > 0 {
		t.Fatal("the READ ended before the first byte was counted at the owner")
	}
	reader.signal(sig)
	out := o.Stats().OwnerBytesOut
	t.Logf("%s sent %v after the READ began, %d MiB of %d sent by the owner", sigName(sig), time.Since(start).Round(time.Millisecond), out>>20, size>>20)
	if out >= size-engine.DefaultSliceSize {
		t.Fatalf("%d of %d bytes already sent when the reader was signaled: nothing left in flight to test", out, size)
	}

	ctx, cancel := context.WithTimeout(context.Background(), abortDeadline)
	defer cancel()
	called := time.Now()
	ar, err := o.Abort(ctx, rid, []string{reader.name})
	took := time.Since(called)
	t.Logf("Abort with the reader %s: safe %v, %v, after %v", map[syscall.Signal]string{syscall.SIGSTOP: "paused", syscall.SIGKILL: "killed"}[sig], ar.Safe, err, took)
	if err != nil || !ar.Safe {
		t.Fatalf("Abort = %+v, %v; want Safe", ar, err)
	}
	if took > abortDeadline+deadlineSlack {
		t.Errorf("Abort returned %v after its call, past its %v deadline + %v", took, abortDeadline, deadlineSlack)
	}
	fillPattern(kv, seedReuse) // Safe: the range is the owner's again
	f.unlimit()

	switch sig {
	case syscall.SIGSTOP:
		reader.signal(syscall.SIGCONT)
		x := reader.awaitXfer(read, 30*time.Second)
		t.Logf("the reader, resumed: %s with %d bytes confirmed (%s); %d bytes not the old pattern, %d words of the new", x.status, x.transferred, x.err, x.bad, x.reuse)
		if x.status != engine.Aborted.String() {
			t.Errorf("the READ ended %s at the reader, want ABORTED (promise 4: the initiator learns)", x.status)
		}
		if x.reuse != 0 {
			t.Errorf("%d words the owner wrote after its Safe abort reached the reader", x.reuse)
		}
		if x := reader.awaitXfer(reader.xfer(engine.Read, o.Name(), rid2, size, engine.AddrOf(probe), mb, 30*time.Second, seedKV2, 0), time.Minute); x.status != engine.Completed.String() || x.bad != 0 {
			t.Errorf("the resumed reader's next READ: %+v, want COMPLETED and intact", x)
		}
	case syscall.SIGKILL:
		select {
		case <-reader.exited():
		case <-time.After(10 * time.Second):
			t.Fatal("the killed reader still running 10s later")
		}
		if !waitFor(10*time.Second, func() bool { return o.Stats().ControlConns <= conns-1 }) {
			t.Errorf("the owner still holds %d control connections from peers 10s after the reader was killed, %d before", o.Stats().ControlConns, conns)
		}
		next := startPeer(t, peerConfig{size: mb})
		next.open(o.Name(), 30*time.Second)
		if x := next.awaitXfer(next.xfer(engine.Read, o.Name(), rid2, 0, engine.AddrOf(probe), mb, 30*time.Second, seedKV2, 0), time.Minute); x.status != engine.Completed.String() || x.bad != 0 {
			t.Errorf("a new reader's READ after the kill: %+v, want COMPLETED and intact", x)
		}
		next.finish()
	}
	st := o.Stats()
	t.Logf("owner: %d MiB sent, refused %d (in flight %d)", st.OwnerBytesOut>>20, st.OwnerRefused, st.RefusedInFlight)
	if st.AbortsSafe != 1 || st.AbortsNotSafe != 0 {
		t.Errorf("the owner counted %d safe and %d unsafe aborts; want 1 and 0", st.AbortsSafe, st.AbortsNotSafe)
	}
}

// TestShortPauseOfEitherSideLetsTransfersComplete: the owner, then the
// initiator, is paused (SIGSTOP) for 2 s, less than peerDeadAfter, in the
// middle of a 256 MiB WRITE and of a 256 MiB READ with a minute's deadline.
// Once resumed the transfer goes on and completes, and its bytes are intact.
func TestShortPauseOfEitherSideLetsTransfersComplete(t *testing.T) {
	requireSuite(t)
	for _, side := range []string{"owner", "initiator"} {
		for _, op := range []engine.Op{engine.Write, engine.Read} {
			t.Run(fmt.Sprintf("%s paused/%v", side, op), func(t *testing.T) { testShortPause(t, side, op) })
		}
	}
}

func testShortPause(t *testing.T, side string, op engine.Op) {
	f := useFaults(t)
	const (
		mb    = 1 << 20
		size  = 256 * mb
		pause = 2 * time.Second
		seed  = 51
	)
	f.limit(pauseLinkMbit)
	defer f.unlimit()
	if side == "owner" {
		// This process initiates; the peer owns the memory and is paused.
		tp := startPeer(t, peerConfig{size: size})
		e := newEngine(t, engine.Options{})
		local := alloc(t, e, size)
		seg := openSegment(t, e, tp.name)
		if op == engine.Write {
			fillPattern(local, seed)
		} else {
			tp.fill(0, size, seed)
			fillPattern(local, poisonSeed)
		}
		done := make(chan error, 1)
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			_, err := e.Transfer(ctx, []engine.Request{req(op, local, seg, tp.addr)})
			done <- err
		}()
		moved := func() int64 {
			st := tp.stats()
			return st["owner_in"] + st["owner_out"]
		}
		var m int64
		if waitFor(30*time.Second, func() bool { m = moved(); return m > 0 || len(done) > 0 }); m == 0 {
			t.Fatal("the transfer ended, or moved nothing within 30s, before the owner could be paused")
		}
		tp.signal(syscall.SIGSTOP)
		time.Sleep(pause) // the fault itself
		tp.signal(syscall.SIGCONT)
		var err error
		select {
		case err = <-done:
		case <-time.After(time.Minute):
			t.Fatal("the transfer did not end within a minute of the owner's resumption")
		}
		if err != nil {
			t.Fatalf("%v across a %v pause of the owner: %v", op, pause, err)
		}
		if op == engine.Write {
			if m := tp.check(0, size, seed, 0); m.bad != 0 {
				t.Errorf("the paused owner's memory after the WRITE: %v", m)
			}
		} else if m := checkPattern(local, seed, 0); m.bad != 0 {
			t.Errorf("the READ's destination: %v", m)
		}
		return
	}
	// The peer initiates and is paused; this process owns the memory.
	o := newEngine(t, engine.Options{})
	mem := alloc(t, o, size)
	ini := startPeer(t, peerConfig{size: size})
	ini.open(o.Name(), 30*time.Second)
	if op == engine.Read {
		fillPattern(mem, seed)
	}
	done := ini.xfer(op, o.Name(), 0, 0, engine.AddrOf(mem), size, time.Minute, seed, 0)
	if !waitFor(30*time.Second, func() bool { st := o.Stats(); return st.OwnerBytesIn+st.OwnerBytesOut > 0 || len(done) > 0 }) || len(done) > 0 {
		t.Fatal("the transfer ended, or moved nothing within 30s, before the initiator could be paused")
	}
	ini.signal(syscall.SIGSTOP)
	time.Sleep(pause) // the fault itself
	ini.signal(syscall.SIGCONT)
	x := ini.awaitXfer(done, time.Minute)
	if x.status != engine.Completed.String() {
		t.Fatalf("%v across a %v pause of the initiator: %s (%s)", op, pause, x.status, x.err)
	}
	if op == engine.Write {
		if m := checkPattern(mem, seed, 0); m.bad != 0 {
			t.Errorf("the owner's memory after the WRITE: %v", m)
		}
	} else if x.bad != 0 {
		t.Errorf("the READ's destination at the paused initiator: %d bad bytes", x.bad)
	}
}
