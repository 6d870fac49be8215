// Package metadata keeps segment descriptors in a cluster store (etcd),
// where peers find them by segment name instead of asking each segment's
// own control endpoint. The engine uses it when Options.Metadata names a
// store; the peer-to-peer handshake stays the default.
package metadata

import (
	"errors"
	"fmt"

	"github.com/kvferry/kvferry/engine/control"
)

// Value layout, little-endian:
//
//	0  4  magic     "KVFM"
//	4  u8 version   1
//	5  u8 kind      valueDescriptor, valueStub
//	6  u8 flags     control.FlagZstd: the payload is zstd-compressed
//	7  u8 reserved  0
//	8  ... payload  valueDescriptor: control.Descriptor.Encode();
//	                valueStub: the segment's name (its descriptor is too
//	                large for the store: ask the segment itself)
const (
	valueMagic   = "KVFM"
	valueVersion = 1
	valueHeader  = 8

	valueDescriptor = 1
	valueStub       = 2
)

// MaxValue is the largest value published. etcd refuses requests above
// 1.5 MiB by default (--max-request-bytes); a descriptor that does not fit
// even compressed is published as a stub that sends resolvers to the
// segment itself.
const MaxValue = 1 << 20

// ErrTooLarge says a segment's descriptor is not in the store because it is
// larger than MaxValue: ask the segment's own control endpoint.
var ErrTooLarge = errors.New("descriptor too large for the metadata store")

// ErrNotPublished says the store holds no descriptor under the name: no
// engine of that name is alive (its lease expired or it closed), or it
// publishes elsewhere.
var ErrNotPublished = errors.New("segment not published")

// ErrMalformed says a stored value is not one this package wrote.
var ErrMalformed = errors.New("malformed metadata value")

// EncodeValue returns the value published for d.
func EncodeValue(d *control.Descriptor) []byte {
	body, flags := control.PackBody(d.Encode())
	if valueHeader+len(body) > MaxValue {
		return header(valueStub, 0, []byte(d.Name))
	}
	return header(valueDescriptor, flags, body)
}

func header(kind, flags uint8, payload []byte) []byte {
	b := make([]byte, valueHeader, valueHeader+len(payload))
	copy(b, valueMagic)
	b[4], b[5], b[6] = valueVersion, kind, flags
	return append(b, payload...)
}

// DecodeValue parses a stored value. A stub yields ErrTooLarge and the
// segment name it holds; anything not written by EncodeValue yields
// ErrMalformed. Decompression is bounded by control.MaxBody.
func DecodeValue(b []byte) (*control.Descriptor, string, error) {
	if len(b) < valueHeader || string(b[:4]) != valueMagic {
		return nil, "", fmt.Errorf("%w: no header", ErrMalformed)
	}
	if b[4] != valueVersion || b[7] != 0 {
		return nil, "", fmt.Errorf("%w: version %d, reserved %d", ErrMalformed, b[4], b[7])
	}
	if len(b) > MaxValue {
		return nil, "", fmt.Errorf("%w: %d bytes, more than %d", ErrMalformed, len(b), MaxValue)
	}
	kind, flags, payload := b[5], b[6], b[valueHeader:]
	switch kind {
	case valueStub:
		if flags != 0 || len(payload) == 0 || len(payload) > 255 {
			return nil, "", fmt.Errorf("%w: stub of %d bytes, flags %#x", ErrMalformed, len(payload), flags)
		}
		return nil, string(payload), ErrTooLarge
	case valueDescriptor:
		if flags&^control.FlagZstd != 0 {
			return nil, "", fmt.Errorf("%w: flags %#x", ErrMalformed, flags)
		}
		raw, err := control.UnpackBody(payload, flags)
		if err != nil {
			return nil, "", fmt.Errorf("%w: %w", ErrMalformed, err)
		}
		d, err := control.DecodeDescriptor(raw)
		if err != nil {
			return nil, "", fmt.Errorf("%w: %w", ErrMalformed, err)
		}
		return d, d.Name, nil
	default:
		return nil, "", fmt.Errorf("%w: kind %d", ErrMalformed, kind)
	}
}
