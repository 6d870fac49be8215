package control_test

import (
	"math/rand/v2"
	"reflect"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/control"
)

func TestDescriptorFindEdges(t *testing.T) {
	const top = 1<<64 - 1
	d := &control.Descriptor{Buffers: []control.Buffer{
		{Addr: 0x1000, Len: 0x1000, Key: 1},       // [0x1000, 0x2000)
		{Addr: 0x2000, Len: 0x1000, Key: 2},       // [0x2000, 0x3000), adjacent to the first
		{Addr: 0x5000, Len: 0x100, Key: 3},        // after a gap
		{Addr: top - 0x1000, Len: 0x1000, Key: 4}, // [2^64-1-0x1000, 2^64-1): ends one byte below the top
	}}
	cases := []struct {
		name    string
		addr, n uint64
		key     uint64 // 0: not found
	}{
		{"first byte of first buffer", 0x1000, 1, 1},
		{"last byte of first buffer", 0x1fff, 1, 1},
		{"whole first buffer", 0x1000, 0x1000, 1},
		{"first byte of adjacent buffer", 0x2000, 1, 2},
		{"last byte of adjacent buffer", 0x2fff, 1, 2},
		{"whole adjacent buffer", 0x2000, 0x1000, 2},
		{"span two adjacent buffers by 2 bytes", 0x1fff, 2, 0},
		{"span two adjacent buffers whole", 0x1000, 0x2000, 0},
		{"one byte past the first buffer's length", 0x1000, 0x1001, 0},
		{"byte before the first buffer", 0xfff, 1, 0},
		{"starting before the first buffer", 0xfff, 2, 0},
		{"address 0", 0, 1, 0},
		{"byte after the adjacent buffer (gap)", 0x3000, 1, 0},
		{"into the gap from a buffer", 0x2fff, 2, 0},
		{"from the gap into a buffer", 0x4fff, 2, 0},
		{"first byte after the gap", 0x5000, 1, 3},
		{"last byte of gap buffer", 0x50ff, 1, 3},
		{"past the last low buffer", 0x5100, 1, 0},
		{"first byte of top buffer", top - 0x1000, 1, 4},
		{"last byte of top buffer", top - 1, 1, 4},
		{"whole top buffer", top - 0x1000, 0x1000, 4},
		{"the top byte itself (no buffer)", top, 1, 0},
		{"top buffer's last byte plus one: addr+n reaches 2^64", top - 1, 2, 0},
		{"length wraps past 2^64", top - 0x800, 1 << 63, 0},
		{"length of 2^64-1 from a buffer", 0x1000, top, 0},
		{"length of 2^64-1 from the top buffer", top - 0x1000, top, 0},
		{"addr+n wraps to inside the first buffer", top - 0x10, 0x1010 + 0x11, 0},
	}
	for _, tc := range cases {
		b, ok := d.Find(tc.addr, tc.n)
		if tc.key == 0 {
			if ok {
				t.Errorf("%s: Find(%#x, %#x) = %+v, want not found", tc.name, tc.addr, tc.n, b)
			}
			continue
		}
		if !ok || b.Key != tc.key {
			t.Errorf("%s: Find(%#x, %#x) = %+v, %v; want buffer with key %d", tc.name, tc.addr, tc.n, b, ok, tc.key)
		}
	}
	if _, ok := (&control.Descriptor{}).Find(0x1000, 1); ok {
		t.Error("Find on a descriptor without buffers succeeded")
	}
}

// naiveFind is the obvious linear-scan oracle for Find.
func naiveFind(d *control.Descriptor, addr, n uint64) (control.Buffer, bool) {
	if n == 0 {
		return control.Buffer{}, false
	}
	for _, b := range d.Buffers {
		if addr >= b.Addr && addr-b.Addr < b.Len && n <= b.Len-(addr-b.Addr) {
			return b, true
		}
	}
	return control.Buffer{}, false
}

// TestDescriptorFindMatchesLinearScan compares Find with the linear oracle
// on random descriptors, probing around every buffer edge.
func TestDescriptorFindMatchesLinearScan(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 11))
	for iter := range 200 {
		d := &control.Descriptor{}
		addr := r.Uint64N(1 << 20)
		for range r.IntN(20) {
			addr += r.Uint64N(3) * r.Uint64N(64) // sometimes adjacent
			l := 1 + r.Uint64N(64)
			d.Buffers = append(d.Buffers, control.Buffer{Addr: addr, Len: l, Key: addr})
			addr += l
		}
		var probes []uint64
		for _, b := range d.Buffers {
			for _, x := range []uint64{b.Addr - 1, b.Addr, b.Addr + 1, b.Addr + b.Len - 1, b.Addr + b.Len, b.Addr + b.Len + 1} {
				probes = append(probes, x)
			}
		}
		probes = append(probes, 0, 1<<64-1, r.Uint64())
		for _, a := range probes {
			for _, n := range []uint64{1, 2, 3, 17, 64, 65, 1<<64 - 1, 0 - a} {
				if n == 0 {
					continue // n == 0 has no defined answer
				}
				got, gok := d.Find(a, n)
				want, wok := naiveFind(d, a, n)
				if gok != wok || got != want {
					t.Fatalf("iter %d: Find(%#x, %d) = %+v, %v; linear scan says %+v, %v\nbuffers %+v", iter, a, n, got, gok, want, wok, d.Buffers)
				}
			}
		}
	}
}

// bigDescriptor builds a descriptor shaped like a real engine's: n page-
// aligned buffers of a few sizes with small gaps, keys tagged per engine.
func bigDescriptor(n int, location func(i int) string) *control.Descriptor {
	d := &control.Descriptor{
		Name: "10.0.0.17:40123", Version: control.ProtocolVersion, Epoch: 99,
		Transports: []control.TransportAddr{{Name: "tcp", Addr: "10.0.0.17:40124"}},
		Buffers:    make([]control.Buffer, 0, n),
	}
	addr := uint64(0x7f0000000000)
	for i := range n {
		l := uint64(2<<20) << (i % 3)
		d.Buffers = append(d.Buffers, control.Buffer{Addr: addr, Len: l, Key: 0xabcd<<32 | uint64(i+1), Location: location(i)})
		addr += l + 4096*uint64(i%2)
	}
	return d
}

func TestDescriptorLargeCompressionRoundTrip(t *testing.T) {
	const n = 100_000
	d := bigDescriptor(n, func(i int) string {
		if i%4 == 0 {
			return "cpu"
		}
		return "cuda:" + string(rune('0'+i%8))
	})
	start := time.Now()
	raw := d.Encode()
	packed, flags := control.PackBody(raw)
	packTook := time.Since(start)
	if flags != control.FlagZstd {
		t.Fatalf("PackBody of %d bytes did not compress (flags %d)", len(raw), flags)
	}
	if len(packed) >= len(raw) {
		t.Fatalf("compressed %d >= raw %d", len(packed), len(raw))
	}
	if len(raw) > control.MaxBody {
		t.Fatalf("%d buffers encode to %d bytes, past MaxBody", n, len(raw))
	}
	start = time.Now()
	body, err := control.UnpackBody(packed, flags)
	if err != nil {
		t.Fatalf("UnpackBody: %v", err)
	}
	got, err := control.DecodeDescriptor(body)
	if err != nil {
		t.Fatalf("DecodeDescriptor: %v", err)
	}
	unpackTook := time.Since(start)
	if !reflect.DeepEqual(got, d) {
		t.Fatal("large descriptor changed in the round trip")
	}
	for _, i := range []int{0, 1, n / 2, n - 1} {
		b := d.Buffers[i]
		if f, ok := got.Find(b.Addr+b.Len-1, 1); !ok || f != b {
			t.Fatalf("Find of buffer %d's last byte: %+v, %v", i, f, ok)
		}
	}
	t.Logf("%d buffers: %d bytes raw, %d compressed (ratio %.1fx, %.2f bytes/buffer); encode+pack %v, unpack+decode %v",
		n, len(raw), len(packed), float64(len(raw))/float64(len(packed)), float64(len(packed))/n, packTook, unpackTook)
}

// TestDescriptorOfMaxBuffersCrossesThePlane: DecodeDescriptor accepts up to
// maxBuffers buffers, so a descriptor of that many short-location buffers
// must also pass the plane's body limit (PackBody/UnpackBody, MaxBody after
// decompression); otherwise an owner with that many registrations cannot
// be resolved by any peer.
func TestDescriptorOfMaxBuffersCrossesThePlane(t *testing.T) {
	n := control.MaxBuffersForTest
	d := bigDescriptor(n, func(int) string { return "cpu" })
	raw := d.Encode()
	packed, flags := control.PackBody(raw)
	t.Logf("%d buffers: %d bytes raw (MaxBody %d), %d packed", n, len(raw), control.MaxBody, len(packed))
	body, err := control.UnpackBody(packed, flags)
	if err != nil {
		t.Fatalf("BUG: a descriptor of maxBuffers=%d buffers (%d bytes encoded) is refused by UnpackBody: %v; "+
			"the largest that fits MaxBody has about %d buffers", n, len(raw), err, control.MaxBody/(len(raw)/n))
	}
	if _, err := control.DecodeDescriptor(body); err != nil {
		t.Fatalf("DecodeDescriptor: %v", err)
	}
}

// TestDescriptorEncodeCutsLongStrings documents Encode's one lossy case:
// strings past 255 bytes are cut, and the result still decodes.
func TestDescriptorEncodeCutsLongStrings(t *testing.T) {
	long := string(make([]byte, 300))
	d := &control.Descriptor{Name: long, Version: control.ProtocolVersion,
		Buffers: []control.Buffer{{Addr: 1, Len: 1, Location: long}}}
	got, err := control.DecodeDescriptor(d.Encode())
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Name) != 255 || len(got.Buffers[0].Location) != 255 {
		t.Fatalf("name %d bytes, location %d bytes; want both cut to 255", len(got.Name), len(got.Buffers[0].Location))
	}
}

func TestDescriptorTransport(t *testing.T) {
	d := sampleDescriptor()
	if a, ok := d.Transport("rdma"); !ok || a != "mlx5_0:1" {
		t.Fatalf("Transport(rdma) = %q, %v", a, ok)
	}
	if _, ok := d.Transport("nvlink"); ok {
		t.Fatal("Transport of an absent name succeeded")
	}
}
