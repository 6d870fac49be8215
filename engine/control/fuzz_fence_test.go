package control_test

// Fuzz targets for the bodies of FENCE and FENCE_ACK. Each must be fuzzed on
// its own, e.g.
//
//	go test ./engine/control -run='^$' -fuzz='^FuzzDecodeFenceMsg$' -fuzztime=30s
//	go test ./engine/control -run='^$' -fuzz='^FuzzDecodeFenceAck$' -fuzztime=30s
//
// A plain `go test` runs the f.Add seeds.

import (
	"bytes"
	"encoding/binary"
	"testing"

	"github.com/kvferry/kvferry/engine/control"
)

func fenceMsgSeeds() []namedSeed {
	valid := control.FenceMsg{Epoch: 7, Floor: 3, Ranges: []control.FenceRange{{Addr: 0x1000, Len: 0x2000}, {Addr: 0x9000, Len: 1}}}.Encode()
	return []namedSeed{
		{"valid", valid},
		{"valid_no_ranges", control.FenceMsg{Epoch: 1}.Encode()},
		{"valid_floor_is_epoch", control.FenceMsg{Epoch: 9, Floor: 9, Ranges: []control.FenceRange{{Addr: 1, Len: 1}}}.Encode()},
		{"valid_max", control.FenceMsg{Epoch: 1<<64 - 1, Floor: 1<<64 - 1, Ranges: []control.FenceRange{{Addr: 0, Len: 1<<64 - 1}}}.Encode()},
		{"valid_range_to_top", control.FenceMsg{Epoch: 2, Ranges: []control.FenceRange{{Addr: 1<<64 - 2, Len: 1}}}.Encode()},
		{"empty", nil},
		{"header_short", valid[:23]},
		{"range_short", valid[:len(valid)-1]},
		{"one_byte_long", append(append([]byte(nil), valid...), 0)},
		{"epoch_0", patch(valid, 0, 0, 0, 0, 0, 0, 0, 0, 0)},
		{"floor_above_epoch", patch(valid, 8, 8)},
		{"reserved", patch(valid, 20, 1)},
		{"count_too_big", patch(valid, 16, 3)},
		{"count_huge", patch(valid, 16, 0xff, 0xff, 0xff, 0xff)},
		{"range_empty", patch(valid, 24+8, 0, 0, 0, 0, 0, 0, 0, 0)},
		{"range_wraps", control.FenceMsg{Epoch: 2, Ranges: []control.FenceRange{{Addr: 1<<64 - 1, Len: 2}}}.Encode()},
		{"range_wraps_to_0", control.FenceMsg{Epoch: 2, Ranges: []control.FenceRange{{Addr: 1 << 63, Len: 1 << 63}}}.Encode()},
	}
}

func fenceAckSeeds() []namedSeed {
	valid := control.FenceAck{Epoch: 42}.Encode()
	return []namedSeed{
		{"valid", valid},
		{"valid_max", control.FenceAck{Epoch: 1<<64 - 1}.Encode()},
		{"empty", nil},
		{"truncated", valid[:control.FenceAckSize-1]},
		{"one_byte_long", append(append([]byte(nil), valid...), 0)},
		{"epoch_0", control.FenceAck{}.Encode()},
		{"reserved_low", patch(valid, 8, 1)},
		{"reserved_high", patch(valid, 15, 0x80)},
	}
}

func FuzzDecodeFenceMsg(f *testing.F) {
	fuzzDecoder(f, fenceMsgSeeds(), control.DecodeFenceMsg, func(t *testing.T, b []byte, m control.FenceMsg) {
		in := bytes.Clone(b) // b is decoded from, then overwritten
		if len(b) < 24 || binary.LittleEndian.Uint32(b[20:]) != 0 || m.Epoch == 0 || m.Floor > m.Epoch ||
			len(m.Ranges) > control.MaxFenceRanges || len(b) != 24+16*len(m.Ranges) {
			t.Fatalf("accepted %d bytes as %+v (%d ranges)", len(b), m.Epoch, len(m.Ranges))
		}
		for i, r := range m.Ranges {
			if end := r.Addr + r.Len; r.Len == 0 || end <= r.Addr {
				t.Fatalf("accepted range %d [%#x, +%d): empty or wraps", i, r.Addr, r.Len)
			}
		}
		// The ranges are the decoder's own: the receive buffer may be reused.
		for i := range b {
			b[i] ^= 0xff
		}
		enc := m.Encode()
		if !bytes.Equal(enc, in) {
			t.Fatalf("re-encoding differs:\nin  %x\nout %x", in, enc)
		}
		m2, err := control.DecodeFenceMsg(enc)
		if err != nil || m2.Epoch != m.Epoch || m2.Floor != m.Floor || len(m2.Ranges) != len(m.Ranges) {
			t.Fatalf("re-decode: %+v, %v; want %+v", m2, err, m)
		}
		for i := range m.Ranges {
			if m2.Ranges[i] != m.Ranges[i] {
				t.Fatalf("re-decode: range %d is %+v, want %+v", i, m2.Ranges[i], m.Ranges[i])
			}
		}
	})
}

func FuzzDecodeFenceAck(f *testing.F) {
	fuzzDecoder(f, fenceAckSeeds(), control.DecodeFenceAck, func(t *testing.T, b []byte, m control.FenceAck) {
		if len(b) != control.FenceAckSize || m.Epoch == 0 || binary.LittleEndian.Uint64(b[8:]) != 0 {
			t.Fatalf("accepted %x as %+v", b, m)
		}
		requireCanonical(t, b, m, control.FenceAck.Encode, control.DecodeFenceAck)
	})
}

// TestFenceSeedVerdicts states which seeds decode, so a change in what the
// decoders accept shows up by name.
func TestFenceSeedVerdicts(t *testing.T) {
	for _, c := range []struct {
		target string
		seeds  []namedSeed
		decode func([]byte) error
		accept map[string]bool
	}{
		{"FuzzDecodeFenceMsg", fenceMsgSeeds(), func(b []byte) error { _, err := control.DecodeFenceMsg(b); return err },
			map[string]bool{"valid": true, "valid_no_ranges": true, "valid_floor_is_epoch": true, "valid_max": true, "valid_range_to_top": true}},
		{"FuzzDecodeFenceAck", fenceAckSeeds(), func(b []byte) error { _, err := control.DecodeFenceAck(b); return err },
			map[string]bool{"valid": true, "valid_max": true}},
	} {
		for _, s := range c.seeds {
			if err := c.decode(s.data); c.accept[s.name] != (err == nil) {
				t.Errorf("%s/%s: %v, want accepted=%v", c.target, s.name, err, c.accept[s.name])
			}
		}
	}
}
