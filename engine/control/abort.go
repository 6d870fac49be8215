package control

import (
	"encoding/binary"
	"fmt"
)

// AbortMsg is the body of ABORT: the owner aborted RequestID, and every
// access of it below Generation is refused from now on. CANCELED carries
// the same body: the initiator gave up on RequestID at Generation (a
// deadline passed or its caller canceled) and moves no more bytes of it. Layout (little
// endian, AbortMsgSize bytes): u64 request id, u32 generation, u32 zero.
type AbortMsg struct {
	RequestID  uint64
	Generation uint32
}

// AbortMsgSize is the exact size of an ABORT body.
const AbortMsgSize = 16

// Encode returns the body.
func (m AbortMsg) Encode() []byte {
	b := make([]byte, AbortMsgSize)
	binary.LittleEndian.PutUint64(b[0:], m.RequestID)
	binary.LittleEndian.PutUint32(b[8:], m.Generation)
	return b
}

// DecodeAbortMsg parses and validates an ABORT body.
func DecodeAbortMsg(b []byte) (AbortMsg, error) {
	var m AbortMsg
	if len(b) != AbortMsgSize {
		return m, fmt.Errorf("%w: ABORT body of %d bytes, want %d", ErrMalformed, len(b), AbortMsgSize)
	}
	m.RequestID = binary.LittleEndian.Uint64(b[0:])
	m.Generation = binary.LittleEndian.Uint32(b[8:])
	if z := binary.LittleEndian.Uint32(b[12:]); z != 0 {
		return m, fmt.Errorf("%w: ABORT reserved field %#x is not zero", ErrMalformed, z)
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

func (o AckOutcome) String() string {
	switch o {
	case AckDrained:
		return "drained"
	case AckCut:
		return "cut"
	case AckHeard:
		return "heard"
	}
	return fmt.Sprintf("AckOutcome(%d)", uint8(o))
}

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

// AbortAckSize is the exact size of an ABORT_ACK body.
const AbortAckSize = 24

// Encode returns the body.
func (m AbortAck) Encode() []byte {
	b := make([]byte, AbortAckSize)
	binary.LittleEndian.PutUint64(b[0:], m.RequestID)
	binary.LittleEndian.PutUint32(b[8:], m.Generation)
	b[12] = uint8(m.Outcome)
	binary.LittleEndian.PutUint64(b[16:], m.Landed)
	return b
}

// DecodeAbortAck parses and validates an ABORT_ACK body.
func DecodeAbortAck(b []byte) (AbortAck, error) {
	var m AbortAck
	if len(b) != AbortAckSize {
		return m, fmt.Errorf("%w: ABORT_ACK body of %d bytes, want %d", ErrMalformed, len(b), AbortAckSize)
	}
	m.RequestID = binary.LittleEndian.Uint64(b[0:])
	m.Generation = binary.LittleEndian.Uint32(b[8:])
	m.Outcome = AckOutcome(b[12])
	m.Landed = binary.LittleEndian.Uint64(b[16:])
	if b[13] != 0 || b[14] != 0 || b[15] != 0 {
		return m, fmt.Errorf("%w: ABORT_ACK reserved bytes are not zero", ErrMalformed)
	}
	if m.Outcome < AckDrained || m.Outcome > AckHeard {
		return m, fmt.Errorf("%w: ABORT_ACK outcome %d", ErrMalformed, b[12])
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
	b := make([]byte, 8+len(n.Data))
	binary.LittleEndian.PutUint64(b, n.RequestID)
	copy(b[8:], n.Data)
	return b
}

// DecodeNotification parses and validates a NOTIFY body; Data is a copy.
func DecodeNotification(b []byte) (Notification, error) {
	var n Notification
	if len(b) < 8 || len(b) > 8+MaxNotifyData {
		return n, fmt.Errorf("%w: NOTIFY body of %d bytes, want 8 to %d", ErrMalformed, len(b), 8+MaxNotifyData)
	}
	n.RequestID = binary.LittleEndian.Uint64(b)
	n.Data = append([]byte(nil), b[8:]...)
	return n, nil
}
