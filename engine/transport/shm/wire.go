package shm

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
)

// Frame layout (little endian, FrameSize bytes; HELLO alone is followed by
// length bytes of the initiator's name). No frame carries the bytes of a
// transfer: they stay in the initiator's memory, which the owner reads or
// writes itself.
//
//	0  u16 magic      "KS"
//	2  u8  version    1
//	3  u8  type       frameHello ... frameAnswer
//	4  u32 status     the owner's verdict (ANSWER, HELLO_ACK); the way the
//	                  initiator's memory is reached (WRITE, READ)
//	8  u64 seq        the initiator's slice number on this connection
//	16 u64 request id
//	24 u32 generation
//	28 u32 length     bytes to move (WRITE, READ); name bytes (HELLO)
//	32 u64 buffer key
//	40 u64 address    owner address
//	48 u64 grant id
//	56 u64 epoch      the owner's fence epoch the slice was planned under;
//	                  bytes moved (ANSWER); feature bits (HELLO_ACK)
//	64 u64 local      share id (reachShared, reachGPU) or address
//	                  (reachAttach) of the initiator's memory; share id
//	                  (SHARE, SHARE_GPU, UNSHARE); the probe's address (HELLO)
//	72 u64 offset     in the share (reachShared, reachGPU); the share's
//	                  size (SHARE, SHARE_GPU); the probe's value (HELLO)
//
// SHARE_GPU is followed by length bytes: the allocation's CUDA IPC handle
// (64 bytes), then the PCI bus id of its device.
const (
	FrameSize = 80
	magic     = 0x534b // "KS"
	version   = 1
	maxName   = 1024
	// MaxSliceLength bounds the length of one WRITE or READ.
	MaxSliceLength = 64 << 20
)

// Frame types.
const (
	frameHello    = 1 // initiator -> owner; the lease's memfd rides with it (SCM_RIGHTS)
	frameHelloAck = 2 // owner -> initiator
	frameShare    = 3 // initiator -> owner; a buffer's memfd rides with it
	frameUnshare  = 4 // initiator -> owner: the buffer was freed, unmap it
	frameWrite    = 5 // initiator -> owner: copy from the initiator's memory into the owner's
	frameRead     = 6 // initiator -> owner: copy from the owner's memory into the initiator's
	frameAnswer   = 7 // owner -> initiator: the slice's outcome, once no byte of it moves any more
	frameShareGPU = 8 // initiator -> owner: an allocation of GPU memory, by its CUDA IPC handle
)

// IPCHandleSize is the size of a CUDA IPC memory handle.
const IPCHandleSize = 64

// maxBusID bounds the PCI bus id in SHARE_GPU ("0000:3b:00.0").
const maxBusID = 64

// How the owner reaches the initiator's memory for one slice.
const (
	reachShared = 1 // a view of a buffer the initiator shared (SHARE)
	reachAttach = 2 // cross-memory attach: process_vm_readv/writev
	reachGPU    = 3 // GPU memory the initiator shared by its IPC handle (SHARE_GPU)
)

// Feature bits in HELLO_ACK's epoch field. helloAttach: the owner read the
// initiator's probe with process_vm_readv, so cross-memory attach works
// both ways. helloGPU: the owner opens CUDA IPC handles (it has the CUDA
// driver and a GPU), so the initiator's GPU memory moves without staging.
const (
	helloAttach = 1
	helloGPU    = 2
)

// Statuses in answers; every non-zero one is a refusal, final for its
// request.
const (
	statusOK           = 0
	statusStaleKey     = 1
	statusOutOfBounds  = 2
	statusUnregistered = 3
	statusRefused      = 4
	statusBadRequest   = 5
	statusAborted      = 6
	statusFenced       = 7
	// statusUnreachable: the owner could not reach the initiator's
	// memory (a share it does not hold, an address it cannot read).
	statusUnreachable = 8
	maxKnownStatus    = statusUnreachable
)

// header is a decoded frame.
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
	epoch      uint64
	local      uint64
	offset     uint64
}

// errBadFrame marks a frame that cannot be parsed; the connection is then
// out of step and is closed.
var errBadFrame = fmt.Errorf("%w: bad frame", transport.ErrProtocol)

func (h *header) encode(b []byte) {
	_ = b[FrameSize-1]
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
	binary.LittleEndian.PutUint64(b[56:], h.epoch)
	binary.LittleEndian.PutUint64(b[64:], h.local)
	binary.LittleEndian.PutUint64(b[72:], h.offset)
}

// decode parses and validates a frame: magic, version, type, lengths,
// statuses and ways of reaching memory.
func (h *header) decode(b []byte) error {
	if len(b) < FrameSize {
		return fmt.Errorf("%w: %d bytes", errBadFrame, len(b))
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
	h.epoch = binary.LittleEndian.Uint64(b[56:])
	h.local = binary.LittleEndian.Uint64(b[64:])
	h.offset = binary.LittleEndian.Uint64(b[72:])
	switch h.typ {
	case frameHello:
		if h.length == 0 || h.length > maxName {
			return fmt.Errorf("%w: HELLO name of %d bytes", errBadFrame, h.length)
		}
	case frameWrite, frameRead:
		if h.length == 0 || h.length > MaxSliceLength {
			return fmt.Errorf("%w: length %d", errBadFrame, h.length)
		}
		if h.status != reachShared && h.status != reachAttach && h.status != reachGPU {
			return fmt.Errorf("%w: unknown way %d to reach the initiator's memory", errBadFrame, h.status)
		}
		return nil
	case frameShare:
		if h.local == 0 || h.offset == 0 || h.length != 0 {
			return fmt.Errorf("%w: SHARE of id %d, %d bytes", errBadFrame, h.local, h.offset)
		}
	case frameShareGPU:
		if h.local == 0 || h.offset == 0 || h.length <= IPCHandleSize || h.length > IPCHandleSize+maxBusID {
			return fmt.Errorf("%w: SHARE_GPU of id %d, %d bytes, %d bytes of handle and bus id", errBadFrame, h.local, h.offset, h.length)
		}
	case frameUnshare, frameHelloAck, frameAnswer:
		if h.length != 0 {
			return fmt.Errorf("%w: length %d on type %d", errBadFrame, h.length, h.typ)
		}
	default:
		return fmt.Errorf("%w: type %d", errBadFrame, h.typ)
	}
	if h.status > maxKnownStatus {
		return fmt.Errorf("%w: status %d", errBadFrame, h.status)
	}
	return nil
}

// errUnreachable is the owner's reason when it cannot reach the initiator's
// memory for a slice.
var errUnreachable = errors.New("the owner cannot reach the initiator's memory")

// statusErrs pairs each refusal status with the error it stands for, in
// the order statusOf tests them.
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
	{statusUnreachable, errUnreachable},
}

// statusOf maps an owner-side error to its wire status.
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

// errOf maps a wire status to the initiator's error: every refusal wraps
// transport.ErrRefused, final for its request.
func errOf(status uint32) error {
	if status == statusOK {
		return nil
	}
	for _, se := range statusErrs {
		if se.status == status {
			return fmt.Errorf("%w: %w", transport.ErrRefused, se.err)
		}
	}
	return transport.ErrRefused
}
