// Package wire reads and writes little-endian messages for the control
// plane's and the transports' codecs. Every read checks the bytes left
// first, and the first shortfall sticks, so a decoder reads a whole message
// and looks at Err once; a Writer appends fields in order.
package wire

import (
	"encoding/binary"
	"fmt"
)

// Reader reads fields from B in order.
type Reader struct {
	B   []byte // what is left
	Err error  // the first error; reads return zeros after it
	// Malformed is wrapped by Reader's own errors (truncation, a string
	// over its limit, trailing bytes), so callers match their package's
	// sentinel with errors.Is.
	Malformed error
}

// Take returns the next n bytes, or nil when fewer are left.
func (r *Reader) Take(n int) []byte {
	if r.Err != nil {
		return nil
	}
	if n < 0 || len(r.B) < n {
		r.Err = fmt.Errorf("%w: truncated", r.Malformed)
		return nil
	}
	v := r.B[:n]
	r.B = r.B[n:]
	return v
}

// U8 reads one byte.
func (r *Reader) U8() uint8 {
	if b := r.Take(1); b != nil {
		return b[0]
	}
	return 0
}

// U16 reads a little-endian uint16.
func (r *Reader) U16() uint16 {
	if b := r.Take(2); b != nil {
		return binary.LittleEndian.Uint16(b)
	}
	return 0
}

// U32 reads a little-endian uint32.
func (r *Reader) U32() uint32 {
	if b := r.Take(4); b != nil {
		return binary.LittleEndian.Uint32(b)
	}
	return 0
}

// U64 reads a little-endian uint64.
func (r *Reader) U64() uint64 {
	if b := r.Take(8); b != nil {
		return binary.LittleEndian.Uint64(b)
	}
	return 0
}

// Str reads a string prefixed by its one-byte length, at most limit bytes.
func (r *Reader) Str(limit int) string {
	n := int(r.U8())
	if r.Err == nil && n > limit {
		r.Err = fmt.Errorf("%w: string of %d bytes (at most %d)", r.Malformed, n, limit)
		return ""
	}
	return string(r.Take(n))
}

// End reports Err, or an error when bytes are left over.
func (r *Reader) End() error {
	if r.Err == nil && len(r.B) != 0 {
		r.Err = fmt.Errorf("%w: %d trailing bytes", r.Malformed, len(r.B))
	}
	return r.Err
}

// Writer appends little-endian fields to B in order.
type Writer struct {
	B []byte
}

// U8 appends one byte.
func (w *Writer) U8(v uint8) { w.B = append(w.B, v) }

// U32 appends a little-endian uint32.
func (w *Writer) U32(v uint32) { w.B = binary.LittleEndian.AppendUint32(w.B, v) }

// U64 appends a little-endian uint64.
func (w *Writer) U64(v uint64) { w.B = binary.LittleEndian.AppendUint64(w.B, v) }

// Zeros appends n zero bytes (reserved fields).
func (w *Writer) Zeros(n int) {
	for range n {
		w.B = append(w.B, 0)
	}
}
