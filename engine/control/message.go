// Package control is the engine's control plane: ZMTP 3.0 (ZeroMQ's wire
// protocol) over one libzmq STREAM socket bound on the engine's segment name
// ("host:port"), carrying both the connections peers open to us and ours to
// them. The plane parses ZMTP itself (zmtp.go), so every message is bounded
// in frames and bytes before it is buffered; libzmq DEALER and ROUTER
// sockets remain valid peers. A peer is named by the identity in its READY,
// as a ROUTER would name it. One goroutine owns every socket; other
// goroutines hand it work through a queue and wake it through an inproc
// socket, so there is no polling delay.
//
// Every message is an envelope frame, optionally followed by one body frame.
// Both are validated and size-capped before anything is allocated for them;
// a malformed message is counted and dropped (with rate-limited warnings),
// and never stops the loop.
package control

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"

	"github.com/klauspost/compress/zstd"

	"github.com/kvferry/kvferry/internal/wire"
)

// Envelope layout (little endian, EnvelopeSize bytes):
//
//	0  u16 magic    "KC"
//	2  u8  version  ProtocolVersion
//	3  u8  type     a MsgType
//	4  u8  flags    FlagZstd: the body is zstd-compressed
//	5  u8  reserved, zero
//	6  u16 reserved, zero
//	8  u64 correlation id, echoed in the reply
const (
	EnvelopeSize    = 16
	envelopeMagic   = 0x434b // "KC"
	ProtocolVersion = 1

	// MaxBody caps a body frame on the wire and after decompression.
	MaxBody = 16 << 20
	// MaxFrames caps the frames of one message (identity, envelope, body).
	MaxFrames = 3
	// compressAbove is the body size past which bodies are compressed:
	// below it zstd costs more time than the bytes it saves on loopback.
	compressAbove = 64 << 10
)

// MsgType names a control message.
type MsgType uint8

// Message types. Requests are answered by a reply with the same
// correlation id; one-way messages (see IsOneWay) are not, and are matched
// by their bodies instead.
const (
	MsgGetDescriptor MsgType = 1 // -> Descriptor
	MsgDescriptor    MsgType = 2
	MsgPing          MsgType = 3 // -> Pong
	MsgPong          MsgType = 4
	MsgError         MsgType = 5 // a reply whose body is a UTF-8 reason
	MsgAbort         MsgType = 6 // one-way, owner -> initiator: an AbortMsg
	MsgAbortAck      MsgType = 7 // one-way, initiator -> owner: an AbortAck
	MsgNotify        MsgType = 8 // -> NotifyAck; body: a Notification
	MsgNotifyAck     MsgType = 9
	MsgCanceled      MsgType = 10 // one-way, initiator -> owner: an AbortMsg body; it gave up on the request
	MsgTransport     MsgType = 11 // -> TransportReply; a data-plane transport's own handshake (rdma: QPs, keys)
	MsgTransportRep  MsgType = 12
	MsgFence         MsgType = 13 // one-way, owner -> initiator: a FenceMsg
	MsgFenceAck      MsgType = 14 // one-way, initiator -> owner: a FenceAck
	maxMsgType               = MsgFenceAck
)

// msgTypeNames are the types' names in logs and errors.
var msgTypeNames = [...]string{
	MsgGetDescriptor: "GET_DESCRIPTOR",
	MsgDescriptor:    "DESCRIPTOR",
	MsgPing:          "PING",
	MsgPong:          "PONG",
	MsgError:         "ERROR",
	MsgAbort:         "ABORT",
	MsgAbortAck:      "ABORT_ACK",
	MsgNotify:        "NOTIFY",
	MsgNotifyAck:     "NOTIFY_ACK",
	MsgFence:         "FENCE",
	MsgFenceAck:      "FENCE_ACK",
	MsgCanceled:      "CANCELED",
	MsgTransport:     "TRANSPORT",
	MsgTransportRep:  "TRANSPORT_REPLY",
}

func (t MsgType) String() string {
	return enumName(msgTypeNames[:], int(t), "MsgType")
}

// enumName returns names[v], or "Type(v)" for a value without a name.
func enumName(names []string, v int, typ string) string {
	if v >= 0 && v < len(names) && names[v] != "" {
		return names[v]
	}
	return fmt.Sprintf("%s(%d)", typ, v)
}

// IsReply reports whether t answers a request.
func (t MsgType) IsReply() bool {
	return t == MsgDescriptor || t == MsgPong || t == MsgError || t == MsgNotifyAck || t == MsgTransportRep
}

// IsOneWay reports whether t expects no reply.
func (t MsgType) IsOneWay() bool {
	return t == MsgAbort || t == MsgAbortAck || t == MsgCanceled || t == MsgFence || t == MsgFenceAck
}

// FlagZstd marks a compressed body.
const FlagZstd = 1

// Envelope is the decoded first frame of every message.
type Envelope struct {
	Type  MsgType
	Flags uint8
	Corr  uint64
}

// ErrMalformed marks a message that failed validation.
var ErrMalformed = errors.New("malformed control message")

// exactBody returns a reader over b, which must be exactly size bytes;
// what names the message part in the error ("ABORT body").
func exactBody(what string, b []byte, size int) (*wire.Reader, error) {
	if len(b) != size {
		return nil, fmt.Errorf("%w: %s of %d bytes, want %d", ErrMalformed, what, len(b), size)
	}
	return &wire.Reader{B: b, Malformed: ErrMalformed}, nil
}

// reservedZero refuses a reserved field of message msg that is not zero:
// a peer that sets it speaks a layout this one does not know.
func reservedZero(msg string, z uint64) error {
	if z != 0 {
		return fmt.Errorf("%w: %s reserved field %#x is not zero", ErrMalformed, msg, z)
	}
	return nil
}

// EncodeEnvelope returns the envelope frame.
func EncodeEnvelope(e Envelope) []byte {
	b := make([]byte, EnvelopeSize)
	binary.LittleEndian.PutUint16(b[0:], envelopeMagic)
	b[2] = ProtocolVersion
	b[3] = uint8(e.Type)
	b[4] = e.Flags
	binary.LittleEndian.PutUint64(b[8:], e.Corr)
	return b
}

// DecodeEnvelope parses and validates an envelope frame.
func DecodeEnvelope(b []byte) (Envelope, error) {
	var e Envelope
	if _, err := exactBody("envelope", b, EnvelopeSize); err != nil {
		return e, err
	}
	if m := binary.LittleEndian.Uint16(b[0:]); m != envelopeMagic {
		return e, fmt.Errorf("%w: magic %#x", ErrMalformed, m)
	}
	if v := b[2]; v != ProtocolVersion {
		return e, fmt.Errorf("%w: protocol version %d, want %d", ErrMalformed, v, ProtocolVersion)
	}
	e.Type = MsgType(b[3])
	if e.Type == 0 || e.Type > maxMsgType {
		return e, fmt.Errorf("%w: type %d", ErrMalformed, b[3])
	}
	e.Flags = b[4]
	if e.Flags&^FlagZstd != 0 {
		return e, fmt.Errorf("%w: flags %#x", ErrMalformed, e.Flags)
	}
	if b[5] != 0 || b[6] != 0 || b[7] != 0 {
		return e, fmt.Errorf("%w: reserved bytes %#x %#x %#x are not zero", ErrMalformed, b[5], b[6], b[7])
	}
	e.Corr = binary.LittleEndian.Uint64(b[8:])
	return e, nil
}

var (
	zOnce sync.Once
	zEnc  *zstd.Encoder
	zDec  *zstd.Decoder
)

func codecs() (*zstd.Encoder, *zstd.Decoder) {
	zOnce.Do(func() {
		var err error
		zEnc, err = zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedFastest), zstd.WithEncoderConcurrency(1))
		if err != nil {
			panic(err) // only on invalid options
		}
		zDec, err = zstd.NewReader(nil, zstd.WithDecoderMaxMemory(MaxBody), zstd.WithDecoderConcurrency(1),
			zstd.WithDecoderMaxWindow(MaxBody))
		if err != nil {
			panic(err)
		}
	})
	return zEnc, zDec
}

// PackBody compresses body when that pays and returns it with its flags.
func PackBody(body []byte) ([]byte, uint8) {
	if len(body) <= compressAbove {
		return body, 0
	}
	enc, _ := codecs()
	z := enc.EncodeAll(body, make([]byte, 0, len(body)/4))
	if len(z) >= len(body) {
		return body, 0
	}
	return z, FlagZstd
}

// UnpackBody undoes PackBody, refusing output beyond MaxBody.
func UnpackBody(body []byte, flags uint8) ([]byte, error) {
	if len(body) > MaxBody {
		return nil, fmt.Errorf("%w: body of %d bytes", ErrMalformed, len(body))
	}
	if flags&FlagZstd == 0 {
		return body, nil
	}
	_, dec := codecs()
	out, err := dec.DecodeAll(body, nil)
	if err != nil {
		return nil, fmt.Errorf("%w: zstd body: %w", ErrMalformed, err)
	}
	if len(out) > MaxBody {
		return nil, fmt.Errorf("%w: body inflates past %d bytes", ErrMalformed, MaxBody)
	}
	return out, nil
}
