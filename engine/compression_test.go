package engine_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
)

// fillKV fills b with bf16 values shaped like attention keys and values
// (normal within a channel, a log-normal scale per channel of 128).
func fillKV(b []byte, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 3))
	scale := make([]float64, 128)
	for i := range scale {
		scale[i] = math.Exp(rng.NormFloat64()*0.8) * 0.5
	}
	for i := 0; i+1 < len(b); i += 2 {
		u := math.Float32bits(float32(rng.NormFloat64() * scale[(i/2)%128]))
		u += 0x7fff + (u>>16)&1
		binary.LittleEndian.PutUint16(b[i:], uint16(u>>16))
	}
}

// Compressed WRITEs land intact, fewer bytes cross the wire, and data that
// does not shrink goes as plain WRITEs.
func TestCompressedWritesLandIntact(t *testing.T) {
	for _, codec := range []string{"huff0", "s2", "zstd"} {
		t.Run(codec, func(t *testing.T) {
			owner := newEngine(t)
			init := newEngineWith(t, engine.Options{Compression: codec})
			const size = 8 << 20
			dst := alloc(t, owner, size)
			src := alloc(t, init, size)
			fillKV(src, 1)
			seg := openSegment(t, init, owner.Name())
			transfer(t, init, 30*time.Second, write(src, seg, engine.AddrOf(dst), size))
			requireEqual(t, "compressed WRITE", dst, src)
			st, ost := init.Stats(), owner.Stats()
			t.Logf("%s: %d slices compressed, %d bytes as %d (%.3f); owner took %d compressed bytes",
				codec, st.CompressedSlices, st.CompressedRawOut, st.CompressedOut, float64(st.CompressedOut)/float64(max(st.CompressedRawOut, 1)), ost.CompressedIn)
			if codec == "huff0" && (st.CompressedSlices == 0 || st.CompressedOut >= st.CompressedRawOut || ost.CompressedIn != st.CompressedOut) {
				t.Fatalf("KV-like data not sent compressed: %+v", st)
			}
			// Random bytes do not shrink: they go plain, and land.
			before := init.Stats().CompressedSlices
			rng := rand.New(rand.NewPCG(5, 5))
			for i := 0; i+8 <= len(src); i += 8 {
				binary.LittleEndian.PutUint64(src[i:], rng.Uint64())
			}
			transfer(t, init, 30*time.Second, write(src, seg, engine.AddrOf(dst), size))
			requireEqual(t, "random data", dst, src)
			if n := init.Stats().CompressedSlices - before; n != 0 {
				t.Fatalf("%d slices of random data sent compressed", n)
			}
		})
	}
}

// An owner's Abort stops a compressed WRITE as it stops a plain one: with
// the protection on, the reused range keeps only its new content; with it
// off (UnsafeAbort), the same check finds the aborted request's bytes,
// showing that it can fail. Both ends compress (the constant source
// compresses to a few bytes a slice).
func TestAbortMidCompressedWriteFencesTheReusedRange(t *testing.T) {
	const delay = 250 * time.Millisecond
	size := 64 << 20
	for _, unsafe := range []bool{false, true} {
		name := map[bool]string{false: "protected", true: "unsafe"}[unsafe]
		t.Run(name, func(t *testing.T) {
			const rid = 19
			p := newAbortPair(t, engine.Options{Compression: "huff0", Testing: engine.Testing{UnsafeAbort: unsafe, ApplyDelay: delay}}, size)
			fillByte(p.src, oldByte)
			b := submit(t, p.init, withRID(write(p.src, p.seg, engine.AddrOf(p.dst), size), rid, 0))
			waitFor(t, 30*time.Second, "first frame applied", func() bool { return p.owner.Stats().OwnerBytesIn > 0 })
			p.requireSafeAbort(t, rid)
			fillByte(p.dst, reusedByte)
			r := waitBatch(t, b, 60*time.Second)[0]
			st := p.owner.Stats()
			old := bytes.Count(p.dst, []byte{oldByte})
			if p.init.Stats().CompressedSlices == 0 || st.CompressedIn == 0 {
				t.Fatalf("the WRITE was not sent compressed: %+v", p.init.Stats())
			}
			if r.Status != engine.Aborted || !errors.Is(r.Err, engine.ErrAborted) {
				t.Errorf("task %v (%v); want ABORTED", r.Status, r.Err)
			}
			if unsafe {
				if old == 0 {
					t.Errorf("with the protection off no byte of the aborted WRITE landed in the reused range: the protected run's check proves nothing")
				}
				return
			}
			requireAll(t, "reused range after a Safe abort", p.dst, reusedByte)
		})
	}
}

func TestCompressionOptionIsValidated(t *testing.T) {
	if _, err := engine.New(engine.Options{IgnoreEnv: true, Compression: "lz4"}); !errors.Is(err, engine.ErrInvalidArg) {
		t.Fatalf("Compression lz4: %v; want ErrInvalidArg", err)
	}
}
