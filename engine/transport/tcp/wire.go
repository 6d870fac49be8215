package tcp

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
)

// Frame layout (little endian, HeaderSize bytes, then Length payload bytes
// for frames that carry one):
//
//	0  u16 magic      "KF"
//	2  u8  version    1
//	3  u8  type       frameHello ... frameReadDone
//	4  u32 status     0 in requests; the owner's verdict in answers
//	8  u64 seq        the initiator's slice number on this connection
//	16 u64 request id
//	24 u32 generation
//	28 u32 length     payload bytes (WRITE, READ_DATA, HELLO); bytes asked (READ)
//	32 u64 buffer key
//	40 u64 address    owner address
//	48 u64 grant id
//	56 u64 done       bytes applied (WRITE_ACK) or valid (READ_DONE); in
//	                  HELLO, the initiator's feature bits (helloGoAway, helloAuth,
//	                  helloCompress, helloReadZ), in HELLO_ACK the owner's
//	                  (helloCompress, helloReadZ); in
//	                  WRITE and READ, the owner's fence epoch the slice was
//	                  planned under (0 from initiators that know none)
const (
	HeaderSize   = 64
	magic        = 0x464b // "KF"
	version      = 1
	maxHelloName = 1024
	// MaxSliceLength bounds the length of one WRITE or READ frame.
	MaxSliceLength = 64 << 20
)

// Frame types.
const (
	frameHello    = 1 // initiator -> owner, payload: the initiator's segment name
	frameHelloAck = 2 // owner -> initiator
	frameWrite    = 3 // initiator -> owner, payload: the bytes to write
	frameWriteAck = 4 // owner -> initiator, after the bytes were applied or refused
	frameRead     = 5 // initiator -> owner
	frameReadData = 6 // owner -> initiator, payload: the bytes read (zeros past a refusal)
	frameReadDone = 7 // owner -> initiator, after READ_DATA or instead of it
	// frameGoAway (owner -> initiator) says the owner closes the
	// connection as idle: it answered every request up to seq and read
	// nothing after, so the initiator may post the others again
	// elsewhere. Sent only to initiators whose HELLO set helloGoAway.
	frameGoAway = 8
	// frameChallenge (owner -> initiator, payload Po | No | MACo) and
	// frameAuth (initiator -> owner, payload MACi) authenticate a
	// connection between HELLO and HELLO_ACK (see auth.go).
	frameChallenge = 9
	frameAuth      = 10
	// frameWriteZ (initiator -> owner) is a WRITE whose payload is a
	// kvcodec block: the owner admits the block's decoded length as a
	// WRITE of that length and answers WRITE_ACK. Sent only to owners
	// whose HELLO_ACK set helloCompress.
	frameWriteZ = 11
	// frameReadDataZ (owner -> initiator) is a READ_DATA whose payload is
	// a kvcodec block decoding to the whole slice; READ_DONE follows as
	// after READ_DATA. Sent only to initiators whose HELLO set
	// helloReadZ, and never after a refusal: the owner snapshots the
	// bytes under its guard before it encodes them.
	frameReadDataZ = 12
)

// helloGoAway, in HELLO's done field, says the initiator understands
// GOAWAY. An owner of an older version ignores the field, and an older
// initiator leaves it 0, so either side may be older: its idle connections
// are then simply closed.
const helloGoAway = 1

// helloAuth, in HELLO's done field, says the initiator authenticates: its
// payload is its public key and a nonce before its name, and it expects a
// CHALLENGE (see auth.go).
const helloAuth = 2

// helloCompress, in HELLO's done field, says the initiator may send
// WRITE_Z frames; in HELLO_ACK's, that the owner takes them. An owner of an
// older version leaves HELLO_ACK's field 0, and the initiator then sends
// plain WRITEs.
const helloCompress = 4

// helloReadZ, in HELLO's done field, says the initiator takes READ_DATA_Z
// answers; the owner sends them when its own compression is on, and sets
// the bit in HELLO_ACK to say it may. An owner of an older version ignores
// the bit and answers plain READ_DATA.
const helloReadZ = 8

// Statuses in answers. Every non-zero status is a refusal, final for its
// request.
const (
	statusOK           = 0
	statusStaleKey     = 1
	statusOutOfBounds  = 2
	statusUnregistered = 3
	statusRefused      = 4
	statusBadRequest   = 5
	statusAborted      = 6 // the request id (at this generation) was aborted
	statusFenced       = 7 // a range the slice touches was fenced after it was planned
	// statusUnauthenticated, in HELLO_ACK: the owner refuses the
	// connection for authentication, and closes it.
	statusUnauthenticated = 8
	maxKnownStatus        = statusUnauthenticated
)

// header is a decoded frame header.
type header struct {
	typ        uint8
	status     uint32
	seq        uint64
	requestID  uint64
	generation uint32
	length     uint32
	key        memory.Key
	addr       uint64
	grantID    uint64
	done       uint64
}

// errBadFrame marks a frame that cannot be parsed; the connection is then
// out of step and must be closed.
var errBadFrame = fmt.Errorf("%w: bad frame", transport.ErrProtocol)

func (h *header) encode(b []byte) {
	_ = b[HeaderSize-1]
	binary.LittleEndian.PutUint16(b[0:], magic)
	b[2] = version
	b[3] = h.typ
	binary.LittleEndian.PutUint32(b[4:], h.status)
	binary.LittleEndian.PutUint64(b[8:], h.seq)
	binary.LittleEndian.PutUint64(b[16:], h.requestID)
	binary.LittleEndian.PutUint32(b[24:], h.generation)
	binary.LittleEndian.PutUint32(b[28:], h.length)
	binary.LittleEndian.PutUint64(b[32:], uint64(h.key))
	binary.LittleEndian.PutUint64(b[40:], h.addr)
	binary.LittleEndian.PutUint64(b[48:], h.grantID)
	binary.LittleEndian.PutUint64(b[56:], h.done)
}

// decode parses and validates a header: magic, version, type, lengths.
func (h *header) decode(b []byte) error {
	if len(b) < HeaderSize {
		return fmt.Errorf("%w: %d header bytes", errBadFrame, len(b))
	}
	if m := binary.LittleEndian.Uint16(b[0:]); m != magic {
		return fmt.Errorf("%w: magic %#x", errBadFrame, m)
	}
	if v := b[2]; v != version {
		return fmt.Errorf("%w: version %d, want %d", errBadFrame, v, version)
	}
	h.typ = b[3]
	h.status = binary.LittleEndian.Uint32(b[4:])
	h.seq = binary.LittleEndian.Uint64(b[8:])
	h.requestID = binary.LittleEndian.Uint64(b[16:])
	h.generation = binary.LittleEndian.Uint32(b[24:])
	h.length = binary.LittleEndian.Uint32(b[28:])
	h.key = memory.Key(binary.LittleEndian.Uint64(b[32:]))
	h.addr = binary.LittleEndian.Uint64(b[40:])
	h.grantID = binary.LittleEndian.Uint64(b[48:])
	h.done = binary.LittleEndian.Uint64(b[56:])
	switch h.typ {
	case frameHello:
		if h.length == 0 || h.length > maxHelloName {
			return fmt.Errorf("%w: hello name of %d bytes", errBadFrame, h.length)
		}
	case frameWrite, frameWriteZ, frameRead, frameReadData, frameReadDataZ:
		if h.length == 0 || h.length > MaxSliceLength {
			return fmt.Errorf("%w: length %d", errBadFrame, h.length)
		}
	case frameChallenge:
		if h.length != challengeSize {
			return fmt.Errorf("%w: CHALLENGE of %d bytes", errBadFrame, h.length)
		}
	case frameAuth:
		if h.length != authMACSize {
			return fmt.Errorf("%w: AUTH of %d bytes", errBadFrame, h.length)
		}
	case frameHelloAck, frameWriteAck, frameReadDone, frameGoAway:
		if h.length != 0 {
			return fmt.Errorf("%w: length %d on a frame without payload", errBadFrame, h.length)
		}
	default:
		return fmt.Errorf("%w: type %d", errBadFrame, h.typ)
	}
	if h.status > maxKnownStatus {
		return fmt.Errorf("%w: status %d", errBadFrame, h.status)
	}
	return nil
}

// statusErrs pairs each refusal status with the error it stands for, in
// the order statusOf tests them; statusOf and errOf both read it, so the
// two directions cannot disagree.
var statusErrs = []struct {
	status uint32
	err    error
}{
	{statusAborted, transport.ErrAborted},
	{statusFenced, transport.ErrFenced},
	{statusStaleKey, memory.ErrStaleKey},
	{statusOutOfBounds, memory.ErrOutOfBounds},
	{statusUnregistered, memory.ErrUnregistered},
	{statusBadRequest, memory.ErrInvalidRange},
}

// statusOf maps an owner-side admission error to its wire status.
func statusOf(err error) uint32 {
	if err == nil {
		return statusOK
	}
	for _, se := range statusErrs {
		if errors.Is(err, se.err) {
			return se.status
		}
	}
	return statusRefused
}

// errOf maps a wire status back to an error matchable with errors.Is, both
// as a refusal and as the registry's reason.
func errOf(st uint32) error {
	if st == statusOK {
		return nil
	}
	for _, se := range statusErrs {
		if se.status == st {
			return fmt.Errorf("%w: %w", transport.ErrRefused, se.err)
		}
	}
	return transport.ErrRefused
}
