package engine_test

// Helpers of the abort tests: the byte values memory is filled with, waits
// on events and batches, and a fake initiator speaking the control protocol
// from a raw ZMQ socket.

import (
	"context"
	"errors"
	"syscall"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"

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
