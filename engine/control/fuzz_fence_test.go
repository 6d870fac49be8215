package control_test

// Fuzz targets for the bodies of FENCE and FENCE_ACK, each fuzzed on its own:
//
//	go test ./engine/control -run='^$' -fuzz='^FuzzDecodeFenceMsg$' -fuzztime=100000x
//	go test ./engine/control -run='^$' -fuzz='^FuzzDecodeFenceAck$' -fuzztime=100000x
//
// Whatever a peer sends, decoding returns a value or an error (never a
// panic), allocates no more than the body holds, and a body it accepts is
// the canonical encoding of what it returned.

import (
	"bytes"
	"encoding/binary"
	"testing"

	"github.com/kvferry/kvferry/engine/control"
)

func FuzzDecodeFenceMsg(f *testing.F) {
	valid := control.FenceMsg{Epoch: 1 << 60, Floor: 1<<60 - 5, Ranges: []control.FenceRange{{Addr: 0x7f0000000000, Len: 4096}, {Addr: 0x7f0000010000, Len: 1 << 20}}}.Encode()
	huge := make([]byte, 24)
	binary.LittleEndian.PutUint64(huge, 9)
	binary.LittleEndian.PutUint32(huge[16:], 1<<31) // a count the body cannot hold
	for _, seed := range [][]byte{
		valid,
		control.FenceMsg{Epoch: 1}.Encode(),
		nil,
		valid[:23],
		valid[:len(valid)-1],
		append(append([]byte(nil), valid...), 0),
		patch(valid, 20, 1),                     // reserved
		patch(valid, 0, 0, 0, 0, 0, 0, 0, 0, 0), // epoch 0
		patch(valid, 8, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff),  // floor past the epoch
		patch(valid, 32, 0, 0, 0, 0, 0, 0, 0, 0),                         // an empty range
		patch(valid, 24, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff), // a range that wraps
		huge,
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := control.DecodeFenceMsg(b)
		if err != nil {
			return
		}
		if m.Epoch == 0 || m.Floor > m.Epoch || len(m.Ranges) > control.MaxFenceRanges {
			t.Fatalf("accepted %+v", m)
		}
		for _, r := range m.Ranges {
			if r.Len == 0 || r.Addr+r.Len < r.Addr {
				t.Fatalf("accepted the range %+v", r)
			}
		}
		if !bytes.Equal(m.Encode(), b) {
			t.Fatalf("accepted a non-canonical encoding %x", b)
		}
	})
}

func FuzzDecodeFenceAck(f *testing.F) {
	valid := control.FenceAck{Epoch: 1 << 60}.Encode()
	for _, seed := range [][]byte{valid, nil, valid[:15], append(append([]byte(nil), valid...), 0), patch(valid, 15, 1), make([]byte, 16)} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := control.DecodeFenceAck(b)
		if err != nil {
			return
		}
		if m.Epoch == 0 || !bytes.Equal(m.Encode(), b) {
			t.Fatalf("accepted %x as %+v", b, m)
		}
	})
}
