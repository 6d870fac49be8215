package rdma

import (
	"bytes"
	"errors"
	"slices"
	"testing"

	"github.com/kvferry/kvferry/engine/transport"
)

func sampleInfo() *infoReply {
	return &infoReply{
		NICs: []nicInfo{
			{Name: "mlx5_0", Port: 1, Ethernet: true, MTU: 5, GID: [16]byte{0xfe, 0x80, 15: 1}, NUMA: 0, PCI: "0000:3b:00.0"},
			{Name: "mlx5_1", Port: 1, MTU: 4, LID: 7, NUMA: -1},
		},
		Matrix: map[string][]uint8{"cpu": {0, 1}, "cpu:1": {1, 0}},
		Tiers:  map[string][]uint8{"cpu": {0, 0}, "cpu:1": {0, 1}},
	}
}

func TestWireRoundTrips(t *testing.T) {
	info := sampleInfo()
	got, err := decodeInfo(info.encode())
	if err != nil || len(got.NICs) != 2 || got.NICs[0] != info.NICs[0] || got.NICs[1] != info.NICs[1] || !bytes.Equal(got.Matrix["cpu:1"], []byte{1, 0}) ||
		!bytes.Equal(got.Tiers["cpu"], []byte{0, 0}) || !bytes.Equal(got.Tiers["cpu:1"], []byte{0, 1}) {
		t.Fatalf("info: %+v, %v", got, err)
	}
	// Tiers out of order (a better NIC after a worse one) are refused.
	badTiers := sampleInfo()
	badTiers.Tiers["cpu:1"] = []uint8{1, 0}
	if _, err := decodeInfo(badTiers.encode()); !errors.Is(err, ErrMalformed) {
		t.Fatalf("tiers out of order: %v, want a wire error", err)
	}
	cr := &connectReq{Conn: 99, Pairs: []pairReq{{Slot: 3, Local: 1, Remote: 0, QP: qpInfo{QPN: 0x123, PSN: 0xabc}, LID: 9, MTU: 5, Ethernet: true}}}
	gc, err := decodeConnect(cr.encode())
	if err != nil || gc.Conn != 99 || gc.Pairs[0] != cr.Pairs[0] {
		t.Fatalf("connect: %+v, %v", gc, err)
	}
	rep := &connectReply{QPs: []qpInfo{{QPN: 5, PSN: 6}}}
	if g, err := decodeConnectReply(rep.encode(), 1); err != nil || g.QPs[0] != rep.QPs[0] {
		t.Fatalf("connect reply: %+v, %v", g, err)
	}
	if _, err := decodeConnectReply(rep.encode(), 2); !errors.Is(err, ErrMalformed) {
		t.Fatalf("a reply for the wrong number of pairs: %v", err)
	}
	kr := &keysReply{Addr: 0x1000, Len: 300, Location: "cpu:0", Admitted: transport.Span{Addr: 0x1010, Len: 100}, Pieces: []piece{{Off: 0, Len: 200, RKeys: []uint32{1, 2}}, {Off: 200, Len: 100, RKeys: []uint32{3, 4}}}}
	gk, err := decodeKeysReply(kr.encode(), 2)
	if err != nil || gk.Len != 300 || gk.Pieces[1].RKeys[1] != 4 || gk.Admitted != kr.Admitted {
		t.Fatalf("keys: %+v, %v", gk, err)
	}
	// An admitted range outside the registration is refused: the
	// initiator would take it for the owner's leave to write there.
	for _, a := range []transport.Span{{}, {Addr: 0xf00, Len: 300}, {Addr: 0x1000, Len: 301}, {Addr: 0x112c, Len: 1}} {
		out := *kr
		out.Admitted = a
		if _, err := decodeKeysReply(out.encode(), 2); !errors.Is(err, ErrMalformed) {
			t.Fatalf("admitted %+v outside [0x1000, +300): %v", a, err)
		}
	}
	if _, err := decodeKeysReply(encodeKeysRefusal(keysAborted, "gone"), 2); !errors.Is(err, transport.ErrAborted) || !errors.Is(err, transport.ErrRefused) {
		t.Fatalf("aborted refusal: %v", err)
	}
	// Pieces that leave a hole or overlap are refused: they could steer
	// a write outside what the owner named.
	bad := &keysReply{Addr: 0x1000, Len: 300, Pieces: []piece{{Off: 0, Len: 100, RKeys: []uint32{1}}, {Off: 150, Len: 150, RKeys: []uint32{2}}}}
	if _, err := decodeKeysReply(bad.encode(), 1); !errors.Is(err, ErrMalformed) {
		t.Fatalf("pieces with a hole: %v", err)
	}
	kq := &keysReq{Conn: 8, Seq: 9, Key: 1, Op: 2, RequestID: 3, Generation: 4, GrantID: 5, Addr: 6, Len: 7}
	if g, err := decodeKeys(kq.encode()); err != nil || *g != *kq {
		t.Fatalf("keys request: %+v, %v", g, err)
	}
	rr := &releaseReq{Conn: 1, Seq: 2, RequestIDs: []uint64{5, 6}}
	if g, err := decodeRelease(rr.encode()); err != nil || !slices.Equal(g.RequestIDs, rr.RequestIDs) || g.Seq != 2 {
		t.Fatalf("release: %+v, %v", g, err)
	}
	for _, bad := range []*releaseReq{{Conn: 1}, {Conn: 1, RequestIDs: make([]uint64, maxRelease+1)}} {
		if _, err := decodeRelease(bad.encode()); !errors.Is(err, ErrMalformed) {
			t.Fatalf("release of %d request ids: %v", len(bad.RequestIDs), err)
		}
	}
}

// FuzzDecode feeds every decoder the same bytes: none may panic, and what
// decodes must encode back to a message that decodes the same.
func FuzzDecode(f *testing.F) {
	f.Add(sampleInfo().encode())
	f.Add((&connectReq{Conn: 1, Pairs: []pairReq{{QP: qpInfo{QPN: 1}, MTU: 3}}}).encode())
	f.Add((&connectReply{QPs: []qpInfo{{QPN: 1}}}).encode())
	f.Add((&keysReq{Key: 1}).encode())
	f.Add((&keysReply{Addr: 1, Len: 1, Admitted: transport.Span{Addr: 1, Len: 1}, Pieces: []piece{{Len: 1, RKeys: []uint32{1}}}}).encode())
	f.Add(encodeKeysRefusal(keysRefused, "no"))
	f.Add((&releaseReq{Conn: 1, Seq: 2, RequestIDs: []uint64{3, 4}}).encode())
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		if m, err := decodeInfo(b); err == nil {
			if _, err := decodeInfo(m.encode()); err != nil {
				t.Fatalf("info re-encode: %v", err)
			}
		}
		if m, err := decodeConnect(b); err == nil {
			if g, err := decodeConnect(m.encode()); err != nil || len(g.Pairs) != len(m.Pairs) {
				t.Fatalf("connect re-encode: %v", err)
			}
		}
		_, _ = decodeConnectReply(b, 1)
		if m, err := decodeRelease(b); err == nil {
			if g, err := decodeRelease(m.encode()); err != nil || !slices.Equal(g.RequestIDs, m.RequestIDs) || g.Conn != m.Conn || g.Seq != m.Seq {
				t.Fatalf("release re-encode: %+v, %v", g, err)
			}
			if len(m.RequestIDs) == 0 || len(m.RequestIDs) > maxRelease {
				t.Fatalf("release of %d request ids decoded", len(m.RequestIDs))
			}
		}
		if m, err := decodeKeys(b); err == nil {
			if g, err := decodeKeys(m.encode()); err != nil || *g != *m {
				t.Fatalf("keys re-encode: %v", err)
			}
		}
		for nics := range 3 {
			if m, err := decodeKeysReply(b, nics); err == nil {
				if _, err := decodeKeysReply(m.encode(), nics); err != nil {
					t.Fatalf("keys reply re-encode: %v", err)
				}
				var next uint64
				for _, p := range m.Pieces {
					if p.Off != next {
						t.Fatalf("pieces do not tile: %+v", m.Pieces)
					}
					next += p.Len
				}
				if next != m.Len {
					t.Fatalf("pieces cover %d of %d", next, m.Len)
				}
			}
		}
	})
}
