package control

import (
	"encoding/binary"
	"fmt"

	"github.com/kvferry/kvferry/internal/wire"
)

// FenceRange is one fenced range of the owner's memory.
type FenceRange struct{ Addr, Len uint64 }

// MaxFenceRanges caps the ranges of one FENCE (16 bytes each: 8 MiB, within
// MaxBody).
const MaxFenceRanges = 1 << 19

// FenceMsg is the body of FENCE: the owner fenced Ranges at Epoch, so every
// access to them planned under an older epoch is refused from now on, and
// every access planned under an epoch below Floor is refused everywhere
// (the owner folded its older fences into it). An initiator stamps the
// transfers it plans from now on with Epoch, never posts again one it
// planned before that touches the ranges, and answers with FENCE_ACK.
// Layout (little endian): u64 epoch, u64 floor, u32 range count, u32 zero,
// then per range u64 address, u64 length.
type FenceMsg struct {
	Epoch  uint64
	Floor  uint64
	Ranges []FenceRange
}

const fenceHeader = 24

// Encode returns the body.
func (m FenceMsg) Encode() []byte {
	b := make([]byte, fenceHeader, fenceHeader+16*len(m.Ranges))
	binary.LittleEndian.PutUint64(b[0:], m.Epoch)
	binary.LittleEndian.PutUint64(b[8:], m.Floor)
	binary.LittleEndian.PutUint32(b[16:], uint32(len(m.Ranges)))
	for _, r := range m.Ranges {
		b = binary.LittleEndian.AppendUint64(b, r.Addr)
		b = binary.LittleEndian.AppendUint64(b, r.Len)
	}
	return b
}

// DecodeFenceMsg parses and validates a FENCE body: the count is checked
// against the bytes present before anything is allocated; ranges must not
// be empty or wrap, and the floor may not pass the epoch.
func DecodeFenceMsg(b []byte) (FenceMsg, error) {
	var m FenceMsg
	if len(b) < fenceHeader {
		return m, fmt.Errorf("%w: FENCE body of %d bytes", ErrMalformed, len(b))
	}
	m.Epoch = binary.LittleEndian.Uint64(b[0:])
	m.Floor = binary.LittleEndian.Uint64(b[8:])
	n := binary.LittleEndian.Uint32(b[16:])
	if err := reservedZero("FENCE", uint64(binary.LittleEndian.Uint32(b[20:]))); err != nil {
		return m, err
	}
	if m.Epoch == 0 || m.Floor > m.Epoch {
		return m, fmt.Errorf("%w: FENCE epoch %d with floor %d", ErrMalformed, m.Epoch, m.Floor)
	}
	if n > MaxFenceRanges || uint64(len(b)-fenceHeader) != 16*uint64(n) {
		return m, fmt.Errorf("%w: FENCE of %d ranges in %d bytes", ErrMalformed, n, len(b))
	}
	m.Ranges = make([]FenceRange, n)
	for i := range m.Ranges {
		o := fenceHeader + 16*i
		r := FenceRange{Addr: binary.LittleEndian.Uint64(b[o:]), Len: binary.LittleEndian.Uint64(b[o+8:])}
		if r.Len == 0 || r.Addr+r.Len < r.Addr {
			return FenceMsg{}, fmt.Errorf("%w: FENCE range %d [%#x, +%d) is empty or wraps", ErrMalformed, i, r.Addr, r.Len)
		}
		m.Ranges[i] = r
	}
	return m, nil
}

// FenceAck is the body of FENCE_ACK: the initiator learned the fence of
// Epoch, so the transfers it plans from now on carry it (or a later one).
// The owner's safety never rests on it. Layout (little endian,
// FenceAckSize bytes): u64 epoch, 8 zero bytes.
type FenceAck struct {
	Epoch uint64
}

// FenceAckSize is the exact size of a FENCE_ACK body.
const FenceAckSize = 16

// Encode returns the body.
func (m FenceAck) Encode() []byte {
	w := wire.Writer{B: make([]byte, 0, FenceAckSize)}
	w.U64(m.Epoch)
	w.U64(0)
	return w.B
}

// DecodeFenceAck parses and validates a FENCE_ACK body.
func DecodeFenceAck(b []byte) (FenceAck, error) {
	r, err := exactBody("FENCE_ACK body", b, FenceAckSize)
	if err != nil {
		return FenceAck{}, err
	}
	m := FenceAck{Epoch: r.U64()}
	if err := reservedZero("FENCE_ACK", r.U64()); err != nil {
		return m, err
	}
	if m.Epoch == 0 {
		return m, fmt.Errorf("%w: FENCE_ACK of epoch 0", ErrMalformed)
	}
	return m, nil
}
