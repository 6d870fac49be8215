package control_test

// Fuzz targets for the control plane's parsers. Each target must be fuzzed on
// its own, e.g.
//
//	go test ./engine/control -run='^$' -fuzz='^FuzzDecodeEnvelope$'   -fuzztime=10s
//	go test ./engine/control -run='^$' -fuzz='^FuzzDecodeDescriptor$' -fuzztime=10s
//	go test ./engine/control -run='^$' -fuzz='^FuzzUnpackBody$'       -fuzztime=10s
//
// A plain `go test` runs the f.Add seeds and the committed corpus under
// testdata/fuzz/FuzzXxx/. To regenerate the committed seed files from the
// seed functions below:
//
//	KVFERRY_WRITE_SEED_CORPUS=1 go test ./engine/control -run='^TestWriteSeedCorpus$'

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/klauspost/compress/zstd"

	"github.com/kvferry/kvferry/engine/control"
)

// envelope builds a raw envelope frame field by field, so seeds can carry
// values EncodeEnvelope would never produce.
func envelope(magic uint16, version, typ, flags, status uint8, reserved uint16, corr uint64) []byte {
	b := make([]byte, control.EnvelopeSize)
	binary.LittleEndian.PutUint16(b[0:], magic)
	b[2] = version
	b[3] = typ
	b[4] = flags
	b[5] = status
	binary.LittleEndian.PutUint16(b[6:], reserved)
	binary.LittleEndian.PutUint64(b[8:], corr)
	return b
}

const envMagic = 0x434b // "KC"

type namedSeed struct {
	name string
	data []byte
}

func envelopeSeeds() []namedSeed {
	ping := control.EncodeEnvelope(control.Envelope{Type: control.MsgPing, Corr: 1})
	return []namedSeed{
		{"valid_ping", ping},
		{"valid_descriptor_zstd", control.EncodeEnvelope(control.Envelope{Type: control.MsgDescriptor, Flags: control.FlagZstd, Corr: 1<<64 - 1})},
		{"valid_error", control.EncodeEnvelope(control.Envelope{Type: control.MsgError, Corr: 42})},
		{"status_and_reserved_set", envelope(envMagic, control.ProtocolVersion, uint8(control.MsgPong), 0, 7, 0xffff, 9)},
		{"empty", nil},
		{"truncated", ping[:control.EnvelopeSize-1]},
		{"one_byte_long", append(append([]byte(nil), ping...), 0)},
		{"bad_magic", envelope(0x4b43, control.ProtocolVersion, uint8(control.MsgPing), 0, 0, 0, 1)},
		{"bad_version_0", envelope(envMagic, 0, uint8(control.MsgPing), 0, 0, 0, 1)},
		{"bad_version_2", envelope(envMagic, 2, uint8(control.MsgPing), 0, 0, 0, 1)},
		{"type_0", envelope(envMagic, control.ProtocolVersion, 0, 0, 0, 0, 1)},
		{"type_6", envelope(envMagic, control.ProtocolVersion, 6, 0, 0, 0, 1)},
		{"type_255", envelope(envMagic, control.ProtocolVersion, 255, 0, 0, 0, 1)},
		{"flags_2", envelope(envMagic, control.ProtocolVersion, uint8(control.MsgPing), 2, 0, 0, 1)},
		{"flags_ff", envelope(envMagic, control.ProtocolVersion, uint8(control.MsgPing), 0xff, 0, 0, 1)},
	}
}

func FuzzDecodeEnvelope(f *testing.F) {
	fuzzDecoder(f, envelopeSeeds(), control.DecodeEnvelope, func(t *testing.T, b []byte, e control.Envelope) {
		if len(b) != control.EnvelopeSize {
			t.Fatalf("accepted an envelope of %d bytes", len(b))
		}
		if e.Type == 0 || e.Flags&^control.FlagZstd != 0 {
			t.Fatalf("accepted invalid envelope %+v", e)
		}
		enc := control.EncodeEnvelope(e)
		if len(enc) != control.EnvelopeSize {
			t.Fatalf("encoded envelope of %d bytes", len(enc))
		}
		e2, err := control.DecodeEnvelope(enc)
		if err != nil {
			t.Fatalf("re-decode of %+v: %v", e, err)
		}
		if e2 != e {
			t.Fatalf("round trip: %+v -> %+v", e, e2)
		}
		// Every field the envelope carries must come back byte for byte;
		// bytes 5..7 (status, reserved) are not part of Envelope.
		if !bytes.Equal(enc[:5], b[:5]) || !bytes.Equal(enc[8:], b[8:]) {
			t.Fatalf("re-encoding changed fields: %x -> %x", b, enc)
		}
	})
}

// sampleDescriptor is a valid descriptor with every kind of field set.
func sampleDescriptor() *control.Descriptor {
	return &control.Descriptor{
		Name:    "127.0.0.1:40000",
		Version: control.ProtocolVersion,
		Epoch:   7,
		Transports: []control.TransportAddr{
			{Name: "tcp", Addr: "127.0.0.1:40001"},
			{Name: "rdma", Addr: "mlx5_0:1"},
		},
		Buffers: []control.Buffer{
			{Addr: 0x1000, Len: 0x1000, Key: 1, Location: "cpu"},
			{Addr: 0x2000, Len: 0x800, Key: 2, Location: "cuda:0"},
			{Addr: 1<<64 - 0x1001, Len: 0x1000, Key: 1<<64 - 1, Location: ""},
		},
	}
}

// rawDescriptor encodes buffers without any of Encode's care, so seeds can
// hold overlapping, empty or wrapping buffers.
func rawDescriptor(magic, version uint16, name string, nTransports uint8, nBuffers uint32, bufs []control.Buffer) []byte {
	var b []byte
	b = binary.LittleEndian.AppendUint16(b, magic)
	b = binary.LittleEndian.AppendUint16(b, version)
	b = binary.LittleEndian.AppendUint64(b, 1)
	b = append(b, uint8(len(name)))
	b = append(b, name...)
	b = append(b, nTransports)
	for i := 0; i < int(nTransports); i++ {
		b = append(b, 3, 't', 'c', 'p', 0)
	}
	b = binary.LittleEndian.AppendUint32(b, nBuffers)
	for _, x := range bufs {
		b = binary.LittleEndian.AppendUint64(b, x.Addr)
		b = binary.LittleEndian.AppendUint64(b, x.Len)
		b = binary.LittleEndian.AppendUint64(b, x.Key)
		b = append(b, uint8(len(x.Location)))
		b = append(b, x.Location...)
	}
	return b
}

func descriptorSeeds() []namedSeed {
	valid := sampleDescriptor().Encode()
	empty := (&control.Descriptor{Name: "h:1", Version: control.ProtocolVersion}).Encode()
	one := []control.Buffer{{Addr: 0x1000, Len: 0x10, Key: 1, Location: "cpu"}}
	return []namedSeed{
		{"valid", valid},
		{"valid_empty", empty},
		{"valid_raw_one_buffer", rawDescriptor(0x4453, control.ProtocolVersion, "n", 1, 1, one)},
		{"empty_input", nil},
		{"truncated_header", valid[:5]},
		{"truncated_buffer", valid[:len(valid)-3]},
		{"trailing_byte", append(append([]byte(nil), valid...), 0)},
		{"bad_magic", rawDescriptor(0x5344, control.ProtocolVersion, "n", 0, 1, one)},
		{"bad_version", rawDescriptor(0x4453, 2, "n", 0, 1, one)},
		{"too_many_transports", rawDescriptor(0x4453, control.ProtocolVersion, "n", 17, 0, nil)},
		{"count_too_big", rawDescriptor(0x4453, control.ProtocolVersion, "n", 0, 1<<32-1, one)},
		{"count_past_bytes", rawDescriptor(0x4453, control.ProtocolVersion, "n", 0, 2, one)},
		{"empty_buffer", rawDescriptor(0x4453, control.ProtocolVersion, "n", 0, 1, []control.Buffer{{Addr: 0x1000}})},
		{"wrapping_buffer", rawDescriptor(0x4453, control.ProtocolVersion, "n", 0, 1, []control.Buffer{{Addr: 1<<64 - 0x10, Len: 0x20}})},
		{"buffer_ending_at_2_64", rawDescriptor(0x4453, control.ProtocolVersion, "n", 0, 1, []control.Buffer{{Addr: 1<<64 - 0x10, Len: 0x10}})},
		{"overlapping", rawDescriptor(0x4453, control.ProtocolVersion, "n", 0, 2, []control.Buffer{{Addr: 0x1000, Len: 0x100}, {Addr: 0x10ff, Len: 1}})},
		{"out_of_order", rawDescriptor(0x4453, control.ProtocolVersion, "n", 0, 2, []control.Buffer{{Addr: 0x2000, Len: 0x100}, {Addr: 0x1000, Len: 1}})},
		{"adjacent", rawDescriptor(0x4453, control.ProtocolVersion, "n", 0, 2, []control.Buffer{{Addr: 0x1000, Len: 0x100}, {Addr: 0x1100, Len: 1}})},
	}
}

func FuzzDecodeDescriptor(f *testing.F) {
	// A refusal comes without a descriptor.
	decode := func(b []byte) (*control.Descriptor, error) {
		d, err := control.DecodeDescriptor(b)
		if err != nil && d != nil {
			return nil, fmt.Errorf("error %v with a non-nil descriptor", err)
		}
		return d, err
	}
	fuzzDecoder(f, descriptorSeeds(), decode, func(t *testing.T, b []byte, d *control.Descriptor) {
		checkDescriptorInvariants(t, d)
		enc := d.Encode()
		d2, err := control.DecodeDescriptor(enc)
		if err != nil {
			t.Fatalf("re-decode of an accepted descriptor failed: %v\ninput %x\nre-encoded %x", err, b, enc)
		}
		if !reflect.DeepEqual(d, d2) {
			t.Fatalf("round trip changed the descriptor:\n%+v\n%+v", d, d2)
		}
		// The format has exactly one encoding per descriptor.
		if !bytes.Equal(enc, b) {
			t.Fatalf("accepted a non-canonical encoding:\ninput      %x\nre-encoded %x", b, enc)
		}
	})
}

// checkDescriptorInvariants checks what DecodeDescriptor promises about an
// accepted descriptor, and that Find locates each buffer by its edges.
func checkDescriptorInvariants(t *testing.T, d *control.Descriptor) {
	t.Helper()
	if d.Version != control.ProtocolVersion {
		t.Fatalf("accepted version %d", d.Version)
	}
	if len(d.Transports) > 16 {
		t.Fatalf("accepted %d transports", len(d.Transports))
	}
	for i, x := range d.Buffers {
		if x.Len == 0 || x.Addr+x.Len < x.Addr {
			t.Fatalf("buffer %d %+v is empty or wraps", i, x)
		}
		if i > 0 && x.Addr < d.Buffers[i-1].Addr+d.Buffers[i-1].Len {
			t.Fatalf("buffer %d %+v overlaps or precedes %+v", i, x, d.Buffers[i-1])
		}
	}
	for i, x := range d.Buffers {
		if i == 64 {
			break // enough for a fuzz iteration
		}
		for _, q := range [][2]uint64{{x.Addr, 1}, {x.Addr + x.Len - 1, 1}, {x.Addr, x.Len}} {
			got, ok := d.Find(q[0], q[1])
			if !ok || got != x {
				t.Fatalf("Find(%#x, %d) = %+v, %v; want buffer %d %+v", q[0], q[1], got, ok, i, x)
			}
		}
		if _, ok := d.Find(x.Addr, x.Len+1); ok && x.Len+1 != 0 {
			t.Fatalf("Find(%#x, %d) past the end of buffer %d %+v succeeded", x.Addr, x.Len+1, i, x)
		}
	}
}

// zstdFrame compresses b as one frame that declares its content size.
func zstdFrame(tb testing.TB, b []byte) []byte {
	tb.Helper()
	enc, err := zstd.NewWriter(nil)
	if err != nil {
		tb.Fatal(err)
	}
	defer enc.Close()
	return enc.EncodeAll(b, nil)
}

// zstdStream compresses n zero bytes as a streamed frame, which does not
// declare its content size, so only decoding shows how big it is.
func zstdStream(tb testing.TB, n int) []byte {
	tb.Helper()
	var out bytes.Buffer
	enc, err := zstd.NewWriter(&out, zstd.WithEncoderLevel(zstd.SpeedBestCompression))
	if err != nil {
		tb.Fatal(err)
	}
	zero := make([]byte, 1<<20)
	for n > 0 {
		k := min(n, len(zero))
		if _, err := enc.Write(zero[:k]); err != nil {
			tb.Fatal(err)
		}
		n -= k
	}
	if err := enc.Close(); err != nil {
		tb.Fatal(err)
	}
	return out.Bytes()
}

type bodySeed struct {
	name  string
	body  []byte
	flags uint8
}

func bodySeeds(tb testing.TB) []bodySeed {
	text := bytes.Repeat([]byte("kvferry control body "), 100)
	z := zstdFrame(tb, text)
	// A frame header claiming a content size one past MaxBody, then nothing.
	fcsLie := []byte{0x28, 0xb5, 0x2f, 0xfd, 0xa0}
	fcsLie = binary.LittleEndian.AppendUint32(fcsLie, control.MaxBody+1)
	half := zstdFrame(tb, make([]byte, control.MaxBody/2+1))
	return []bodySeed{
		{"plain", text, 0},
		{"plain_empty", nil, 0},
		{"zstd_valid", z, control.FlagZstd},
		{"zstd_empty_frame", zstdFrame(tb, nil), control.FlagZstd},
		{"zstd_truncated", z[:len(z)/2], control.FlagZstd},
		{"zstd_garbage", []byte("this is not zstd at all"), control.FlagZstd},
		{"zstd_magic_only", []byte{0x28, 0xb5, 0x2f, 0xfd}, control.FlagZstd},
		{"zstd_content_size_lie", fcsLie, control.FlagZstd},
		{"zstd_bomb_declared_20MiB", zstdFrame(tb, make([]byte, 20<<20)), control.FlagZstd},
		{"zstd_bomb_streamed_20MiB", zstdStream(tb, 20<<20), control.FlagZstd},
		{"zstd_bomb_two_frames", append(append([]byte(nil), half...), half...), control.FlagZstd},
		{"zstd_flag_with_other_bits", z, 0xff},
	}
}

func FuzzUnpackBody(f *testing.F) {
	for _, s := range bodySeeds(f) {
		f.Add(s.body, s.flags)
	}
	f.Fuzz(func(t *testing.T, body []byte, flags uint8) {
		out, err := control.UnpackBody(body, flags)
		if err != nil {
			if out != nil {
				t.Fatalf("error %v with %d bytes of output", err, len(out))
			}
			if !errors.Is(err, control.ErrMalformed) {
				t.Fatalf("error %v does not wrap ErrMalformed", err)
			}
			return
		}
		if len(out) > control.MaxBody {
			t.Fatalf("UnpackBody returned %d bytes, more than MaxBody", len(out))
		}
		if flags&control.FlagZstd == 0 && !bytes.Equal(out, body) {
			t.Fatalf("uncompressed body changed")
		}
		// Whatever came out packs and unpacks to itself.
		packed, pf := control.PackBody(out)
		back, err := control.UnpackBody(packed, pf)
		if err != nil || !bytes.Equal(back, out) {
			t.Fatalf("PackBody/UnpackBody of %d bytes: err %v, equal %v", len(out), err, bytes.Equal(back, out))
		}
	})
}

// TestUnpackBodySeeds states the expected verdict of each body seed, so a
// change in what UnpackBody accepts shows up by name, not only as a panic.
func TestUnpackBodySeeds(t *testing.T) {
	accept := map[string]bool{"plain": true, "plain_empty": true, "zstd_valid": true,
		"zstd_empty_frame": true, "zstd_flag_with_other_bits": true}
	for _, s := range bodySeeds(t) {
		out, err := control.UnpackBody(s.body, s.flags)
		if accept[s.name] != (err == nil) {
			t.Errorf("%s (%d bytes): err %v, want accepted=%v", s.name, len(s.body), err, accept[s.name])
		}
		if err == nil && len(out) > control.MaxBody {
			t.Errorf("%s: %d bytes out", s.name, len(out))
		}
		if s.name[:min(len(s.name), 9)] == "zstd_bomb" {
			t.Logf("%s: %d compressed bytes; refused: %v", s.name, len(s.body), err)
		}
	}
}

// TestUnpackBodyLimits checks MaxBody exactly at and past the edge, plain
// and compressed.
func TestUnpackBodyLimits(t *testing.T) {
	atMax := make([]byte, control.MaxBody)
	if out, err := control.UnpackBody(atMax, 0); err != nil || len(out) != control.MaxBody {
		t.Fatalf("plain body of MaxBody: %d bytes, %v", len(out), err)
	}
	if _, err := control.UnpackBody(make([]byte, control.MaxBody+1), 0); !errors.Is(err, control.ErrMalformed) {
		t.Fatalf("plain body of MaxBody+1: %v, want ErrMalformed", err)
	}
	if out, err := control.UnpackBody(zstdFrame(t, atMax), control.FlagZstd); err != nil || len(out) != control.MaxBody {
		t.Fatalf("zstd body inflating to exactly MaxBody: %d bytes, %v", len(out), err)
	}
	if _, err := control.UnpackBody(zstdFrame(t, make([]byte, control.MaxBody+1)), control.FlagZstd); !errors.Is(err, control.ErrMalformed) {
		t.Fatalf("zstd body inflating to MaxBody+1: %v, want ErrMalformed", err)
	}
	if _, err := control.UnpackBody(zstdStream(t, control.MaxBody+1), control.FlagZstd); !errors.Is(err, control.ErrMalformed) {
		t.Fatalf("streamed zstd body inflating to MaxBody+1: %v, want ErrMalformed", err)
	}
}

// TestWriteSeedCorpus rewrites testdata/fuzz/FuzzXxx/ from the seed
// functions; it runs only with KVFERRY_WRITE_SEED_CORPUS=1.
func TestWriteSeedCorpus(t *testing.T) {
	if os.Getenv("KVFERRY_WRITE_SEED_CORPUS") != "1" {
		t.Skip("set KVFERRY_WRITE_SEED_CORPUS=1 to rewrite testdata/fuzz")
	}
	write := func(target, name string, lines ...string) {
		dir := filepath.Join("testdata", "fuzz", target)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		data := "go test fuzz v1\n"
		for _, l := range lines {
			data += l + "\n"
		}
		if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, s := range envelopeSeeds() {
		write("FuzzDecodeEnvelope", s.name, fmt.Sprintf("[]byte(%q)", s.data))
	}
	for _, s := range descriptorSeeds() {
		write("FuzzDecodeDescriptor", s.name, fmt.Sprintf("[]byte(%q)", s.data))
	}
	for _, s := range bodySeeds(t) {
		if len(s.body) > 64<<10 {
			continue // keep committed files small
		}
		write("FuzzUnpackBody", s.name, fmt.Sprintf("[]byte(%q)", s.body), fmt.Sprintf("uint8(%d)", s.flags))
	}
}

// fuzzDecoder seeds f and fuzzes decode: an input it refuses must be
// refused with an error wrapping ErrMalformed; an input it takes goes to
// check with the decoded value. decode gets a copy of the fuzzer's input
// and must leave it as it was (a receive buffer is only read); check may
// then overwrite the copy, to show the value does not alias it.
func fuzzDecoder[T any](f *testing.F, seeds []namedSeed, decode func([]byte) (T, error), check func(t *testing.T, b []byte, m T)) {
	for _, s := range seeds {
		f.Add(s.data)
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		b := append([]byte(nil), in...)
		m, err := decode(b)
		if !bytes.Equal(b, in) {
			t.Fatalf("decoding changed its input:\nin  %x\nnow %x", in, b)
		}
		if err != nil {
			if !errors.Is(err, control.ErrMalformed) {
				t.Fatalf("decode error %v does not wrap ErrMalformed", err)
			}
			return
		}
		check(t, b, m)
	})
}

// requireCanonical fails the test unless m, decoded from in, encodes to in
// again (one encoding per message: nothing the decoder accepts is lost) and
// that encoding decodes back to m.
func requireCanonical[T comparable](t *testing.T, in []byte, m T, encode func(T) []byte, decode func([]byte) (T, error)) {
	t.Helper()
	enc := encode(m)
	if !bytes.Equal(enc, in) {
		t.Fatalf("re-encoding differs:\nin  %x\nout %x", in, enc)
	}
	if m2, err := decode(enc); err != nil || m2 != m {
		t.Fatalf("re-decode: %+v, %v; want %+v", m2, err, m)
	}
}
