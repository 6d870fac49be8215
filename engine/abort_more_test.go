package engine_test

// Engine-level tests of safe abort (SAFETY.md promises 1 to 5) with two or
// more engines in one process: several initiators, submits after an ABORT,
// unmatched and malformed ABORT_ACKs from a raw ZMQ peer, READs, an abort
// in the middle of a slowed WRITE (and the same with the protection off,
// which must corrupt), grants, events, argument errors, bounded syncs and
// leaks.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"golang.org/x/sys/unix"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/engine/control"
)

// Byte values the abort tests fill memory with: the aborted request's data,
// what the owner puts in a range it reuses after Safe, and an initiator's
// landing buffer before a READ.
const (
	oldByte    = 0xAA
	reusedByte = 0x55
	landByte   = 0x11
)

// ---------------------------------------------------------------------------
// Helpers.

// waitFor polls cond every millisecond and fails the test when it does not
// hold within d. The control plane is asynchronous, so a counter rises a
// little after the message that moves it was sent; d only catches a message
// that never had its effect, it is no performance bound.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, d)
		}
		time.Sleep(time.Millisecond)
	}
}

// nextEvent returns e's next event, failing the test when none arrives
// within d: the events tested here are caused by the test, so their absence
// is the bug.
func nextEvent(t *testing.T, e *engine.Engine, d time.Duration) engine.Event {
	t.Helper()
	select {
	case ev, ok := <-e.Events():
		if !ok {
			t.Fatal("event channel closed")
		}
		return ev
	case <-time.After(d):
		t.Fatalf("no event within %v", d)
	}
	panic("unreachable")
}

// waitBatch waits until every task of b is final and returns the results;
// a wait past d is a hang and dumps every goroutine (through within), since
// going on would let the test free memory the engine may still touch.
func waitBatch(t *testing.T, b *engine.Batch, d time.Duration) []engine.TaskResult {
	t.Helper()
	within(t, d, "batch Wait", func() {
		if err := b.Wait(context.Background()); err != nil {
			t.Errorf("wait: %v", err)
		}
	})
	return b.Results()
}

// submit allocates a batch on e, submits reqs to it and frees it when the
// test ends; the tests then watch the tasks run.
func submit(t *testing.T, e *engine.Engine, reqs ...engine.Request) *engine.Batch {
	t.Helper()
	b, err := e.AllocateBatch(len(reqs))
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Submit(testCtx(t, time.Minute), reqs); err != nil {
		t.Fatalf("submit: %v", err)
	}
	t.Cleanup(func() {
		b.Cancel()
		_ = b.Free()
	})
	return b
}

// withRID returns r carrying request id rid at generation gen: the write and
// read helpers build requests without one, and every abort test needs one.
func withRID(r engine.Request, rid uint64, gen uint32) engine.Request {
	r.RequestID, r.Generation = rid, gen
	return r
}

// requireAborted fails the test unless r ended ABORTED with ErrAborted and
// moved no byte.
func requireAborted(t *testing.T, what string, r engine.TaskResult) {
	t.Helper()
	if r.Status != engine.Aborted || !errors.Is(r.Err, engine.ErrAborted) || r.Transferred != 0 {
		t.Fatalf("%s: status %v, transferred %d, err %v; want ABORTED, 0 bytes, ErrAborted", what, r.Status, r.Transferred, r.Err)
	}
}

// fakeInitiator is a raw ZMQ DEALER whose routing id is name, connected to
// an owner's control ROUTER. It poses as an initiator so a test can send the
// owner the ABORT_ACKs no well-behaved engine sends (unknown, old
// generation, duplicate, late, malformed) and see the ABORTs the owner
// sends to that name, frame by frame.
type fakeInitiator struct {
	name   string
	zctx   *zmq.Context
	sock   *zmq.Socket
	closed bool
}

// newFakeInitiator connects a fake called name to owner and waits until the
// owner answered a PING from it: from then on the owner's ROUTER knows the
// routing id, so ABORTs to name come to this socket.
func newFakeInitiator(t *testing.T, owner, name string) *fakeInitiator {
	t.Helper()
	zctx, err := zmq.NewContext()
	if err != nil {
		t.Fatalf("zmq context: %v", err)
	}
	s, err := zctx.NewSocket(zmq.DEALER)
	if err != nil {
		_ = zctx.Term()
		t.Fatalf("dealer: %v", err)
	}
	f := &fakeInitiator{name: name, zctx: zctx, sock: s}
	t.Cleanup(f.close)
	if err := s.SetLinger(0); err != nil {
		t.Fatal(err)
	}
	if err := s.SetIdentity(name); err != nil {
		t.Fatal(err)
	}
	if err := s.Connect("tcp://" + owner); err != nil {
		t.Fatal(err)
	}
	f.ping(t, 1)
	return f
}

// close closes the socket and its context (idempotent, for t.Cleanup and
// for the leak test, which closes before counting).
func (f *fakeInitiator) close() {
	if f.closed {
		return
	}
	f.closed = true
	_ = f.sock.Close()
	_ = f.zctx.Term()
}

// sendFrames sends one message of the frames given, as they are.
func (f *fakeInitiator) sendFrames(t *testing.T, frames ...[]byte) {
	t.Helper()
	parts := make([]any, len(frames))
	for i, fr := range frames {
		parts[i] = fr
	}
	if _, err := f.sock.SendMessage(parts...); err != nil {
		t.Fatalf("fake %s: send: %v", f.name, err)
	}
}

// send sends a well-formed message: envelope and, when body is not nil, a
// body frame.
func (f *fakeInitiator) send(t *testing.T, typ control.MsgType, corr uint64, body []byte) {
	t.Helper()
	env := control.EncodeEnvelope(control.Envelope{Type: typ, Corr: corr})
	if body == nil {
		f.sendFrames(t, env)
		return
	}
	f.sendFrames(t, env, body)
}

// ack sends an ABORT_ACK built with the control package's encoder.
func (f *fakeInitiator) ack(t *testing.T, rid uint64, gen uint32) {
	t.Helper()
	f.send(t, control.MsgAbortAck, 0, control.AbortAck{RequestID: rid, Generation: gen, Outcome: control.AckDrained, Landed: 4096}.Encode())
}

// recv returns the next message, or ok false when none came within d.
func (f *fakeInitiator) recv(t *testing.T, d time.Duration) (env control.Envelope, body []byte, ok bool) {
	t.Helper()
	if err := f.sock.SetRcvtimeo(d); err != nil {
		t.Fatal(err)
	}
	msg, err := f.sock.RecvMessageBytes(0)
	if err != nil {
		if zmq.AsErrno(err) == zmq.Errno(syscall.EAGAIN) {
			return env, nil, false
		}
		t.Fatalf("fake %s: recv: %v", f.name, err)
	}
	if len(msg) < 1 || len(msg) > 2 {
		t.Fatalf("fake %s: message of %d frames from the owner", f.name, len(msg))
	}
	if env, err = control.DecodeEnvelope(msg[0]); err != nil {
		t.Fatalf("fake %s: the owner sent a bad envelope: %v", f.name, err)
	}
	if len(msg) == 2 {
		body = msg[1]
	}
	return env, body, true
}

// ping sends PING with corr and waits for its PONG, skipping ABORTs: the
// owner's loop answered everything this fake sent before.
func (f *fakeInitiator) ping(t *testing.T, corr uint64) {
	t.Helper()
	f.send(t, control.MsgPing, corr, nil)
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		env, _, ok := f.recv(t, 100*time.Millisecond)
		if ok && env.Type == control.MsgPong && env.Corr == corr {
			return
		}
	}
	t.Fatalf("fake %s: no PONG for PING %d", f.name, corr)
}

// aborts collects the ABORTs of rid that arrive within d (resends
// included), failing the test on any other ABORT body that does not decode.
func (f *fakeInitiator) aborts(t *testing.T, rid uint64, d time.Duration) []control.AbortMsg {
	t.Helper()
	var out []control.AbortMsg
	for end := time.Now().Add(d); ; {
		left := time.Until(end)
		if left <= 0 {
			return out
		}
		env, body, ok := f.recv(t, left)
		if !ok {
			return out
		}
		if env.Type != control.MsgAbort {
			continue
		}
		m, err := control.DecodeAbortMsg(body)
		if err != nil {
			t.Fatalf("fake %s: the owner sent a bad ABORT: %v", f.name, err)
		}
		if m.RequestID == rid {
			out = append(out, m)
		}
	}
}

// expectAbort waits for an ABORT of (rid, gen), skipping others.
func (f *fakeInitiator) expectAbort(t *testing.T, rid uint64, gen uint32) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		env, body, ok := f.recv(t, 100*time.Millisecond)
		if !ok || env.Type != control.MsgAbort {
			continue
		}
		m, err := control.DecodeAbortMsg(body)
		if err != nil {
			t.Fatalf("fake %s: bad ABORT: %v", f.name, err)
		}
		if m.RequestID == rid && m.Generation == gen {
			return
		}
	}
	t.Fatalf("fake %s: no ABORT(%d, %d)", f.name, rid, gen)
}

// ---------------------------------------------------------------------------
// 1. Several initiators.

// An abort naming two initiators gets an ABORT_ACK from each; each one's
// tasks of the request end ABORTED and it gets an EventAborted; the range
// the owner reuses after Safe is untouched; tasks of another request id
// queued behind the aborted ones complete with their data intact.
func TestAbortNamingTwoInitiatorsStopsBothAndSparesOtherRequests(t *testing.T) {
	const (
		blk        = 1 << 20
		nAbort     = 8 // tasks of the aborted request, per initiator
		nKeep      = 4 // tasks of another request, per initiator (one per path, behind the aborted ones)
		per        = (nAbort + nKeep) * blk
		rid, other = 101, 202
	)
	// The owner sleeps before applying each WRITE, so the aborted request's
	// frames are certainly in flight when it aborts.
	owner := newEngineWith(t, engine.Options{Testing: engine.Testing{ApplyDelay: 100 * time.Millisecond}})
	inits := []*engine.Engine{newEngineWith(t, engine.Options{}), newEngineWith(t, engine.Options{})}
	dst := alloc(t, owner, len(inits)*per)
	srcs := make([][]byte, len(inits))
	segs := make([]*engine.Segment, len(inits))
	for i, in := range inits {
		srcs[i] = alloc(t, in, per)
		fillPattern(srcs[i], uint64(10+i))
		segs[i] = openSegment(t, in, owner.Name())
	}
	before := owner.Stats()
	batches := make([]*engine.Batch, len(inits))
	for i, in := range inits {
		reqs := make([]engine.Request, 0, nAbort+nKeep)
		for j := range nAbort + nKeep {
			id := uint64(rid)
			if j >= nAbort {
				id = other
			}
			reqs = append(reqs, withRID(write(srcs[i][j*blk:], segs[i], engine.AddrOf(dst)+uint64(i*per+j*blk), blk), id, 0))
		}
		batches[i] = submit(t, in, reqs...)
	}

	var res engine.AbortResult
	took := within(t, 10*time.Second, "Abort", func() {
		var err error
		res, err = owner.Abort(testCtx(t, 10*time.Second), rid, []string{inits[0].Name(), inits[1].Name()})
		if err != nil {
			t.Errorf("abort: %v", err)
		}
	})
	if !res.Safe {
		t.Fatalf("abort = %+v; want Safe", res)
	}
	t.Logf("Abort took %v; acked before returning: %v", took, res.Acked)
	// The owner reuses the aborted request's ranges at once.
	for i := range inits {
		fillByte(dst[i*per:i*per+nAbort*blk], reusedByte)
	}

	for i, in := range inits {
		results := waitBatch(t, batches[i], 60*time.Second)
		aborted := 0
		for j, r := range results {
			switch {
			case j >= nAbort:
				if r.Status != engine.Completed || r.Transferred != blk {
					t.Errorf("initiator %d, task %d of request %d: %v, %d bytes, %v; want COMPLETED", i, j, other, r.Status, r.Transferred, r.Err)
				}
			case r.Status == engine.Aborted:
				aborted++
				if !errors.Is(r.Err, engine.ErrAborted) {
					t.Errorf("initiator %d, task %d: ABORTED with %v, want ErrAborted", i, j, r.Err)
				}
			case r.Status == engine.Completed:
				t.Logf("initiator %d, task %d completed before the abort", i, j)
			default:
				t.Errorf("initiator %d, task %d of the aborted request: %v (%v); want ABORTED", i, j, r.Status, r.Err)
			}
		}
		if aborted == 0 {
			t.Errorf("initiator %d: no task of the aborted request ended ABORTED", i)
		}
		ev := nextEvent(t, in, 5*time.Second)
		if ev.Kind != engine.EventAborted || ev.Peer != owner.Name() || ev.RequestID != rid || ev.Generation != res.Generation {
			t.Errorf("initiator %d: event %+v; want ABORTED of %d at generation %d from %s", i, ev, rid, res.Generation, owner.Name())
		}
		if st := in.Stats(); st.AbortsReceived == 0 || st.TasksAborted != uint64(aborted) || st.TasksInFlight != 0 {
			t.Errorf("initiator %d: %d ABORTs received, %d tasks aborted (want %d), %d in flight", i, st.AbortsReceived, st.TasksAborted, aborted, st.TasksInFlight)
		}
		requireAll(t, fmt.Sprintf("initiator %d's aborted range, reused by the owner", i), dst[i*per:i*per+nAbort*blk], reusedByte)
		requireEqual(t, fmt.Sprintf("initiator %d's other request", i), dst[i*per+nAbort*blk:(i+1)*per], srcs[i][nAbort*blk:])
	}
	waitFor(t, 10*time.Second, "an ABORT_ACK from each initiator", func() bool {
		return owner.Stats().AbortAcks-before.AbortAcks >= 2
	})
	time.Sleep(50 * time.Millisecond) // let any extra ACK arrive, to count it
	st := owner.Stats()
	if n := st.AbortAcks - before.AbortAcks; n != 2 {
		t.Errorf("owner counted %d ABORT_ACKs, want 2 (one per initiator)", n)
	}
	if st.OwnerRefused == before.OwnerRefused {
		t.Error("the owner refused no frame of the aborted request: nothing was in flight, the test proved little")
	}
	if st.AbortsSafe-before.AbortsSafe != 1 || st.AbortsNotSafe != before.AbortsNotSafe {
		t.Errorf("owner stats: %d safe, %d not safe aborts", st.AbortsSafe-before.AbortsSafe, st.AbortsNotSafe-before.AbortsNotSafe)
	}
	t.Logf("owner: %d refused (%d in flight), %d acks unmatched", st.OwnerRefused-before.OwnerRefused,
		st.RefusedInFlight-before.RefusedInFlight, st.AcksUnmatched-before.AcksUnmatched)
}

// ---------------------------------------------------------------------------
// 2. Submits after the ABORT arrived.

// Once an initiator heard an ABORT, its submits of the request below the new
// generation end ABORTED unposted (the owner sees no byte and no frame of
// them), READs included, while other request ids in the same submit run;
// submits at the new generation are admitted, and a generation the owner
// never issued is refused.
func TestSubmitAfterAbortEndsAbortedUnpostedAndNewGenerationIsAdmitted(t *testing.T) {
	const blk = 1 << 20
	const rid, other = 77, 78
	p := newAbortPair(t, engine.Options{}, 4*blk)
	fillPattern(p.src, 21)
	fillPattern(p.dst[blk:2*blk], 22) // what an aborted READ would fetch
	back := alloc(t, p.init, blk)
	fillByte(back, landByte)
	dstAddr := engine.AddrOf(p.dst)

	res, err := p.owner.Abort(testCtx(t, 5*time.Second), rid, []string{p.init.Name()})
	if err != nil || !res.Safe || res.Generation != 1 {
		t.Fatalf("abort = %+v, %v; want Safe at generation 1", res, err)
	}
	if ev := nextEvent(t, p.init, 5*time.Second); ev.Kind != engine.EventAborted || ev.RequestID != rid {
		t.Fatalf("event %+v, want ABORTED of %d", ev, rid)
	}
	before := p.owner.Stats()
	results := waitBatch(t, submit(t, p.init,
		withRID(write(p.src, p.seg, dstAddr, blk), rid, 0),
		withRID(read(back, p.seg, dstAddr+blk, blk), rid, 0),
		withRID(write(p.src[2*blk:], p.seg, dstAddr+2*blk, blk), other, 0),
	), 30*time.Second)
	requireAborted(t, "WRITE of the aborted request", results[0])
	requireAborted(t, "READ of the aborted request", results[1])
	if r := results[2]; r.Status != engine.Completed {
		t.Fatalf("WRITE of another request: %v (%v)", r.Status, r.Err)
	}
	requireAll(t, "owner range of the aborted WRITE", p.dst[:blk], 0)
	requireAll(t, "initiator range of the aborted READ", back, landByte)
	requireEqual(t, "owner range of the other request", p.dst[2*blk:3*blk], p.src[2*blk:3*blk])
	after := p.owner.Stats()
	if after.OwnerRefused != before.OwnerRefused || after.OwnerBytesIn-before.OwnerBytesIn != blk || after.OwnerBytesOut != before.OwnerBytesOut {
		t.Errorf("owner saw the aborted tasks: refused %d -> %d, bytes in +%d (want %d), bytes out +%d (want 0)",
			before.OwnerRefused, after.OwnerRefused, after.OwnerBytesIn-before.OwnerBytesIn, blk, after.OwnerBytesOut-before.OwnerBytesOut)
	}

	// The new generation is admitted, both ways.
	transfer(t, p.init, 30*time.Second,
		withRID(write(p.src, p.seg, dstAddr, blk), rid, res.Generation),
		withRID(read(back, p.seg, dstAddr+blk, blk), rid, res.Generation))
	requireEqual(t, "WRITE at the new generation", p.dst[:blk], p.src[:blk])
	requireEqual(t, "READ at the new generation", back, p.dst[blk:2*blk])

	// A generation the owner never issued is refused by the owner.
	r, err := p.init.Transfer(testCtx(t, 30*time.Second), []engine.Request{
		withRID(write(p.src[3*blk:], p.seg, dstAddr+3*blk, blk), rid, res.Generation+1)})
	if err == nil || !errors.Is(err, engine.ErrRefused) || r[0].Status == engine.Completed {
		t.Fatalf("WRITE at generation %d (never issued): %+v, %v; want refused", res.Generation+1, r, err)
	}
	requireAll(t, "owner range of the refused WRITE", p.dst[3*blk:], 0)
}

// ---------------------------------------------------------------------------
// 3. Unmatched and malformed ABORT_ACKs.

// ACKs that match no pending abort (unknown request, old generation,
// duplicate, late) are dropped and counted; malformed ones are dropped and
// counted as such; none stops the owner's control loop, which afterwards
// still answers PINGs, opens and transfers. The owner resends ABORT to a
// silent initiator until the deadline, and no longer.
func TestUnmatchedAndMalformedAbortAcksAreDroppedAndCounted(t *testing.T) {
	owner := newEngineWith(t, engine.Options{})
	dst := alloc(t, owner, 1<<20)
	f1 := newFakeInitiator(t, owner.Name(), "127.0.0.1:1")
	f2 := newFakeInitiator(t, owner.Name(), "127.0.0.1:2")

	// countsOf reads the three counters the ACKs move.
	type counts struct{ acks, unmatched, dropped uint64 }
	countsOf := func() counts {
		st := owner.Stats()
		return counts{st.AbortAcks, st.AcksUnmatched, st.ControlDropped}
	}
	want := countsOf()
	// step sends one message and waits until the counters are want.
	step := func(what string, send func()) {
		t.Helper()
		send()
		waitFor(t, 10*time.Second, what, func() bool { return countsOf() == want })
		time.Sleep(5 * time.Millisecond) // a counter moving twice would show now
		if got := countsOf(); got != want {
			t.Fatalf("%s: counters %+v, want %+v", what, got, want)
		}
	}

	const rid = 5
	res, err := owner.Abort(testCtx(t, 30*time.Second), rid, []string{f1.name, f2.name})
	if err != nil || !res.Safe {
		t.Fatalf("abort = %+v, %v", res, err)
	}
	gen := res.Generation
	f1.expectAbort(t, rid, gen)
	f2.expectAbort(t, rid, gen)

	want.unmatched++
	step("ACK of a request never aborted", func() { f1.ack(t, 999, 1) })
	want.unmatched++
	step("ACK of a generation never issued", func() { f1.ack(t, rid, gen+6) })
	want.unmatched++
	step("ACK of an older generation", func() { f1.ack(t, rid, gen-1) })
	want.acks++
	step("first ACK from f1", func() { f1.ack(t, rid, gen) })
	want.unmatched++
	step("duplicate ACK from f1 while f2 is awaited", func() { f1.ack(t, rid, gen) })
	want.acks++
	step("ACK from f2, the last awaited", func() { f2.ack(t, rid, gen) })
	want.unmatched++
	step("duplicate ACK after every initiator acknowledged", func() { f2.ack(t, rid, gen) })

	// Malformed: counted as dropped, never as an ACK.
	good := control.AbortAck{RequestID: rid, Generation: gen, Outcome: control.AckDrained}.Encode()
	env := control.EncodeEnvelope(control.Envelope{Type: control.MsgAbortAck})
	badOutcome := bytes.Clone(good)
	badOutcome[12] = 9
	reserved := bytes.Clone(good)
	reserved[14] = 1
	zeroRID := control.AbortAck{Generation: gen, Outcome: control.AckDrained}.Encode()
	badMagic := bytes.Clone(env)
	badMagic[0] ^= 0xff
	for _, m := range []struct {
		what   string
		frames [][]byte
	}{
		{"truncated ABORT_ACK body", [][]byte{env, good[:control.AbortAckSize-1]}},
		{"oversized ABORT_ACK body", [][]byte{env, append(bytes.Clone(good), 0)}},
		{"ABORT_ACK without a body", [][]byte{env}},
		{"ABORT_ACK with an unknown outcome", [][]byte{env, badOutcome}},
		{"ABORT_ACK with reserved bytes set", [][]byte{env, reserved}},
		{"ABORT_ACK of request id 0", [][]byte{env, zeroRID}},
		{"envelope with a bad magic", [][]byte{badMagic, good}},
		{"truncated envelope", [][]byte{env[:control.EnvelopeSize-1], good}},
		{"four frames", [][]byte{env, good, good}},
	} {
		want.dropped++
		step(m.what, func() { f1.sendFrames(t, m.frames...) })
	}

	// A silent initiator gets the ABORT again until the deadline, then no
	// more, and its ACK after the deadline is late.
	const late = 6
	resendsBefore := owner.Stats().AbortResends
	const deadline = 300 * time.Millisecond
	start := time.Now()
	res, err = owner.Abort(testCtx(t, deadline), late, []string{f1.name})
	if err != nil || !res.Safe {
		t.Fatalf("abort with a silent initiator = %+v, %v; want Safe (refusal fences on tcp)", res, err)
	}
	// ABORTs sent before the deadline may still be on their way for a while.
	got := f1.aborts(t, late, deadline+500*time.Millisecond-time.Since(start))
	if len(got) < 2 {
		t.Errorf("%d ABORTs of %d reached the silent initiator before its deadline; want resends", len(got), late)
	}
	if n := owner.Stats().AbortResends - resendsBefore; n == 0 || n+1 < uint64(len(got)) {
		t.Errorf("owner counted %d resends, initiator got %d ABORTs", n, len(got))
	}
	if more := f1.aborts(t, late, 300*time.Millisecond); len(more) > 0 {
		t.Errorf("%d ABORTs resent after the deadline", len(more))
	}
	want = countsOf()
	want.unmatched++
	step("ACK after the abort's deadline", func() { f1.ack(t, late, res.Generation) })

	// The owner still answers: the fake's PING, and a new engine's open and
	// transfer.
	f1.ping(t, 77)
	in := newEngineWith(t, engine.Options{})
	src := alloc(t, in, 1<<20)
	fillPattern(src, 31)
	transfer(t, in, 30*time.Second, write(src, openSegment(t, in, owner.Name()), engine.AddrOf(dst), 1<<20))
	requireEqual(t, "transfer after the bad ACKs", dst, src)
}

// A message past ZMQ_MAXMSGSIZE cuts its sender's connection before anything
// is allocated for it; the owner's loop goes on serving everyone else.
func TestOversizedControlMessageDoesNotStopTheOwner(t *testing.T) {
	owner := newEngineWith(t, engine.Options{})
	big := newFakeInitiator(t, owner.Name(), "127.0.0.1:3")
	env := control.EncodeEnvelope(control.Envelope{Type: control.MsgAbortAck})
	big.sendFrames(t, env, make([]byte, control.MaxBody+control.EnvelopeSize+1))
	// The owner answers another peer, and a new PING from the same one
	// (ZMQ reconnects the DEALER).
	newFakeInitiator(t, owner.Name(), "127.0.0.1:4").ping(t, 9)
	big.ping(t, 10)
	if st := owner.Stats(); st.AbortAcks != 0 || st.AcksUnmatched != 0 {
		t.Errorf("an oversized message was taken as an ACK: %+v", st)
	}
}

// ---------------------------------------------------------------------------
// 4. READs.

// An owner that aborted a request refuses READs of it too. With no
// initiator named the initiator learns of the abort from that refusal: the
// READ ends ABORTED having moved nothing, an EventAborted tells the
// application, and the next READ of it ends ABORTED without reaching the
// owner. The new generation is served.
func TestOwnerRefusesReadsOfAnAbortedRequest(t *testing.T) {
	const size = 1 << 20
	const rid = 404
	p := newAbortPair(t, engine.Options{}, size)
	fillPattern(p.dst, 41)
	fillByte(p.src, landByte)
	res, err := p.owner.Abort(testCtx(t, 5*time.Second), rid, nil)
	if err != nil || !res.Safe {
		t.Fatalf("abort = %+v, %v", res, err)
	}
	before := p.owner.Stats()
	req := withRID(read(p.src, p.seg, engine.AddrOf(p.dst), size), rid, 0)
	requireAborted(t, "READ refused by the owner", waitBatch(t, submit(t, p.init, req), 30*time.Second)[0])
	requireAll(t, "initiator buffer after the refused READ", p.src, landByte)
	mid := p.owner.Stats()
	if mid.OwnerRefused == before.OwnerRefused || mid.OwnerBytesOut != before.OwnerBytesOut {
		t.Errorf("owner: refused %d -> %d, bytes out %d -> %d; want a refusal and no byte out",
			before.OwnerRefused, mid.OwnerRefused, before.OwnerBytesOut, mid.OwnerBytesOut)
	}
	ev := nextEvent(t, p.init, 5*time.Second)
	if ev.Kind != engine.EventAborted || ev.RequestID != rid || ev.Peer != p.owner.Name() || ev.Generation != res.Generation {
		t.Errorf("event %+v; want ABORTED of %d at generation %d", ev, rid, res.Generation)
	}
	// Learned: the next READ of it stops at the initiator.
	requireAborted(t, "second READ", waitBatch(t, submit(t, p.init, req), 30*time.Second)[0])
	if after := p.owner.Stats(); after.OwnerRefused != mid.OwnerRefused {
		t.Errorf("the second READ reached the owner (%d more refusals)", after.OwnerRefused-mid.OwnerRefused)
	}
	transfer(t, p.init, 30*time.Second, withRID(read(p.src, p.seg, engine.AddrOf(p.dst), size), rid, res.Generation))
	requireEqual(t, "READ at the new generation", p.src, p.dst)
}

// A large READ aborted mid-way: once Abort reported Safe the owner reuses
// the range, and not one byte of the new content reaches the initiator; the
// task ends ABORTED.
func TestAbortMidReadNeverSendsReusedMemory(t *testing.T) {
	size := 256 << 20
	if testing.Short() {
		size = 64 << 20
	}
	const rid = 405
	p := newAbortPair(t, engine.Options{}, size)
	fillByte(p.dst, oldByte)
	fillByte(p.src, landByte)
	b := submit(t, p.init, withRID(read(p.src, p.seg, engine.AddrOf(p.dst), size), rid, 0))
	waitFor(t, 30*time.Second, "first bytes read", func() bool {
		r, _ := b.Status(0)
		return p.owner.Stats().OwnerBytesOut > 0 || r.Status.Final()
	})
	var res engine.AbortResult
	took := within(t, 10*time.Second, "Abort", func() {
		var err error
		if res, err = p.owner.Abort(testCtx(t, 5*time.Second), rid, []string{p.init.Name()}); err != nil {
			t.Errorf("abort: %v", err)
		}
	})
	if !res.Safe {
		t.Fatalf("abort = %+v", res)
	}
	fillByte(p.dst, reusedByte)
	r := waitBatch(t, b, 60*time.Second)[0]
	t.Logf("Abort took %v; task %v after %d of %d bytes", took, r.Status, r.Transferred, size)
	switch r.Status {
	case engine.Aborted:
		if !errors.Is(r.Err, engine.ErrAborted) {
			t.Errorf("ABORTED with %v, want ErrAborted", r.Err)
		}
	case engine.Completed:
		t.Log("the READ completed before the abort: nothing was in flight")
	default:
		t.Errorf("task %v (%v); want ABORTED", r.Status, r.Err)
	}
	if i := bytes.IndexByte(p.src, reusedByte); i >= 0 {
		t.Fatalf("initiator byte %d holds the owner's reused content %#02x: read after Abort reported Safe", i, reusedByte)
	}
}

// ---------------------------------------------------------------------------
// 5. Abort in the middle of a WRITE, with the protection on and off.

// A 256 MiB WRITE slowed by the owner (ApplyDelay: each frame waits after
// admission) is aborted after its first bytes landed. With the protection
// on, Abort reports Safe at once, the owner reuses the range, and when the
// initiator's task ended ABORTED the range still holds only the new content:
// the frames in flight were refused. With the protection off (UnsafeAbort on
// both engines: no refusal, ACK on "heard") the same check must find the old
// request's bytes in the reused range, showing that the check can fail. Each
// path's first gathered write holds four 1 MiB frames and the owner applies
// one per ApplyDelay, so frames land at least 2*ApplyDelay after the abort:
// the unsafe run's corruption is deterministic.
func TestAbortMidWriteFencesTheReusedRangeAndUnsafeAbortDoesNot(t *testing.T) {
	const delay = 250 * time.Millisecond
	size := 256 << 20
	if testing.Short() {
		size = 64 << 20
	}
	for _, unsafe := range []bool{false, true} {
		name := map[bool]string{false: "protected", true: "unsafe"}[unsafe]
		t.Run(name, func(t *testing.T) {
			const rid = 9
			p := newAbortPair(t, engine.Options{Testing: engine.Testing{UnsafeAbort: unsafe, ApplyDelay: delay}}, size)
			fillByte(p.src, oldByte)
			b := submit(t, p.init, withRID(write(p.src, p.seg, engine.AddrOf(p.dst), size), rid, 0))
			waitFor(t, 30*time.Second, "first frame applied", func() bool { return p.owner.Stats().OwnerBytesIn > 0 })

			var res engine.AbortResult
			took := within(t, 10*time.Second, "Abort", func() {
				var err error
				if res, err = p.owner.Abort(testCtx(t, 5*time.Second), rid, []string{p.init.Name()}); err != nil {
					t.Errorf("abort: %v", err)
				}
			})
			if !res.Safe {
				t.Fatalf("abort = %+v; want Safe", res)
			}
			start := time.Now()
			fillByte(p.dst, reusedByte)
			fillTook := time.Since(start)
			r := waitBatch(t, b, 60*time.Second)[0]
			st := p.owner.Stats()
			old := bytes.Count(p.dst, []byte{oldByte})
			t.Logf("Abort took %v, refilling %d MiB %v; task %v after %d bytes; owner: %d bytes in, %d refused, %d refused in flight; %d old bytes in the reused range",
				took, size>>20, fillTook, r.Status, r.Transferred, st.OwnerBytesIn, st.OwnerRefused, st.RefusedInFlight, old)
			if r.Status != engine.Aborted || !errors.Is(r.Err, engine.ErrAborted) {
				t.Errorf("task %v (%v); want ABORTED", r.Status, r.Err)
			}
			if unsafe {
				if old == 0 {
					t.Errorf("with the protection off no byte of the aborted WRITE landed in the reused range: the protected run's check proves nothing")
				}
				return
			}
			requireAll(t, "reused range after a Safe abort", p.dst, reusedByte)
			if st.OwnerRefused == 0 && st.RefusedInFlight == 0 {
				t.Error("the owner refused nothing: no frame was in flight at the abort")
			}
		})
	}
}

// ---------------------------------------------------------------------------
// 6. Grants.

// A grant confines a request id to its initiator and ranges: an access
// inside works (with the grant's id or without), one outside or straddling
// its end is refused, another initiator is refused, a request id without
// grants stays open to all; after Revoke every access of it is refused.
// Bad grants and unknown revokes are ErrInvalidArg.
func TestGrantConfinesARequestToItsInitiatorAndRangesUntilRevoked(t *testing.T) {
	const size, g = 1 << 20, 64 << 10
	const rid = 606
	owner := newEngineWith(t, engine.Options{})
	a, b := newEngineWith(t, engine.Options{}), newEngineWith(t, engine.Options{})
	dst := alloc(t, owner, size)
	srcA, srcB := alloc(t, a, size), alloc(t, b, size)
	fillPattern(srcA, 61)
	fillPattern(srcB, 62)
	segA, segB := openSegment(t, a, owner.Name()), openSegment(t, b, owner.Name())
	base := engine.AddrOf(dst)

	gr, err := owner.Grant(a.Name(), rid, []engine.GrantRange{{Addr: base, Len: g}})
	if err != nil {
		t.Fatalf("grant: %v", err)
	}
	if gr.ID == 0 || gr.Initiator != a.Name() || gr.RequestID != rid || gr.Generation != 0 || owner.Stats().Grants != 1 {
		t.Fatalf("grant %+v, %d live", gr, owner.Stats().Grants)
	}
	inside := withRID(write(srcA, segA, base, g), rid, gr.Generation)
	inside.GrantID = gr.ID
	transfer(t, a, 30*time.Second, inside)
	requireEqual(t, "WRITE inside the grant", dst[:g], srcA[:g])
	back := alloc(t, a, g)
	transfer(t, a, 30*time.Second, withRID(read(back, segA, base, g), rid, gr.Generation)) // grant found by range
	requireEqual(t, "READ inside the grant", back, srcA[:g])

	want := bytes.Clone(dst)
	refused := func(what string, e *engine.Engine, r engine.Request) {
		t.Helper()
		res, err := e.Transfer(testCtx(t, 30*time.Second), []engine.Request{r})
		if !errors.Is(err, engine.ErrRefused) || res[0].Status == engine.Completed || res[0].Transferred != 0 {
			t.Fatalf("%s: %+v, %v; want refused", what, res, err)
		}
		requireEqual(t, "owner memory after "+what, dst, want)
	}
	refused("WRITE outside the grant", a, withRID(write(srcA, segA, base+g, 4096), rid, 0))
	refused("WRITE straddling the grant's end", a, withRID(write(srcA, segA, base+g-100, 4096), rid, 0))
	refused("READ outside the grant", a, withRID(read(back, segA, base+g, 4096), rid, 0))
	refused("WRITE by another initiator inside the grant", b, withRID(write(srcB, segB, base, g), rid, 0))

	// Request ids without grants keep the open model.
	transfer(t, b, 30*time.Second, withRID(write(srcB, segB, base+2*g, g), rid+1, 0))
	requireEqual(t, "WRITE of a request without grants", dst[2*g:3*g], srcB[:g])
	want = bytes.Clone(dst)

	if err := owner.Revoke(testCtx(t, 5*time.Second), gr.ID); err != nil {
		t.Fatalf("revoke: %v", err)
	}
	if n := owner.Stats().Grants; n != 0 {
		t.Errorf("%d grants live after the revoke", n)
	}
	refused("WRITE inside a revoked grant", a, inside)
	if err := owner.Revoke(testCtx(t, 5*time.Second), gr.ID); !errors.Is(err, engine.ErrInvalidArg) {
		t.Errorf("second revoke: %v, want ErrInvalidArg", err)
	}

	ok := []engine.GrantRange{{Addr: base, Len: g}}
	for _, c := range []struct {
		what      string
		initiator string
		rid       uint64
		ranges    []engine.GrantRange
	}{
		{"request id 0", a.Name(), 0, ok},
		{"initiator without a port", "nohost", rid, ok},
		{"empty initiator", "", rid, ok},
		{"no ranges", a.Name(), rid, nil},
		{"a zero-length range", a.Name(), rid, []engine.GrantRange{{Addr: base, Len: 0}}},
		{"a range wrapping the address space", a.Name(), rid, []engine.GrantRange{{Addr: ^uint64(0) - 10, Len: 100}}},
	} {
		if _, err := owner.Grant(c.initiator, c.rid, c.ranges); !errors.Is(err, engine.ErrInvalidArg) {
			t.Errorf("grant with %s: %v, want ErrInvalidArg", c.what, err)
		}
	}
	if n := owner.Stats().Grants; n != 0 {
		t.Errorf("%d grants live after refused grants", n)
	}
}

// ---------------------------------------------------------------------------
// 7. Events.

// pollIn reports whether fd is readable within ms milliseconds (0: now), as
// the event loops the EventFD exists for (epoll, asyncio) would see it.
func pollIn(t *testing.T, fd, ms int) bool {
	t.Helper()
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	for {
		n, err := unix.Poll(fds, ms)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			t.Fatalf("poll: %v", err)
		}
		return n > 0 && fds[0].Revents&unix.POLLIN != 0
	}
}

// The EventFD is readable while events wait and TakeEvents resets it once it
// took them all; notifications over 64 bytes are invalid; a full queue
// answers ErrBusy until the application takes an event; Close closes
// Events() and the engine refuses TakeEvents and EventFD afterwards.
func TestEventFDAndNotifyBackpressure(t *testing.T) {
	recv := newEngineWith(t, engine.Options{EventQueue: 2})
	send := newEngineWith(t, engine.Options{})
	seg := openSegment(t, send, recv.Name())
	ctx := testCtx(t, 30*time.Second)
	fd, err := recv.EventFD()
	if err != nil {
		t.Fatal(err)
	}
	if fd2, err := recv.EventFD(); err != nil || fd2 != fd {
		t.Errorf("second EventFD = %d, %v; want the same fd %d", fd2, err, fd)
	}
	if pollIn(t, fd, 0) {
		t.Fatal("event fd readable with no event")
	}
	notify := func(rid uint64, data string) error { return send.Notify(ctx, seg, rid, []byte(data)) }
	if err := notify(1, "a"); err != nil {
		t.Fatal(err)
	}
	if !pollIn(t, fd, 5000) {
		t.Fatal("event fd not readable after a notification")
	}
	if err := notify(2, "b"); err != nil {
		t.Fatal(err)
	}
	if err := notify(3, "c"); !errors.Is(err, engine.ErrBusy) {
		t.Fatalf("third notification into a queue of 2: %v, want ErrBusy", err)
	}
	var out [4]engine.Event
	if n, err := recv.TakeEvents(ctx, out[:1]); n != 1 || err != nil || out[0].RequestID != 1 || string(out[0].Data) != "a" {
		t.Fatalf("TakeEvents(1) = %d, %v, %+v", n, err, out[0])
	}
	if !pollIn(t, fd, 0) {
		t.Error("event fd not readable with an event left")
	}
	if err := notify(4, "d"); err != nil {
		t.Fatalf("notification after the queue drained one: %v", err)
	}
	n, err := recv.TakeEvents(ctx, out[:])
	if n != 2 || err != nil || out[0].RequestID != 2 || out[1].RequestID != 4 || out[0].Kind != engine.EventNotify || out[1].Peer != send.Name() {
		t.Fatalf("TakeEvents = %d, %v, %+v", n, err, out[:n])
	}
	if pollIn(t, fd, 0) {
		t.Error("event fd readable after TakeEvents took every event")
	}
	if st := recv.Stats(); st.Notifications != 3 {
		t.Errorf("%d notifications counted, want 3", st.Notifications)
	}

	if err := send.Notify(ctx, seg, 5, make([]byte, engine.MaxNotifyData+1)); !errors.Is(err, engine.ErrInvalidArg) {
		t.Errorf("notification of %d bytes: %v, want ErrInvalidArg", engine.MaxNotifyData+1, err)
	}
	full := bytes.Repeat([]byte{7}, engine.MaxNotifyData)
	if err := send.Notify(ctx, seg, 6, full); err != nil {
		t.Fatalf("notification of %d bytes: %v", len(full), err)
	}
	if n, err := recv.TakeEvents(ctx, out[:]); n != 1 || err != nil || !bytes.Equal(out[0].Data, full) {
		t.Fatalf("TakeEvents = %d, %v, %+v", n, err, out[0])
	}
	// Nothing waiting: TakeEvents waits until its context ends.
	short, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	n, err = recv.TakeEvents(short, out[:])
	cancel()
	if n != 0 || err != nil {
		t.Errorf("TakeEvents with nothing waiting = %d, %v; want 0, nil at the deadline", n, err)
	}

	if err := notify(7, "left for Close"); err != nil {
		t.Fatal(err)
	}
	if err := recv.Close(); err != nil {
		t.Fatal(err)
	}
	within(t, 5*time.Second, "Events() after Close", func() {
		for range recv.Events() {
		}
	})
	if _, err := recv.TakeEvents(ctx, out[:]); !errors.Is(err, engine.ErrClosed) {
		t.Errorf("TakeEvents after Close: %v, want ErrClosed", err)
	}
	if _, err := recv.EventFD(); !errors.Is(err, engine.ErrClosed) {
		t.Errorf("EventFD after Close: %v, want ErrClosed", err)
	}
	took := within(t, 10*time.Second, "Notify to a closed engine", func() {
		if err := send.Notify(testCtx(t, time.Second), seg, 8, nil); err == nil {
			t.Error("notification to a closed engine succeeded")
		}
	})
	t.Logf("Notify to a closed engine failed after %v", took)
}

// ---------------------------------------------------------------------------
// 8. Argument errors.

// Abort refuses request id 0, names that are not segment names and more
// than MaxAbortInitiators initiators; without initiators it is Safe on tcp
// and bumps the generation each time; after Close it is ErrClosed.
func TestAbortArgumentsAndClosedEngine(t *testing.T) {
	e := newEngineWith(t, engine.Options{})
	ctx := testCtx(t, 10*time.Second)
	many := make([]string, engine.MaxAbortInitiators+1)
	for i := range many {
		many[i] = fmt.Sprintf("127.0.0.1:%d", 1000+i)
	}
	for _, c := range []struct {
		what  string
		rid   uint64
		names []string
	}{
		{"request id 0", 0, nil},
		{"a name without a port", 1, []string{"nohost"}},
		{"an empty name", 1, []string{""}},
		{"a name of 256 bytes", 1, []string{strings.Repeat("h", 251) + ":1234"}},
		{"a bad name after a good one", 1, []string{"127.0.0.1:1", "x"}},
		{fmt.Sprintf("%d initiators", len(many)), 1, many},
	} {
		res, err := e.Abort(ctx, c.rid, c.names)
		if !errors.Is(err, engine.ErrInvalidArg) {
			t.Errorf("abort with %s: %+v, %v; want ErrInvalidArg", c.what, res, err)
		}
	}
	if st := e.Stats(); st.Tombstones != 0 || st.AbortsSafe != 0 || st.AbortsNotSafe != 0 {
		t.Errorf("refused aborts left state: %+v", st)
	}
	for gen := uint32(1); gen <= 2; gen++ {
		res, err := e.Abort(ctx, 1, nil)
		if err != nil || !res.Safe || res.Reason != nil || res.Generation != gen || len(res.Acked) != 0 {
			t.Errorf("abort %d without initiators = %+v, %v; want Safe at generation %d", gen, res, err, gen)
		}
	}
	if st := e.Stats(); st.Tombstones != 1 || st.AbortsSafe != 2 {
		t.Errorf("after two aborts of one request: %d tombstones, %d safe", st.Tombstones, st.AbortsSafe)
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Abort(ctx, 1, nil); !errors.Is(err, engine.ErrClosed) {
		t.Errorf("abort after Close: %v, want ErrClosed", err)
	}
	if _, err := e.Grant("127.0.0.1:1", 1, []engine.GrantRange{{Addr: 4096, Len: 4096}}); !errors.Is(err, engine.ErrClosed) {
		t.Errorf("grant after Close: %v, want ErrClosed", err)
	}
	if err := e.Revoke(ctx, 1); !errors.Is(err, engine.ErrClosed) {
		t.Errorf("revoke after Close: %v, want ErrClosed", err)
	}
}

// ---------------------------------------------------------------------------
// 9. Bounded sync.

// Abort with a deadline far shorter than the transfer in flight (1 ms, or
// already past) returns by it plus a generous bound (a hang is the bug, not
// slowness). It may report Safe, and then the reused range stays intact, or
// not Safe with ErrTimeout; never Safe early.
func TestAbortWithATinyDeadlineReturnsByIt(t *testing.T) {
	size := 256 << 20
	if testing.Short() {
		size = 64 << 20
	}
	const bound = time.Second
	for _, tc := range []struct {
		name   string
		expiry time.Duration // relative to the call; <= 0: already expired
	}{{"1ms", time.Millisecond}, {"expired", -time.Second}} {
		t.Run(tc.name, func(t *testing.T) {
			const rid = 909
			p := newAbortPair(t, engine.Options{}, size)
			fillByte(p.src, oldByte)
			b := submit(t, p.init, withRID(write(p.src, p.seg, engine.AddrOf(p.dst), size), rid, 0))
			waitFor(t, 30*time.Second, "first bytes applied", func() bool {
				r, _ := b.Status(0)
				return p.owner.Stats().OwnerBytesIn > 0 || r.Status.Final()
			})
			start := time.Now()
			deadline := start.Add(tc.expiry)
			ctx, cancel := context.WithDeadline(context.Background(), deadline)
			defer cancel()
			var res engine.AbortResult
			var err error
			within(t, 30*time.Second, "Abort", func() { res, err = p.owner.Abort(ctx, rid, []string{p.init.Name()}) })
			// Past the deadline, or past the call for a deadline already gone.
			late := time.Since(deadline)
			if deadline.Before(start) {
				late = time.Since(start)
			}
			t.Logf("Abort returned %v after its deadline: safe %v, reason %v", late, res.Safe, res.Reason)
			if err != nil {
				t.Fatalf("abort: %v", err)
			}
			if late > bound {
				t.Errorf("Abort returned %v after its deadline (bound %v): a sync call must return by its deadline", late, bound)
			}
			if !res.Safe {
				if !errors.Is(res.Reason, engine.ErrTimeout) {
					t.Errorf("not safe with reason %v, want ErrTimeout", res.Reason)
				}
				waitBatch(t, b, 60*time.Second)
				return
			}
			fillByte(p.dst, reusedByte)
			r := waitBatch(t, b, 60*time.Second)[0]
			t.Logf("task %v after %d bytes", r.Status, r.Transferred)
			requireAll(t, "range reused after Safe", p.dst, reusedByte)
		})
	}
}

// ---------------------------------------------------------------------------
// 10. Leaks.

// Aborts with several initiators and a fake one, grants, revokes,
// notifications and the event fd leave, once the engines are closed, no
// goroutine and no file descriptor beyond the baseline; before the close,
// registries hold only what is documented to stay (one tombstone per
// aborted request id).
func TestAbortScenariosLeakNoGoroutinesOrFileDescriptors(t *testing.T) {
	cycle := func() {
		t.Helper()
		const blk, n = 256 << 10, 8
		mk := func(opts engine.Options) *engine.Engine {
			opts.IgnoreEnv, opts.Protocol = true, "tcp"
			e, err := engine.New(opts)
			if err != nil {
				t.Fatal(err)
			}
			return e
		}
		owner := mk(engine.Options{Testing: engine.Testing{ApplyDelay: 5 * time.Millisecond}})
		inits := []*engine.Engine{mk(engine.Options{}), mk(engine.Options{})}
		all := append([]*engine.Engine{owner}, inits...)
		defer func() {
			for _, e := range all {
				_ = e.Close()
			}
		}()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		bufs := make([][]byte, len(all))
		for i, e := range all {
			m, err := e.AllocBuffer(2*n*blk, "cpu")
			if err != nil {
				t.Fatal(err)
			}
			bufs[i] = m
		}
		fake := newFakeInitiator(t, owner.Name(), "127.0.0.1:5")
		if _, err := owner.EventFD(); err != nil {
			t.Fatal(err)
		}
		const rid = 1
		var batches []*engine.Batch
		for i, in := range inits {
			seg, err := in.OpenSegment(ctx, owner.Name())
			if err != nil {
				t.Fatal(err)
			}
			reqs := make([]engine.Request, n)
			for j := range reqs {
				reqs[j] = withRID(write(bufs[i+1][j*blk:], seg, engine.AddrOf(bufs[0])+uint64((i*n+j)*blk), blk), rid, 0)
			}
			b, err := in.AllocateBatch(n)
			if err != nil {
				t.Fatal(err)
			}
			if err := b.Submit(ctx, reqs); err != nil {
				t.Fatal(err)
			}
			batches = append(batches, b)
			if err := in.Notify(ctx, seg, rid, []byte("hi")); err != nil {
				t.Fatal(err)
			}
		}
		acks := owner.Stats().AbortAcks
		res, err := owner.Abort(ctx, rid, []string{inits[0].Name(), inits[1].Name(), fake.name})
		if err != nil || !res.Safe {
			t.Fatalf("abort = %+v, %v", res, err)
		}
		fake.expectAbort(t, rid, res.Generation)
		fake.ack(t, rid, res.Generation)
		for _, b := range batches {
			if err := b.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			if err := b.Free(); err != nil {
				t.Fatal(err)
			}
		}
		waitFor(t, 10*time.Second, "three ACKs", func() bool { return owner.Stats().AbortAcks-acks == 3 })
		var evs [8]engine.Event
		if k, err := owner.TakeEvents(ctx, evs[:]); k == 0 || err != nil {
			t.Fatalf("TakeEvents = %d, %v", k, err)
		}
		gr, err := owner.Grant(inits[0].Name(), rid+1, []engine.GrantRange{{Addr: engine.AddrOf(bufs[0]), Len: blk}})
		if err != nil {
			t.Fatal(err)
		}
		if err := owner.Revoke(ctx, gr.ID); err != nil {
			t.Fatal(err)
		}
		fake.close()
		for i, e := range all {
			if err := e.FreeBuffer(engine.AddrOf(bufs[i])); err != nil {
				t.Errorf("free buffer %d: %v", i, err)
			}
		}
		// Registries: no grant, registration or task left; the aborted
		// request's tombstone stays (documented, bounded), and the revoked
		// request id's entry until it ages out.
		if st := owner.Stats(); st.Grants != 0 || st.Registrations != 0 || st.Tombstones != 1 || st.RequestStates > 2 {
			t.Errorf("owner registries before Close: %d grants, %d registrations, %d tombstones, %d request states",
				st.Grants, st.Registrations, st.Tombstones, st.RequestStates)
		}
		for i, in := range inits {
			if st := in.Stats(); st.TasksInFlight != 0 || st.Registrations != 0 || st.InitiatorTombstones != 1 {
				t.Errorf("initiator %d before Close: %d tasks in flight, %d registrations, %d tombstones",
					i, st.TasksInFlight, st.Registrations, st.InitiatorTombstones)
			}
		}
		for _, e := range all {
			if err := e.Close(); err != nil {
				t.Errorf("close: %v", err)
			}
		}
	}
	requireNoLeaks(t, cycle)
}
