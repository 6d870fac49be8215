package kvcodec

// Hostile review of the decoder: fuzzing with the length the block
// declares (the harness in kvcodec_test.go draws it apart, so it rarely
// gets past the length check), and what a tiny block makes Decode allocate.

import (
	"encoding/binary"
	"errors"
	"runtime"
	"testing"
)

// FuzzReviewDecodeDeclared decodes each input into a destination of the
// length it declares (capped), as serveWriteZ does. Passes a 20 s run on
// a666369.
func FuzzReviewDecodeDeclared(f *testing.F) {
	for _, codec := range []Codec{CodecS2, CodecZstd, CodecHuff0} {
		enc, _ := NewEncoder(codec)
		for _, w := range []int{1, 2} {
			b, _ := enc.Encode(nil, kvLike(3000, uint64(w)), w)
			f.Add(b)
			b, _ = enc.Encode(nil, make([]byte, ChunkSize+10), w) // RLE chunks
			f.Add(b)
		}
	}
	dec, _ := NewDecoder()
	f.Fuzz(func(t *testing.T, block []byte) {
		n, err := RawLen(block)
		if err != nil || n > 64<<10 {
			return
		}
		dst := make([]byte, n, n+64)
		tail := dst[n:cap(dst)]
		for i := range tail {
			tail[i] = 0x5A
		}
		if err := dec.Decode(dst, block); err != nil && !errors.Is(err, ErrMalformed) {
			t.Fatalf("error %v is not ErrMalformed", err)
		}
		for i, b := range dst[n:cap(dst)] {
			if b != 0x5A {
				t.Fatalf("byte %d past the declared length written", i)
			}
		}
	})
}

// rleBlock is a 2-plane block of n bytes made of repeated-byte chunks:
// about 6 bytes per 128 KiB of plane.
func rleBlock(n int) []byte {
	b := []byte{version, byte(CodecHuff0), 2, 0, 0, 0, 0, 0}
	binary.LittleEndian.PutUint32(b[4:], uint32(n))
	for plane := 0; plane < 2; plane++ {
		for off := 0; off < n/2; off += ChunkSize {
			b = append(b, storedRLE, 1, 0, 0, 0, 0x42)
		}
	}
	return b
}

// A 3 KiB block declaring 64 MiB makes Decode allocate a second 64 MiB
// (the plane scratch from planePool) beside the caller's dst. serveWriteZ
// budgets the block and dst only (n + raw), so the owner really holds
// n + 2*raw per WRITE_Z: up to twice zBudgetBytes, from kilobytes of input,
// and sync.Pool keeps the buffers after. FAILS on a666369: the scratch
// is outside any bound the caller sets.
func TestReviewTwoPlaneDecodeAllocatesNoSecondRawBuffer(t *testing.T) {
	const n = MaxBlock
	block := rleBlock(n)
	dec, _ := NewDecoder()
	dst := make([]byte, n)
	// Drain the pool so the measurement sees the allocation a fresh
	// concurrent decode makes.
	for i := 0; i < 4; i++ {
		runtime.GC()
	}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	if err := dec.Decode(dst, block); err != nil {
		t.Fatal(err)
	}
	runtime.ReadMemStats(&after)
	for i, b := range dst {
		if b != 0x42 {
			t.Fatalf("byte %d decoded as %#x", i, b)
		}
	}
	if grew := after.TotalAlloc - before.TotalAlloc; grew > n/8 {
		t.Fatalf("a %d-byte block made Decode allocate %d MiB beside its %d MiB destination: memory the caller's budget does not count",
			len(block), grew>>20, n>>20)
	}
}
