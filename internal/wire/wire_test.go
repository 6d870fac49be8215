package wire

import (
	"bytes"
	"errors"
	"testing"
)

var errBad = errors.New("bad")

// A Writer lays fields out little-endian in the order written, and a Reader
// reads them back in that order.
func TestWriterAppendsLittleEndianFieldsThatAReaderReadsBack(t *testing.T) {
	w := Writer{B: []byte{0xee}}
	w.U8(0x01)
	w.U32(0x05040302)
	w.Zeros(3)
	w.U64(0x0d0c0b0a09080706)
	w.Zeros(0)
	want := []byte{0xee, 1, 2, 3, 4, 5, 0, 0, 0, 6, 7, 8, 9, 0x0a, 0x0b, 0x0c, 0x0d}
	if !bytes.Equal(w.B, want) {
		t.Fatalf("wrote %x, want %x", w.B, want)
	}
	r := Reader{B: w.B[1:], Malformed: errBad}
	if a, b, z, c := r.U8(), r.U32(), r.Take(3), r.U64(); a != 1 || b != 0x05040302 || !bytes.Equal(z, []byte{0, 0, 0}) ||
		c != 0x0d0c0b0a09080706 || r.End() != nil {
		t.Fatalf("read back %#x %#x %x %#x, %v", a, b, z, c, r.Err)
	}
	if r.U8() != 0 || !errors.Is(r.Err, errBad) || r.Err.Error() != "bad: truncated" {
		t.Fatalf("a read past the end: %v, want a truncation wrapping Malformed", r.Err)
	}
}
