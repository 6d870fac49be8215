package control

import (
	"fmt"

	"github.com/kvferry/kvferry/internal/wire"
)

// Exact sizes of the abort messages' bodies.
const (
	AbortMsgSize = 16 // ABORT and CANCELED: an AbortMsg
	AbortAckSize = 24 // ABORT_ACK: an AbortAck
)

// AbortMsg is the body of ABORT: the owner aborted RequestID, and every
// access of it below Generation is refused from now on. CANCELED carries
// the same body: the initiator gave up on RequestID at Generation (a
// deadline passed or its caller canceled) and moves no more bytes of it.
// Layout (little endian, AbortMsgSize bytes): u64 request id, u32
// generation, u32 zero.
type AbortMsg struct {
	RequestID  uint64
	Generation uint32
}

// Encode returns the body.
func (m AbortMsg) Encode() []byte {
	w := wire.Writer{B: make([]byte, 0, AbortMsgSize)}
	w.U64(m.RequestID)
	w.U32(m.Generation)
	w.U32(0)
	return w.B
}

// DecodeAbortMsg parses and validates an ABORT body.
func DecodeAbortMsg(b []byte) (AbortMsg, error) {
	r, err := exactBody("ABORT body", b, AbortMsgSize)
	if err != nil {
		return AbortMsg{}, err
	}
	m := AbortMsg{RequestID: r.U64(), Generation: r.U32()}
	if err := reservedZero("ABORT", uint64(r.U32())); err != nil {
		return m, err
	}
	if m.RequestID == 0 {
		return m, fmt.Errorf("%w: ABORT of request id 0", ErrMalformed)
	}
	return m, nil
}

// AckOutcome says how an initiator stopped a request before its ABORT_ACK.
type AckOutcome uint8

// The outcomes.
const (
	// AckDrained: every slice of the request the initiator started ended
	// with the owner's answer (applied or refused), and it starts no more.
	AckDrained AckOutcome = 1
	// AckCut: some slices did not end in time, so their paths were cut;
	// bytes of them may still reach the owner, which must fence by itself.
	AckCut AckOutcome = 2
	// AckHeard: the ABORT was received, nothing more is promised. Sent only
	// by engines in the test-only unsafe mode.
	AckHeard AckOutcome = 3
)

var ackOutcomeNames = [...]string{AckDrained: "drained", AckCut: "cut", AckHeard: "heard"}

func (o AckOutcome) String() string { return enumName(ackOutcomeNames[:], int(o), "AckOutcome") }

// AbortAck is the body of ABORT_ACK. The initiator's identity is the routing
// id it sent from (its segment name). Layout (little endian, AbortAckSize
// bytes): u64 request id, u32 generation, u8 outcome, 3 zero bytes, u64
// bytes confirmed landed (a lower bound: a failed multi-packet write may
// have placed any part of itself).
type AbortAck struct {
	RequestID  uint64
	Generation uint32
	Outcome    AckOutcome
	Landed     uint64
}

// Encode returns the body.
func (m AbortAck) Encode() []byte {
	w := wire.Writer{B: make([]byte, 0, AbortAckSize)}
	w.U64(m.RequestID)
	w.U32(m.Generation)
	w.U8(uint8(m.Outcome))
	w.Zeros(3)
	w.U64(m.Landed)
	return w.B
}

// DecodeAbortAck parses and validates an ABORT_ACK body.
func DecodeAbortAck(b []byte) (AbortAck, error) {
	r, err := exactBody("ABORT_ACK body", b, AbortAckSize)
	if err != nil {
		return AbortAck{}, err
	}
	m := AbortAck{RequestID: r.U64(), Generation: r.U32(), Outcome: AckOutcome(r.U8())}
	reserved := r.Take(3)
	m.Landed = r.U64()
	if reserved[0] != 0 || reserved[1] != 0 || reserved[2] != 0 {
		return m, fmt.Errorf("%w: ABORT_ACK reserved bytes are not zero", ErrMalformed)
	}
	if m.Outcome < AckDrained || m.Outcome > AckHeard {
		return m, fmt.Errorf("%w: ABORT_ACK outcome %d", ErrMalformed, uint8(m.Outcome))
	}
	if m.RequestID == 0 {
		return m, fmt.Errorf("%w: ABORT_ACK of request id 0", ErrMalformed)
	}
	return m, nil
}

// MaxNotifyData caps a notification's payload; it matches the C API's
// KVF_EVENT_DATA_MAX, so an event always fits the C struct whole.
const MaxNotifyData = 64

// Notification is the body of NOTIFY: a small message from a peer about a
// request. Layout: u64 request id, then at most MaxNotifyData bytes.
type Notification struct {
	RequestID uint64
	Data      []byte
}

// Encode returns the body.
func (n Notification) Encode() []byte {
	w := wire.Writer{B: make([]byte, 0, 8+len(n.Data))}
	w.U64(n.RequestID)
	w.B = append(w.B, n.Data...)
	return w.B
}

// DecodeNotification parses and validates a NOTIFY body; Data is a copy.
func DecodeNotification(b []byte) (Notification, error) {
	var n Notification
	if len(b) < 8 || len(b) > 8+MaxNotifyData {
		return n, fmt.Errorf("%w: NOTIFY body of %d bytes, want 8 to %d", ErrMalformed, len(b), 8+MaxNotifyData)
	}
	r := wire.Reader{B: b, Malformed: ErrMalformed}
	n.RequestID = r.U64()
	n.Data = append([]byte(nil), r.B...)
	return n, nil
}
