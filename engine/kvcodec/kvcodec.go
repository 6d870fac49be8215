// Package kvcodec compresses KV-cache data for slow links. KV caches are
// arrays of 2-byte floats (bf16, fp16): split into byte planes, the high
// bytes (sign and exponent, and bf16's top mantissa bits) repeat a few
// values and compress well, the low bytes are close to noise. Each plane is
// compressed on its own and kept raw when compressing it does not pay, so
// noise costs one failed attempt rather than an expansion.
//
// An encoded block:
//
//	0  u8  version  1
//	1  u8  codec    CodecS2 or CodecZstd
//	2  u8  planes   1 (bytes as they are) or 2 (2-byte elements split)
//	3  u8  reserved 0
//	4  u32 raw      the block's decoded length
//	then each plane (the high bytes first), cut into chunks of ChunkSize
//	(the last one shorter), each:
//	   u8  stored   0 raw, 1 compressed, 2 one byte repeated (RLE)
//	   u32 length   bytes that follow
//	   ... bytes
//
// Decode never produces more than the length its caller expects, whatever
// the block claims: a peer cannot make the decoder allocate or write more
// than the frame it announced.
package kvcodec

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"

	"github.com/klauspost/compress/huff0"
	"github.com/klauspost/compress/s2"
	"github.com/klauspost/compress/zstd"
)

// Codec names a compressor.
type Codec uint8

// The codecs. Huff0 is zstd's entropy coder alone (klauspost/compress/huff0,
// 4 streams): float planes have no repeated strings for an LZ stage to
// find, only a skewed byte distribution, which it codes at close to its
// entropy at about a GB/s of input per core. S2 (LZ only, no entropy
// coding) and zstd (LZ then entropy coding, fastest level) are there for
// data with repeats; on KV-like bf16 data S2 barely shrinks the high plane
// and zstd does less than Huff0 at a third of its speed (figures in the
// package's benchmark).
const (
	CodecS2    Codec = 1
	CodecZstd  Codec = 2
	CodecHuff0 Codec = 3
)

func (c Codec) String() string {
	switch c {
	case CodecS2:
		return "s2"
	case CodecZstd:
		return "zstd"
	case CodecHuff0:
		return "huff0"
	}
	return fmt.Sprintf("codec(%d)", uint8(c))
}

// ParseCodec reads "s2", "zstd" or "huff0".
func ParseCodec(s string) (Codec, error) {
	switch s {
	case "s2":
		return CodecS2, nil
	case "zstd":
		return CodecZstd, nil
	case "huff0":
		return CodecHuff0, nil
	}
	return 0, fmt.Errorf("codec %q: want s2, zstd or huff0", s)
}

// ErrMalformed says a block is not one Encode wrote, or does not decode to
// the length expected.
var ErrMalformed = errors.New("malformed compressed block")

const (
	version    = 1
	headerLen  = 8
	planeHdr   = 5
	storedRaw  = 0
	storedComp = 1
	storedRLE  = 2
	// A plane is kept compressed only when it shrinks to at most 7/8:
	// below that, the decoder's time costs more than the bytes saved.
	keepNum, keepDen = 7, 8
)

// MaxBlock is the largest block encoded or decoded (a slice).
const MaxBlock = 64 << 20

// ChunkSize is the most a chunk of a plane holds: Huff0's block limit is
// 256 KiB, and a smaller chunk adapts its table to the data it holds.
const ChunkSize = 128 << 10

// Encoder compresses blocks; it is safe for concurrent use.
type Encoder struct {
	codec Codec
	zenc  *zstd.Encoder
}

// NewEncoder returns an encoder for codec.
func NewEncoder(codec Codec) (*Encoder, error) {
	e := &Encoder{codec: codec}
	switch codec {
	case CodecS2, CodecHuff0:
	case CodecZstd:
		z, err := zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedFastest), zstd.WithEncoderConcurrency(1),
			zstd.WithLowerEncoderMem(true))
		if err != nil {
			return nil, err
		}
		e.zenc = z
	default:
		return nil, fmt.Errorf("kvcodec: unknown codec %d", codec)
	}
	return e, nil
}

// Codec is the encoder's codec.
func (e *Encoder) Codec() Codec { return e.codec }

var (
	planePool = sync.Pool{New: func() any { return new([]byte) }}
	huffPool  = sync.Pool{New: func() any { return new(huff0.Scratch) }}
)

// Encode appends src's block to dst. width is the element size: 2 splits
// 2-byte elements into planes (src's length must be even), 1 keeps bytes
// as they are.
func (e *Encoder) Encode(dst, src []byte, width int) ([]byte, error) {
	if len(src) > MaxBlock {
		return dst, fmt.Errorf("kvcodec: block of %d bytes, more than %d", len(src), MaxBlock)
	}
	planes := 1
	if width == 2 && len(src)%2 == 0 && len(src) > 0 {
		planes = 2
	}
	var h [headerLen]byte
	h[0], h[1], h[2] = version, byte(e.codec), byte(planes)
	binary.LittleEndian.PutUint32(h[4:], uint32(len(src)))
	dst = append(dst, h[:]...)
	if planes == 1 {
		return e.plane(dst, src), nil
	}
	bp := planePool.Get().(*[]byte)
	defer planePool.Put(bp)
	n := len(src) / 2
	if cap(*bp) < len(src) {
		*bp = make([]byte, len(src))
	}
	buf := (*bp)[:len(src)]
	lo, hi := buf[:n], buf[n:]
	split(lo, hi, src)
	dst = e.plane(dst, hi) // the plane that pays first: a reader sees it first
	return e.plane(dst, lo), nil
}

// plane appends one plane, chunk by chunk.
func (e *Encoder) plane(dst, p []byte) []byte {
	for off := 0; off < len(p) || off == 0; off += ChunkSize {
		dst = e.chunk(dst, p[off:min(off+ChunkSize, len(p))])
		if len(p) == 0 {
			break
		}
	}
	return dst
}

// chunk appends one chunk, compressed when that pays.
func (e *Encoder) chunk(dst, p []byte) []byte {
	if len(p) == 0 {
		return append(dst, storedRaw, 0, 0, 0, 0)
	}
	at := len(dst)
	dst = append(dst, storedComp, 0, 0, 0, 0)
	start := len(dst)
	switch e.codec {
	case CodecS2:
		need := s2.MaxEncodedLen(len(p))
		if cap(dst)-len(dst) < need {
			dst = append(dst[:len(dst):len(dst)], make([]byte, need)...)[:start]
		}
		enc := s2.Encode(dst[start:start+need], p)
		dst = dst[:start+len(enc)]
	case CodecZstd:
		dst = e.zenc.EncodeAll(p, dst)
	case CodecHuff0:
		sc := huffPool.Get().(*huff0.Scratch)
		// Every chunk carries its table: a decoder sees chunks of
		// many senders, never this scratch's last table.
		sc.Reuse = huff0.ReusePolicyNone
		out, _, err := huff0.Compress4X(p, sc)
		switch {
		case err == nil:
			dst = append(dst, out...)
		case errors.Is(err, huff0.ErrUseRLE):
			dst = append(dst[:at], storedRLE, 1, 0, 0, 0, p[0])
			huffPool.Put(sc)
			return dst
		default: // incompressible, or too small to pay: raw below
			dst = append(dst, p...)
		}
		huffPool.Put(sc)
	}
	if n := len(dst) - start; n*keepDen <= len(p)*keepNum {
		binary.LittleEndian.PutUint32(dst[at+1:], uint32(n))
		return dst
	}
	dst = append(dst[:start], p...)
	dst[at] = storedRaw
	binary.LittleEndian.PutUint32(dst[at+1:], uint32(len(p)))
	return dst
}

// split writes the low and high bytes of src's 2-byte little-endian
// elements into lo and hi, eight elements a step.
func split(lo, hi, src []byte) {
	i := 0
	for ; i+8 <= len(lo); i += 8 {
		a := binary.LittleEndian.Uint64(src[2*i:])
		b := binary.LittleEndian.Uint64(src[2*i+8:])
		binary.LittleEndian.PutUint64(lo[i:], pack4(a)|pack4(b)<<32)
		binary.LittleEndian.PutUint64(hi[i:], pack4(a>>8)|pack4(b>>8)<<32)
	}
	for ; i < len(lo); i++ {
		lo[i] = src[2*i]
		hi[i] = src[2*i+1]
	}
}

// pack4 gathers the bytes at bits 0, 16, 32 and 48 of x into its low 32
// bits.
func pack4(x uint64) uint64 {
	return x&0xff | x>>8&0xff00 | x>>16&0xff0000 | x>>24&0xff000000
}

// spread4 is pack4's inverse: x's four low bytes to bits 0, 16, 32, 48.
func spread4(x uint64) uint64 {
	return x&0xff | (x&0xff00)<<8 | (x&0xff0000)<<16 | (x&0xff000000)<<24
}

// join is split's inverse.
func join(dst, lo, hi []byte) {
	i := 0
	for ; i+8 <= len(lo); i += 8 {
		l := binary.LittleEndian.Uint64(lo[i:])
		h := binary.LittleEndian.Uint64(hi[i:])
		binary.LittleEndian.PutUint64(dst[2*i:], spread4(l)|spread4(h)<<8)
		binary.LittleEndian.PutUint64(dst[2*i+8:], spread4(l>>32)|spread4(h>>32)<<8)
	}
	for ; i < len(lo); i++ {
		dst[2*i] = lo[i]
		dst[2*i+1] = hi[i]
	}
}

// Decoder decompresses blocks; it is safe for concurrent use.
type Decoder struct {
	zdec *zstd.Decoder
}

// NewDecoder returns a decoder for both codecs. Its zstd decoder's window
// is capped at MaxBlock.
func NewDecoder() (*Decoder, error) {
	z, err := zstd.NewReader(nil, zstd.WithDecoderConcurrency(0), zstd.WithDecoderMaxMemory(MaxBlock),
		zstd.WithDecoderMaxWindow(MaxBlock), zstd.WithDecodeAllCapLimit(true))
	if err != nil {
		return nil, err
	}
	return &Decoder{zdec: z}, nil
}

// RawLen returns the decoded length a block declares.
func RawLen(block []byte) (int, error) {
	if len(block) < headerLen || block[0] != version || block[3] != 0 {
		return 0, fmt.Errorf("%w: header", ErrMalformed)
	}
	n := int(binary.LittleEndian.Uint32(block[4:]))
	if n > MaxBlock {
		return 0, fmt.Errorf("%w: declares %d bytes, more than %d", ErrMalformed, n, MaxBlock)
	}
	return n, nil
}

// Decode decodes block into dst, which must be exactly the block's decoded
// length (the caller knows it from its frame and checks it against what it
// may write first).
func (d *Decoder) Decode(dst, block []byte) error {
	n, err := RawLen(block)
	if err != nil {
		return err
	}
	if n != len(dst) {
		return fmt.Errorf("%w: declares %d bytes, %d expected", ErrMalformed, n, len(dst))
	}
	codec, planes := Codec(block[1]), int(block[2])
	if codec != CodecS2 && codec != CodecZstd && codec != CodecHuff0 {
		return fmt.Errorf("%w: codec %d", ErrMalformed, block[1])
	}
	rest := block[headerLen:]
	switch planes {
	case 1:
		rest, err = d.plane(dst, rest, codec)
	case 2:
		if n%2 != 0 {
			return fmt.Errorf("%w: 2 planes of an odd length %d", ErrMalformed, n)
		}
		rest, err = d.planes(dst, rest, codec)
	default:
		return fmt.Errorf("%w: %d planes", ErrMalformed, planes)
	}
	if err != nil {
		return err
	}
	if len(rest) != 0 {
		return fmt.Errorf("%w: %d bytes after the last plane", ErrMalformed, len(rest))
	}
	return nil
}

// planes decodes a 2-plane block's body into dst a chunk pair at a time:
// the high plane's chunk i and the low plane's chunk i go into two
// ChunkSize scratch buffers and are joined into dst, so decoding holds no
// more than dst and 256 KiB.
func (d *Decoder) planes(dst, src []byte, codec Codec) ([]byte, error) {
	half := len(dst) / 2
	chunks := max(1, (half+ChunkSize-1)/ChunkSize)
	// The low plane's chunks follow the high plane's: find where.
	lo := src
	for range chunks {
		if len(lo) < planeHdr {
			return nil, fmt.Errorf("%w: chunk header", ErrMalformed)
		}
		k := int(binary.LittleEndian.Uint32(lo[1:]))
		if k > len(lo)-planeHdr {
			return nil, fmt.Errorf("%w: chunk of %d bytes, %d left", ErrMalformed, k, len(lo)-planeHdr)
		}
		lo = lo[planeHdr+k:]
	}
	hi := src[:len(src)-len(lo)]
	sp := planePool.Get().(*[]byte)
	defer planePool.Put(sp)
	if cap(*sp) < 2*ChunkSize {
		*sp = make([]byte, 2*ChunkSize)
	}
	hs, ls := (*sp)[:ChunkSize], (*sp)[ChunkSize:2*ChunkSize]
	var err error
	for off := 0; off < half || off == 0; off += ChunkSize {
		m := min(ChunkSize, half-off)
		if hi, err = d.chunk(hs[:m], hi, codec); err != nil {
			return nil, err
		}
		if lo, err = d.chunk(ls[:m], lo, codec); err != nil {
			return nil, err
		}
		join(dst[2*off:2*(off+m)], ls[:m], hs[:m])
		if half == 0 {
			break
		}
	}
	if len(hi) != 0 {
		return nil, fmt.Errorf("%w: high plane longer than its chunks", ErrMalformed)
	}
	return lo, nil
}

// plane decodes one plane into p (its exact length), chunk by chunk, and
// returns what follows it.
func (d *Decoder) plane(p, src []byte, codec Codec) ([]byte, error) {
	var err error
	for off := 0; off < len(p) || off == 0; off += ChunkSize {
		if src, err = d.chunk(p[off:min(off+ChunkSize, len(p))], src, codec); err != nil {
			return nil, err
		}
		if len(p) == 0 {
			break
		}
	}
	return src, nil
}

// chunk decodes one chunk into p (its exact length) and returns what
// follows it.
func (d *Decoder) chunk(p, src []byte, codec Codec) ([]byte, error) {
	if len(src) < planeHdr {
		return nil, fmt.Errorf("%w: chunk header", ErrMalformed)
	}
	stored, n := src[0], int(binary.LittleEndian.Uint32(src[1:]))
	src = src[planeHdr:]
	if n > len(src) {
		return nil, fmt.Errorf("%w: chunk of %d bytes, %d left", ErrMalformed, n, len(src))
	}
	body, rest := src[:n], src[n:]
	switch stored {
	case storedRaw:
		if n != len(p) {
			return nil, fmt.Errorf("%w: raw chunk of %d bytes, %d expected", ErrMalformed, n, len(p))
		}
		copy(p, body)
	case storedRLE:
		if n != 1 || len(p) == 0 {
			return nil, fmt.Errorf("%w: repeated-byte chunk of %d bytes", ErrMalformed, n)
		}
		for i := range p {
			p[i] = body[0]
		}
	case storedComp:
		switch codec {
		case CodecS2:
			m, err := s2.DecodedLen(body)
			if err != nil || m != len(p) {
				return nil, fmt.Errorf("%w: s2 chunk decodes to %d bytes, %d expected (%v)", ErrMalformed, m, len(p), err)
			}
			if _, err := s2.Decode(p, body); err != nil {
				return nil, fmt.Errorf("%w: s2: %w", ErrMalformed, err)
			}
		case CodecZstd:
			// DecodeAll appends to p[:0] within p's capacity (the
			// cap limit): it cannot grow past the chunk.
			out, err := d.zdec.DecodeAll(body, p[:0:len(p)])
			if err != nil || len(out) != len(p) {
				return nil, fmt.Errorf("%w: zstd chunk decodes to %d bytes, %d expected (%v)", ErrMalformed, len(out), len(p), err)
			}
			if len(p) > 0 && &out[0] != &p[0] {
				copy(p, out) // not expected with the cap limit; never trust it
			}
		case CodecHuff0:
			sc := huffPool.Get().(*huff0.Scratch)
			defer huffPool.Put(sc)
			sc.MaxDecodedSize = len(p)
			s, rem, err := huff0.ReadTable(body, sc)
			if err != nil {
				return nil, fmt.Errorf("%w: huff0 table: %w", ErrMalformed, err)
			}
			// The destination's capacity is the chunk: the decoder
			// writes no more, and says so when the stream wants to.
			out, err := s.Decoder().Decompress4X(p[:0:len(p)], rem)
			if err != nil || len(out) != len(p) {
				return nil, fmt.Errorf("%w: huff0 chunk decodes to %d bytes, %d expected (%v)", ErrMalformed, len(out), len(p), err)
			}
			if len(p) > 0 && &out[0] != &p[0] {
				copy(p, out)
			}
		}
	default:
		return nil, fmt.Errorf("%w: chunk stored as %d", ErrMalformed, stored)
	}
	return rest, nil
}
