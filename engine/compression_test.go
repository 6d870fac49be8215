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

// waitCompressedCounted waits until the sender has counted the compressed
// blocks the receiver took. A sender counts a block once its socket write
// returned, and the receiver can take the block and end the transfer
// before that; the receiver counts before the transfer can end. The wait
// fails only where the two counts never meet.
func waitCompressedCounted(t *testing.T, sender, receiver *engine.Engine) {
	t.Helper()
	waitFor(t, 10*time.Second, "the sender counted the compressed blocks the receiver took", func() bool {
		s, r := sender.Stats(), receiver.Stats()
		return s.CompressedOut == r.CompressedIn && s.CompressedRawOut == r.CompressedRawIn
	})
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
			waitCompressedCounted(t, init, owner)
			st, ost := init.Stats(), owner.Stats()
			t.Logf("%s: %d slices compressed, %d bytes as %d (%.3f); owner took %d compressed bytes",
				codec, st.CompressedSlices, st.CompressedRawOut, st.CompressedOut, float64(st.CompressedOut)/float64(max(st.CompressedRawOut, 1)), ost.CompressedIn)
			if codec == "huff0" && (st.CompressedSlices == 0 || st.CompressedOut >= st.CompressedRawOut || ost.CompressedIn != st.CompressedOut) {
				t.Fatalf("KV-like data not sent compressed: %+v", st)
			}
			if ost.CompressedRawIn != st.CompressedRawOut {
				t.Fatalf("the owner decoded %d bytes, the initiator sent %d compressed", ost.CompressedRawIn, st.CompressedRawOut)
			}
			// The metrics an operator scrapes say the same, on both sides.
			im, om := metricsOf(t, init), metricsOf(t, owner)
			im.require(t, float64(st.CompressedSlices), "kvferry_tcp_compressed_slices_total")
			im.require(t, float64(st.CompressedRawOut), "kvferry_tcp_compressed_bytes_total", "direction", "out", "form", "raw")
			im.require(t, float64(st.CompressedOut), "kvferry_tcp_compressed_bytes_total", "direction", "out", "form", "compressed")
			om.require(t, float64(st.CompressedRawOut), "kvferry_tcp_compressed_bytes_total", "direction", "in", "form", "raw")
			om.require(t, float64(st.CompressedOut), "kvferry_tcp_compressed_bytes_total", "direction", "in", "form", "compressed")
			om.require(t, 0, "kvferry_tcp_compressed_refused_total", "reason", "malformed")
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

// Compressed READ answers land intact: the owner compresses what it sends
// (its own setting decides), the initiator, with compression off, decodes;
// fewer bytes cross the wire, and data that does not shrink is answered
// plain.
func TestCompressedReadAnswersLandIntact(t *testing.T) {
	for _, codec := range []string{"huff0", "s2", "zstd"} {
		t.Run(codec, func(t *testing.T) {
			owner := newEngineWith(t, engine.Options{Compression: codec})
			init := newEngine(t)
			const size = 8 << 20
			src := alloc(t, owner, size)
			dst := alloc(t, init, size)
			fillKV(src, 2)
			seg := openSegment(t, init, owner.Name())
			transfer(t, init, 30*time.Second, read(dst, seg, engine.AddrOf(src), size))
			requireEqual(t, "compressed READ", dst, src)
			waitCompressedCounted(t, owner, init)
			ost, st := owner.Stats(), init.Stats()
			t.Logf("%s: owner sent %d slices compressed, %d bytes as %d (%.3f); initiator took %d compressed bytes",
				codec, ost.CompressedSlices, ost.CompressedRawOut, ost.CompressedOut, float64(ost.CompressedOut)/float64(max(ost.CompressedRawOut, 1)), st.CompressedIn)
			if st.CompressedSlices != 0 {
				t.Fatalf("the initiator, compression off, sent %d slices compressed", st.CompressedSlices)
			}
			if codec == "huff0" && (ost.CompressedSlices == 0 || ost.CompressedOut >= ost.CompressedRawOut || st.CompressedIn != ost.CompressedOut) {
				t.Fatalf("KV-like data not answered compressed: owner %+v", ost)
			}
			if st.CompressedRawIn != ost.CompressedRawOut {
				t.Fatalf("the initiator decoded %d bytes, the owner answered %d compressed", st.CompressedRawIn, ost.CompressedRawOut)
			}
			before := owner.Stats().CompressedSlices
			rng := rand.New(rand.NewPCG(6, 6))
			for i := 0; i+8 <= len(src); i += 8 {
				binary.LittleEndian.PutUint64(src[i:], rng.Uint64())
			}
			transfer(t, init, 30*time.Second, read(dst, seg, engine.AddrOf(src), size))
			requireEqual(t, "random data", dst, src)
			if n := owner.Stats().CompressedSlices - before; n != 0 {
				t.Fatalf("%d slices of random data answered compressed", n)
			}
		})
	}
}

// Promises 1 and 7 on compressed READ answers: an Abort or a Fence that
// returned Safe leaves no byte the owner puts in the range afterwards
// readable by a READ admitted before it. The owner snapshots a slice under
// its guard and sleeps ApplyDelay after admitting each; with the
// protection off (UnsafeAbort, UnsafeFence) the same check finds the new
// bytes at the initiator, showing that it can fail.
func TestAbortAndFenceStopCompressedReads(t *testing.T) {
	// Each 64 KiB slice waits 20 ms at the owner between its admission and
	// its snapshot: the unsafe rows' slices admitted before Abort or Fence
	// read the range after the test refilled it.
	const size = 4 << 20
	for _, how := range []string{"abort", "fence"} {
		for _, unsafe := range []bool{false, true} {
			name := how + map[bool]string{false: "/protected", true: "/unsafe"}[unsafe]
			t.Run(name, func(t *testing.T) {
				const rid = 23
				tst := engine.Testing{ApplyDelay: 20 * time.Millisecond}
				if how == "abort" {
					tst.UnsafeAbort = unsafe
				} else {
					tst.UnsafeFence = unsafe
				}
				owner := newEngineWith(t, engine.Options{Compression: "huff0", Testing: tst})
				// Unsafe, the owner trusts the initiator's ACK, which an
				// unsafe initiator sends when it hears the ABORT.
				init := newEngineWith(t, engine.Options{SliceSize: 64 << 10, Testing: engine.Testing{UnsafeAbort: tst.UnsafeAbort}})
				src, dst := alloc(t, owner, size), alloc(t, init, size)
				fillByte(src, oldByte)
				fillByte(dst, 0)
				seg := openSegment(t, init, owner.Name())
				b := submit(t, init, withRID(read(dst, seg, engine.AddrOf(src), size), rid, 0))
				waitFor(t, 10*time.Second, "first bytes read", func() bool { return owner.Stats().CompressedSlices > 0 })
				if how == "abort" {
					res, err := owner.Abort(testCtx(t, 10*time.Second), rid, []string{init.Name()})
					if err != nil || !res.Safe {
						t.Fatalf("abort = %+v, %v", res, err)
					}
				} else {
					requireSafeFence(t, owner, src)
				}
				fillByte(src, reusedByte)
				r := waitBatch(t, b, 60*time.Second)[0]
				leaked := bytes.Count(dst, []byte{reusedByte})
				t.Logf("task %v after %d bytes (%v); %d bytes written after Safe reached the reader", r.Status, r.Transferred, r.Err, leaked)
				if unsafe {
					if leaked == 0 {
						t.Fatal("with the protection off no byte written after Safe reached the reader: the protected row proves nothing")
					}
					return
				}
				if leaked != 0 {
					t.Fatalf("a compressed READ admitted before %s read %d bytes written after it returned Safe", how, leaked)
				}
				if r.Status == engine.Completed {
					t.Errorf("the READ completed although %s struck in its middle", how)
				}
			})
		}
	}
}

func TestCompressionOptionIsValidated(t *testing.T) {
	if _, err := engine.New(engine.Options{IgnoreEnv: true, Compression: "lz4"}); !errors.Is(err, engine.ErrInvalidArg) {
		t.Fatalf("Compression lz4: %v; want ErrInvalidArg", err)
	}
}
