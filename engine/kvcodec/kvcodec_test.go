package kvcodec

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"math/rand/v2"
	"testing"
)

// kvLike returns n bytes of bf16 values shaped like attention keys and
// values: per channel (head dimension 128) a scale drawn log-normally, so
// that a few channels carry outliers as real keys do, and normal values
// within a channel. bf16 is float32's top 16 bits, rounded to nearest even.
func kvLike(n int, seed uint64) []byte {
	rng := rand.New(rand.NewPCG(seed, 7))
	const dim = 128
	scale := make([]float64, dim)
	for i := range scale {
		scale[i] = math.Exp(rng.NormFloat64()*0.8) * 0.5
	}
	b := make([]byte, n&^1)
	for i := 0; i < len(b); i += 2 {
		v := float32(rng.NormFloat64() * scale[(i/2)%dim])
		u := math.Float32bits(v)
		u += 0x7fff + (u>>16)&1 // round to nearest even
		binary.LittleEndian.PutUint16(b[i:], uint16(u>>16))
	}
	return b
}

func TestRoundTrip(t *testing.T) {
	dec, err := NewDecoder()
	if err != nil {
		t.Fatal(err)
	}
	random := make([]byte, 1<<20)
	for i := range random {
		random[i] = byte(rand.Uint32())
	}
	for _, codec := range []Codec{CodecS2, CodecZstd, CodecHuff0} {
		enc, err := NewEncoder(codec)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range []struct {
			name  string
			data  []byte
			width int
		}{
			{"kv 64K", kvLike(64<<10, 1), 2}, {"kv 4M", kvLike(4<<20, 2), 2}, {"random", random, 2},
			{"zeros", make([]byte, 1<<20), 2}, {"odd", kvLike(1001, 3)[:999], 2}, {"bytes", kvLike(4096, 4), 1},
			{"empty", nil, 2}, {"one", []byte{9}, 1},
		} {
			block, err := enc.Encode(nil, c.data, c.width)
			if err != nil {
				t.Fatalf("%s %s: %v", codec, c.name, err)
			}
			got := make([]byte, len(c.data))
			if err := dec.Decode(got, block); err != nil || !bytes.Equal(got, c.data) {
				t.Fatalf("%s %s: decoded %v, equal %v", codec, c.name, err, bytes.Equal(got, c.data))
			}
			if chunks := 2 * ((len(c.data)/2 + ChunkSize - 1) / ChunkSize); c.name == "random" && len(block) > len(c.data)+headerLen+chunks*planeHdr {
				t.Fatalf("%s: random data grew to %d bytes (raw planes must cap it)", codec, len(block))
			}
			if c.name == "kv 4M" && codec != CodecS2 && len(block) >= len(c.data)*7/8 {
				t.Fatalf("%s: KV-like data did not shrink: %d of %d", codec, len(block), len(c.data))
			}
		}
	}
}

func TestDecodeRefusesWhatItWasNotAskedFor(t *testing.T) {
	dec, _ := NewDecoder()
	enc, _ := NewEncoder(CodecS2)
	data := kvLike(1<<20, 5)
	block, _ := enc.Encode(nil, data, 2)
	// The caller expects fewer (or more) bytes than the block declares.
	for _, n := range []int{len(data) - 2, len(data) + 2, 0} {
		if err := dec.Decode(make([]byte, n), block); !errors.Is(err, ErrMalformed) {
			t.Fatalf("decode into %d bytes of a %d-byte block: %v", n, len(data), err)
		}
	}
	// A block that declares the expected length but whose plane would
	// decode to more (a lying s2 header) is refused, not written past.
	small := make([]byte, 1024)
	lying, _ := enc.Encode(nil, small, 1)
	big, _ := enc.Encode(nil, make([]byte, 4096), 1)
	forged := append(lying[:headerLen:headerLen], big[headerLen:]...)
	if err := dec.Decode(make([]byte, 1024), forged); !errors.Is(err, ErrMalformed) {
		t.Fatalf("a plane decoding past its length: %v", err)
	}
	zenc, _ := NewEncoder(CodecZstd)
	zbig, _ := zenc.Encode(nil, make([]byte, 1<<20), 1)
	zforged := append(lying[:headerLen:headerLen], zbig[headerLen:]...)
	zforged[1] = byte(CodecZstd)
	dst := make([]byte, 1024, 1<<21) // room past the length must stay untouched
	guard := dst[:cap(dst)]
	for i := range guard[1024:] {
		guard[1024+i] = 0xAA
	}
	if err := dec.Decode(dst, zforged); !errors.Is(err, ErrMalformed) {
		t.Fatalf("a zstd plane decoding past its length: %v", err)
	}
	for i, b := range guard[1024:] {
		if b != 0xAA {
			t.Fatalf("byte %d past the block's length written", i)
		}
	}
	for _, bad := range [][]byte{nil, {1}, {2, 1, 1, 0, 0, 0, 0, 0}, {1, 9, 1, 0, 4, 0, 0, 0}, {1, 1, 3, 0, 0, 0, 0, 0}, {1, 1, 1, 1, 0, 0, 0, 0},
		{1, 1, 1, 0, 0xff, 0xff, 0xff, 0x7f}} {
		if _, err := RawLen(bad); err == nil {
			if err := dec.Decode(make([]byte, 4), bad); !errors.Is(err, ErrMalformed) {
				t.Fatalf("block %x: %v", bad, err)
			}
		}
	}
}

func FuzzDecode(f *testing.F) {
	for _, codec := range []Codec{CodecS2, CodecZstd, CodecHuff0} {
		enc, _ := NewEncoder(codec)
		for _, w := range []int{1, 2} {
			b, _ := enc.Encode(nil, kvLike(512, uint64(w)), w)
			f.Add(b, uint16(512))
		}
	}
	dec, _ := NewDecoder()
	f.Fuzz(func(t *testing.T, block []byte, want uint16) {
		dst := make([]byte, int(want), int(want)+64)
		tail := dst[len(dst):cap(dst)]
		for i := range tail {
			tail[i] = 0x5A
		}
		err := dec.Decode(dst, block)
		if err != nil && !errors.Is(err, ErrMalformed) {
			t.Fatalf("error %v is not ErrMalformed", err)
		}
		for i, b := range dst[len(dst):cap(dst)] {
			if b != 0x5A {
				t.Fatalf("byte %d past the expected length written", i)
			}
		}
	})
}

// BenchmarkCodecs reports each codec's encode and decode speed on one core
// and its ratio (encoded/raw) on KV-like bf16 data, against a plain copy of
// the same bytes measured in the same run.
func BenchmarkCodecs(b *testing.B) {
	for _, size := range []int{64 << 10, 4 << 20} {
		data := kvLike(size, 9)
		label := map[int]string{64 << 10: "64K", 4 << 20: "4M"}[size]
		b.Run("copy/"+label, func(b *testing.B) {
			dst := make([]byte, size)
			b.SetBytes(int64(size))
			for b.Loop() {
				copy(dst, data)
			}
		})
		for _, codec := range []Codec{CodecS2, CodecZstd, CodecHuff0} {
			for _, width := range []int{1, 2} {
				enc, _ := NewEncoder(codec)
				dec, _ := NewDecoder()
				block, _ := enc.Encode(nil, data, width)
				name := codec.String() + map[int]string{1: "/bytes/", 2: "/planes/"}[width] + label
				b.Run("encode/"+name, func(b *testing.B) {
					buf := make([]byte, 0, len(data)+1024)
					b.SetBytes(int64(size))
					for b.Loop() {
						buf, _ = enc.Encode(buf[:0], data, width)
					}
					b.ReportMetric(float64(len(block))/float64(size), "ratio")
				})
				b.Run("decode/"+name, func(b *testing.B) {
					out := make([]byte, size)
					b.SetBytes(int64(size))
					for b.Loop() {
						if err := dec.Decode(out, block); err != nil {
							b.Fatal(err)
						}
					}
				})
			}
		}
	}
}

func TestSplitJoin(t *testing.T) {
	for _, n := range []int{0, 2, 14, 16, 18, 30, 32, 1000, 4098} {
		src := kvLike(n, uint64(n))
		lo, hi := make([]byte, n/2), make([]byte, n/2)
		split(lo, hi, src)
		for i := range lo {
			if lo[i] != src[2*i] || hi[i] != src[2*i+1] {
				t.Fatalf("n %d: element %d split as %02x %02x, want %02x %02x", n, i, lo[i], hi[i], src[2*i], src[2*i+1])
			}
		}
		back := make([]byte, n)
		join(back, lo, hi)
		if !bytes.Equal(back, src) {
			t.Fatalf("n %d: join(split(x)) != x", n)
		}
	}
}
