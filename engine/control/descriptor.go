package control

import (
	"encoding/binary"
	"fmt"
	"sort"

	"github.com/kvferry/kvferry/internal/wire"
)

// Descriptor is what a peer needs to reach a segment: its registered
// buffers with their keys, its transports and their addresses, and the
// protocol version. Peers fetch it from the segment's own control endpoint.
type Descriptor struct {
	Name       string          // the segment name, "host:port"
	Version    uint16          // ProtocolVersion of the engine that built it
	Epoch      uint64          // bumps on every change of the buffers
	Transports []TransportAddr // how to reach the segment's data plane
	Buffers    []Buffer        // sorted by Addr, non-overlapping
	// FenceEpoch is the owner's fence epoch when it built the descriptor:
	// an initiator stamps the transfers it plans with it (see FENCE).
	FenceEpoch uint64
}

// TransportAddr names one transport of a segment and where it listens.
type TransportAddr struct {
	Name string // "tcp"
	Addr string // "127.0.0.1:40123"
}

// Buffer is one registered range of a segment.
type Buffer struct {
	Addr     uint64
	Len      uint64
	Key      uint64
	Location string
}

// MaxLocation is the longest location string ("cpu:12", "cuda:3") a
// registration may carry.
const MaxLocation = 32

// Limits of a descriptor, checked before anything is allocated.
const (
	maxString     = 255
	maxTransports = 16
	// MaxBuffers is the most buffers a descriptor holds: with locations
	// of up to MaxLocation bytes it then still fits MaxBody.
	MaxBuffers    = 1 << 18
	maxBuffers    = MaxBuffers
	bufferMinSize = 8 + 8 + 8 + 1
	descMagic     = 0x4453 // "SD"
)

// Find returns the buffer holding all of [addr, addr+n), by binary search.
func (d *Descriptor) Find(addr, n uint64) (Buffer, bool) {
	i := sort.Search(len(d.Buffers), func(i int) bool { return d.Buffers[i].Addr+d.Buffers[i].Len > addr })
	if i == len(d.Buffers) {
		return Buffer{}, false
	}
	b := d.Buffers[i]
	if addr < b.Addr || n > b.Len || addr-b.Addr > b.Len-n {
		return Buffer{}, false
	}
	return b, true
}

// Transport returns the address of the named transport.
func (d *Descriptor) Transport(name string) (string, bool) {
	for _, t := range d.Transports {
		if t.Name == name {
			return t.Addr, true
		}
	}
	return "", false
}

// Encode serialises the descriptor.
func (d *Descriptor) Encode() []byte {
	n := 2 + 2 + 8 + 1 + len(d.Name) + 1 + 4 + 8
	for _, t := range d.Transports {
		n += 2 + len(t.Name) + len(t.Addr)
	}
	for _, b := range d.Buffers {
		n += bufferMinSize + len(b.Location)
	}
	out := make([]byte, 0, n)
	out = binary.LittleEndian.AppendUint16(out, descMagic)
	out = binary.LittleEndian.AppendUint16(out, d.Version)
	out = binary.LittleEndian.AppendUint64(out, d.Epoch)
	out = appendString(out, d.Name)
	out = append(out, uint8(len(d.Transports)))
	for _, t := range d.Transports {
		out = appendString(out, t.Name)
		out = appendString(out, t.Addr)
	}
	out = binary.LittleEndian.AppendUint32(out, uint32(len(d.Buffers)))
	for _, b := range d.Buffers {
		out = binary.LittleEndian.AppendUint64(out, b.Addr)
		out = binary.LittleEndian.AppendUint64(out, b.Len)
		out = binary.LittleEndian.AppendUint64(out, b.Key)
		out = appendString(out, b.Location)
	}
	return binary.LittleEndian.AppendUint64(out, d.FenceEpoch)
}

// appendString appends a length-prefixed string; longer strings are cut to
// maxString bytes, which no valid name, address or location reaches.
func appendString(out []byte, s string) []byte {
	if len(s) > maxString {
		s = s[:maxString]
	}
	out = append(out, uint8(len(s)))
	return append(out, s...)
}

// DecodeDescriptor parses and validates a descriptor: counts are checked
// against the bytes left before anything is allocated, buffers must be
// non-empty, sorted, non-overlapping and not wrap.
func DecodeDescriptor(b []byte) (*Descriptor, error) {
	r := wire.Reader{B: b, Malformed: fmt.Errorf("%w: descriptor", ErrMalformed)}
	if m := r.U16(); r.Err == nil && m != descMagic {
		return nil, fmt.Errorf("%w: descriptor magic %#x", ErrMalformed, m)
	}
	d := &Descriptor{Version: r.U16(), Epoch: r.U64(), Name: r.Str(255)}
	if r.Err == nil && d.Version != ProtocolVersion {
		return nil, fmt.Errorf("%w: descriptor version %d, want %d", ErrMalformed, d.Version, ProtocolVersion)
	}
	nt := int(r.U8())
	if nt > maxTransports {
		return nil, fmt.Errorf("%w: %d transports", ErrMalformed, nt)
	}
	for i := 0; i < nt && r.Err == nil; i++ {
		d.Transports = append(d.Transports, TransportAddr{Name: r.Str(255), Addr: r.Str(255)})
	}
	nb := int(r.U32())
	if r.Err == nil && (nb > maxBuffers || nb*bufferMinSize > len(r.B)) {
		return nil, fmt.Errorf("%w: %d buffers in %d bytes", ErrMalformed, nb, len(r.B))
	}
	if r.Err == nil {
		d.Buffers = make([]Buffer, 0, nb)
	}
	for i := 0; i < nb && r.Err == nil; i++ {
		buf := Buffer{Addr: r.U64(), Len: r.U64(), Key: r.U64(), Location: r.Str(255)}
		if r.Err != nil {
			break
		}
		if buf.Len == 0 || buf.Addr+buf.Len < buf.Addr {
			return nil, fmt.Errorf("%w: buffer %d [%#x, +%d) is empty or wraps", ErrMalformed, i, buf.Addr, buf.Len)
		}
		if i > 0 {
			p := d.Buffers[i-1]
			if buf.Addr < p.Addr+p.Len {
				return nil, fmt.Errorf("%w: buffer %d at %#x overlaps or is out of order", ErrMalformed, i, buf.Addr)
			}
		}
		d.Buffers = append(d.Buffers, buf)
	}
	if r.Err != nil {
		return nil, r.Err
	}
	d.FenceEpoch = r.U64()
	if r.Err != nil {
		return nil, r.Err
	}
	if len(r.B) != 0 {
		return nil, fmt.Errorf("%w: %d trailing bytes after descriptor", ErrMalformed, len(r.B))
	}
	return d, nil
}
