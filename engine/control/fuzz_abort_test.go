package control_test

// Fuzz targets for the bodies of ABORT (and CANCELED, which shares it),
// ABORT_ACK and NOTIFY. Each must be fuzzed on its own, e.g.
//
//	go test ./engine/control -run='^$' -fuzz='^FuzzDecodeAbortMsg$'     -fuzztime=100000x
//	go test ./engine/control -run='^$' -fuzz='^FuzzDecodeAbortAck$'     -fuzztime=100000x
//	go test ./engine/control -run='^$' -fuzz='^FuzzDecodeNotification$' -fuzztime=100000x
//
// A plain `go test` runs the f.Add seeds and the committed corpus under
// testdata/fuzz/FuzzXxx/. To regenerate the committed seed files:
//
//	KVFERRY_WRITE_SEED_CORPUS=1 go test ./engine/control -run='^TestWriteAbortSeedCorpus$'

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvferry/kvferry/engine/control"
)

// patch returns a copy of b with the bytes at off replaced by v, so seeds
// can carry what Encode never produces.
func patch(b []byte, off int, v ...byte) []byte {
	c := append([]byte(nil), b...)
	copy(c[off:], v)
	return c
}

func abortMsgSeeds() []namedSeed {
	valid := control.AbortMsg{RequestID: 0x1122334455667788, Generation: 3}.Encode()
	return []namedSeed{
		{"valid", valid},
		{"valid_max", control.AbortMsg{RequestID: 1<<64 - 1, Generation: 1<<32 - 1}.Encode()},
		{"valid_gen_0", control.AbortMsg{RequestID: 1}.Encode()},
		{"empty", nil},
		{"truncated", valid[:control.AbortMsgSize-1]},
		{"one_byte_long", append(append([]byte(nil), valid...), 0)},
		{"ack_sized", make([]byte, control.AbortAckSize)},
		{"reserved_low", patch(valid, 12, 1)},
		{"reserved_high", patch(valid, 15, 0x80)},
		{"request_id_0", control.AbortMsg{Generation: 9}.Encode()},
	}
}

func abortAckSeeds() []namedSeed {
	valid := control.AbortAck{RequestID: 0x1122334455667788, Generation: 3, Outcome: control.AckDrained, Landed: 4096}.Encode()
	return []namedSeed{
		{"valid_drained", valid},
		{"valid_cut", control.AbortAck{RequestID: 7, Generation: 1, Outcome: control.AckCut}.Encode()},
		{"valid_heard_max", control.AbortAck{RequestID: 1<<64 - 1, Generation: 1<<32 - 1, Outcome: control.AckHeard, Landed: 1<<64 - 1}.Encode()},
		{"empty", nil},
		{"truncated", valid[:control.AbortAckSize-1]},
		{"one_byte_long", append(append([]byte(nil), valid...), 0)},
		{"abort_sized", valid[:control.AbortMsgSize]},
		{"outcome_0", patch(valid, 12, 0)},
		{"outcome_4", patch(valid, 12, 4)},
		{"outcome_255", patch(valid, 12, 0xff)},
		{"reserved_13", patch(valid, 13, 1)},
		{"reserved_15", patch(valid, 15, 0xff)},
		{"request_id_0", control.AbortAck{Generation: 3, Outcome: control.AckDrained}.Encode()},
	}
}

func notificationSeeds() []namedSeed {
	full := control.Notification{RequestID: 0x1122334455667788, Data: bytes.Repeat([]byte{0xab}, control.MaxNotifyData)}.Encode()
	return []namedSeed{
		{"valid_text", control.Notification{RequestID: 42, Data: []byte("kv pages ready")}.Encode()},
		{"valid_no_data", control.Notification{RequestID: 42}.Encode()},
		{"valid_request_id_0", control.Notification{Data: []byte{1}}.Encode()},
		{"valid_max_data", full},
		{"empty", nil},
		{"truncated_id", full[:7]},
		{"data_one_byte_long", append(append([]byte(nil), full...), 0)},
		{"data_1k", make([]byte, 8+1024)},
	}
}

func FuzzDecodeAbortMsg(f *testing.F) {
	fuzzDecoder(f, abortMsgSeeds(), control.DecodeAbortMsg, func(t *testing.T, b []byte, m control.AbortMsg) {
		if len(b) != control.AbortMsgSize || m.RequestID == 0 || binary.LittleEndian.Uint32(b[12:]) != 0 {
			t.Fatalf("accepted %x as %+v", b, m)
		}
		requireCanonical(t, b, m, control.AbortMsg.Encode, control.DecodeAbortMsg)
	})
}

func FuzzDecodeAbortAck(f *testing.F) {
	fuzzDecoder(f, abortAckSeeds(), control.DecodeAbortAck, func(t *testing.T, b []byte, m control.AbortAck) {
		if len(b) != control.AbortAckSize || m.RequestID == 0 || m.Outcome < control.AckDrained || m.Outcome > control.AckHeard {
			t.Fatalf("accepted %x as %+v", b, m)
		}
		requireCanonical(t, b, m, control.AbortAck.Encode, control.DecodeAbortAck)
	})
}

func FuzzDecodeNotification(f *testing.F) {
	fuzzDecoder(f, notificationSeeds(), control.DecodeNotification, func(t *testing.T, b []byte, n control.Notification) {
		in := bytes.Clone(b) // b is decoded from, then overwritten
		if len(b) < 8 || len(n.Data) > control.MaxNotifyData || len(n.Data) != len(b)-8 {
			t.Fatalf("accepted %d bytes as %d bytes of data", len(b), len(n.Data))
		}
		// Data is the decoder's own copy: the receive buffer may be reused.
		for i := range b {
			b[i] ^= 0xff
		}
		if !bytes.Equal(n.Data, in[8:]) {
			t.Fatalf("decoded Data changed with the input buffer")
		}
		enc := n.Encode()
		if !bytes.Equal(enc, in) {
			t.Fatalf("re-encoding differs:\nin  %x\nout %x", in, enc)
		}
		n2, err := control.DecodeNotification(enc)
		if err != nil || n2.RequestID != n.RequestID || !bytes.Equal(n2.Data, n.Data) {
			t.Fatalf("re-decode: %+v, %v; want %+v", n2, err, n)
		}
	})
}

// TestAbortSeedVerdicts states which seeds decode, so a change in what the
// decoders accept shows up by name.
func TestAbortSeedVerdicts(t *testing.T) {
	for _, c := range []struct {
		target string
		seeds  []namedSeed
		decode func([]byte) error
		accept map[string]bool
	}{
		{"FuzzDecodeAbortMsg", abortMsgSeeds(), func(b []byte) error { _, err := control.DecodeAbortMsg(b); return err },
			map[string]bool{"valid": true, "valid_max": true, "valid_gen_0": true}},
		{"FuzzDecodeAbortAck", abortAckSeeds(), func(b []byte) error { _, err := control.DecodeAbortAck(b); return err },
			map[string]bool{"valid_drained": true, "valid_cut": true, "valid_heard_max": true}},
		{"FuzzDecodeNotification", notificationSeeds(), func(b []byte) error { _, err := control.DecodeNotification(b); return err },
			map[string]bool{"valid_text": true, "valid_no_data": true, "valid_request_id_0": true, "valid_max_data": true}},
	} {
		for _, s := range c.seeds {
			if err := c.decode(s.data); c.accept[s.name] != (err == nil) {
				t.Errorf("%s/%s: %v, want accepted=%v", c.target, s.name, err, c.accept[s.name])
			}
		}
	}
}

// TestWriteAbortSeedCorpus rewrites testdata/fuzz/ for the three targets
// above from their seed functions; it runs only with
// KVFERRY_WRITE_SEED_CORPUS=1.
func TestWriteAbortSeedCorpus(t *testing.T) {
	if os.Getenv("KVFERRY_WRITE_SEED_CORPUS") != "1" {
		t.Skip("set KVFERRY_WRITE_SEED_CORPUS=1 to rewrite testdata/fuzz")
	}
	for target, seeds := range map[string][]namedSeed{
		"FuzzDecodeAbortMsg":     abortMsgSeeds(),
		"FuzzDecodeAbortAck":     abortAckSeeds(),
		"FuzzDecodeNotification": notificationSeeds(),
	} {
		dir := filepath.Join("testdata", "fuzz", target)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		for _, s := range seeds {
			data := fmt.Sprintf("go test fuzz v1\n[]byte(%q)\n", s.data)
			if err := os.WriteFile(filepath.Join(dir, s.name), []byte(data), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
}
