package tcp

// Fuzz target for the data frame header. Fuzz it on its own:
//
//	go test ./engine/transport/tcp -run='^$' -fuzz='^FuzzHeaderDecode$' -fuzztime=10s
//
// A plain `go test` runs the f.Add seeds and testdata/fuzz/FuzzHeaderDecode/.
// To regenerate the committed seed files:
//
//	KVFERRY_WRITE_SEED_CORPUS=1 go test ./engine/transport/tcp -run='^TestWriteHeaderSeedCorpus$'

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvferry/kvferry/engine/transport"
)

func encodeHeader(h header) []byte {
	b := make([]byte, HeaderSize)
	h.encode(b)
	return b
}

type headerSeed struct {
	name string
	data []byte
}

func headerSeeds() []headerSeed {
	write := encodeHeader(header{typ: frameWrite, seq: 3, requestID: 77, generation: 2, length: 4096, key: 1<<32 | 5, addr: 0x7f0000001000, grantID: 9})
	withPayload := append(append([]byte(nil), write...), bytes.Repeat([]byte{0xab}, 16)...)
	set := func(b []byte, i int, v byte) []byte {
		c := append([]byte(nil), b...)
		c[i] = v
		return c
	}
	set32 := func(b []byte, i int, v uint32) []byte {
		c := append([]byte(nil), b...)
		c[i], c[i+1], c[i+2], c[i+3] = byte(v), byte(v>>8), byte(v>>16), byte(v>>24)
		return c
	}
	return []headerSeed{
		{"hello", encodeHeader(header{typ: frameHello, length: 15})},
		{"challenge", encodeHeader(header{typ: frameChallenge, length: challengeSize})},
		{"auth", encodeHeader(header{typ: frameAuth, length: authMACSize})},
		{"hello_ack", encodeHeader(header{typ: frameHelloAck})},
		{"write", write},
		{"write_z", encodeHeader(header{typ: frameWriteZ, length: 4096, key: 3, addr: 4096})},
		{"write_with_payload_after", withPayload},
		{"write_ack_refused", encodeHeader(header{typ: frameWriteAck, status: statusRefused, seq: 3, requestID: 77, generation: 2, done: 4096})},
		{"read_max", encodeHeader(header{typ: frameRead, length: MaxSliceLength, addr: 1<<64 - 1})},
		{"read_data", encodeHeader(header{typ: frameReadData, length: 1})},
		{"read_data_z", encodeHeader(header{typ: frameReadDataZ, seq: 5, length: 4096})},
		{"type_13", set(encodeHeader(header{typ: frameReadDataZ, length: 4096}), 3, 13)},
		{"read_done", encodeHeader(header{typ: frameReadDone, status: maxKnownStatus, done: 1<<64 - 1})},
		{"empty", nil},
		{"truncated", write[:HeaderSize-1]},
		{"bad_magic", set(write, 0, 'X')},
		{"bad_version", set(write, 2, 2)},
		{"type_0", set(write, 3, 0)},
		{"type_8", set(write, 3, 8)},
		{"type_9", set(encodeHeader(header{typ: frameGoAway, seq: 3}), 3, 9)},
		{"go_away", encodeHeader(header{typ: frameGoAway, seq: 3})},
		{"go_away_with_length", encodeHeader(header{typ: frameGoAway, seq: 3, length: 1})},
		{"hello_goaway_flag", encodeHeader(header{typ: frameHello, length: 15, done: helloGoAway})},
		{"hello_empty_name", encodeHeader(header{typ: frameHello})},
		{"hello_name_too_long", encodeHeader(header{typ: frameHello, length: maxHelloName + 1})},
		{"write_zero_length", set32(write, 28, 0)},
		{"write_too_long", set32(write, 28, MaxSliceLength+1)},
		{"ack_with_length", encodeHeader(header{typ: frameWriteAck, length: 1})},
		{"unknown_status", set32(write, 4, maxKnownStatus+1)},
	}
}

func FuzzHeaderDecode(f *testing.F) {
	for _, s := range headerSeeds() {
		f.Add(s.data)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var h header
		if err := h.decode(b); err != nil {
			if !errors.Is(err, errBadFrame) || !errors.Is(err, transport.ErrProtocol) {
				t.Fatalf("decode error %v does not wrap errBadFrame and ErrProtocol", err)
			}
			return
		}
		if len(b) < HeaderSize {
			t.Fatalf("accepted a header of %d bytes", len(b))
		}
		if h.status > maxKnownStatus {
			t.Fatalf("accepted status %d", h.status)
		}
		switch h.typ {
		case frameHello:
			if h.length == 0 || h.length > maxHelloName {
				t.Fatalf("accepted hello of %d bytes", h.length)
			}
		case frameWrite, frameWriteZ, frameRead, frameReadData, frameReadDataZ:
			if h.length == 0 || h.length > MaxSliceLength {
				t.Fatalf("accepted type %d with length %d", h.typ, h.length)
			}
		case frameHelloAck, frameWriteAck, frameReadDone, frameGoAway:
			if h.length != 0 {
				t.Fatalf("accepted type %d with length %d", h.typ, h.length)
			}
		case frameChallenge:
			if h.length != challengeSize {
				t.Fatalf("accepted CHALLENGE of %d bytes", h.length)
			}
		case frameAuth:
			if h.length != authMACSize {
				t.Fatalf("accepted AUTH of %d bytes", h.length)
			}
		default:
			t.Fatalf("accepted type %d", h.typ)
		}
		out := make([]byte, HeaderSize)
		h.encode(out)
		if !bytes.Equal(out, b[:HeaderSize]) {
			t.Fatalf("re-encoding differs:\nin  %x\nout %x", b[:HeaderSize], out)
		}
		var h2 header
		if err := h2.decode(out); err != nil || h2 != h {
			t.Fatalf("re-decode: %+v, %v; want %+v", h2, err, h)
		}
	})
}

// TestHeaderSeedVerdicts states which seeds decode, so a change in what the
// decoder accepts shows up by name.
func TestHeaderSeedVerdicts(t *testing.T) {
	accept := map[string]bool{"hello": true, "hello_ack": true, "write": true, "write_with_payload_after": true,
		"write_ack_refused": true, "read_max": true, "read_data": true, "read_done": true, "go_away": true,
		"hello_goaway_flag": true, "challenge": true, "auth": true, "write_z": true, "read_data_z": true}
	for _, s := range headerSeeds() {
		var h header
		err := h.decode(s.data)
		if accept[s.name] != (err == nil) {
			t.Errorf("%s: %v, want accepted=%v", s.name, err, accept[s.name])
		}
	}
}

// TestWriteHeaderSeedCorpus rewrites testdata/fuzz/FuzzHeaderDecode from
// headerSeeds; it runs only with KVFERRY_WRITE_SEED_CORPUS=1.
func TestWriteHeaderSeedCorpus(t *testing.T) {
	if os.Getenv("KVFERRY_WRITE_SEED_CORPUS") != "1" {
		t.Skip("set KVFERRY_WRITE_SEED_CORPUS=1 to rewrite testdata/fuzz")
	}
	dir := filepath.Join("testdata", "fuzz", "FuzzHeaderDecode")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, s := range headerSeeds() {
		data := fmt.Sprintf("go test fuzz v1\n[]byte(%q)\n", s.data)
		if err := os.WriteFile(filepath.Join(dir, s.name), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}
