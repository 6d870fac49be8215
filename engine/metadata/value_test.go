package metadata

import (
	"bytes"
	"errors"
	"fmt"
	"testing"

	"github.com/kvferry/kvferry/engine/control"
)

func sampleDescriptor(buffers int) *control.Descriptor {
	d := &control.Descriptor{Name: "10.0.0.1:15000", Version: control.ProtocolVersion, Epoch: 7, FenceEpoch: 3,
		Transports: []control.TransportAddr{{Name: "tcp", Addr: "10.0.0.1:40000"}}}
	for i := range buffers {
		// Keys that do not repeat: a descriptor that compresses poorly.
		key := (uint64(i) + 1) * 0x9e3779b97f4a7c15
		d.Buffers = append(d.Buffers, control.Buffer{Addr: uint64(i+1) << 21, Len: 1 << 20, Key: key, Location: "cpu:0"})
	}
	return d
}

func TestValueRoundTrip(t *testing.T) {
	for _, n := range []int{0, 1, 1000} {
		d := sampleDescriptor(n)
		got, name, err := DecodeValue(EncodeValue(d))
		if err != nil || name != d.Name || !bytes.Equal(got.Encode(), d.Encode()) {
			t.Fatalf("%d buffers: decoded %q, %v; not the descriptor encoded", n, name, err)
		}
	}
}

func TestDescriptorTooLargeForTheStoreIsPublishedAsAStub(t *testing.T) {
	d := sampleDescriptor(200_000) // far past MaxValue, even compressed
	v := EncodeValue(d)
	if len(v) > MaxValue {
		t.Fatalf("value of %d bytes published, more than %d", len(v), MaxValue)
	}
	got, name, err := DecodeValue(v)
	if !errors.Is(err, ErrTooLarge) || got != nil || name != d.Name {
		t.Fatalf("stub decoded as %v, %q, %v; want ErrTooLarge and the name", got, name, err)
	}
}

func TestMalformedValuesAreErrors(t *testing.T) {
	good := EncodeValue(sampleDescriptor(2))
	mut := func(f func(b []byte) []byte) []byte { return f(append([]byte(nil), good...)) }
	for i, b := range [][]byte{
		nil, []byte("KVF"), []byte("XXXXXXXXXXXX"),
		mut(func(b []byte) []byte { b[4] = 2; return b }),                // version
		mut(func(b []byte) []byte { b[7] = 1; return b }),                // reserved
		mut(func(b []byte) []byte { b[5] = 9; return b }),                // kind
		mut(func(b []byte) []byte { b[6] = 0x80; return b }),             // flags
		mut(func(b []byte) []byte { return b[:len(b)-1] }),               // truncated
		mut(func(b []byte) []byte { b[6] = control.FlagZstd; return b }), // not compressed
		header(valueStub, 0, nil), header(valueStub, 1, []byte("a:1")),
	} {
		if _, _, err := DecodeValue(b); !errors.Is(err, ErrMalformed) {
			t.Errorf("value %d: %v; want ErrMalformed", i, err)
		}
	}
}

func TestParseURL(t *testing.T) {
	for _, c := range []struct {
		in, want string
		eps      int
	}{
		{"etcd://127.0.0.1:2379", "etcd://127.0.0.1:2379/kvferry", 1},
		{"etcd://a:1,b:2/pd/cluster-1/", "etcd://a:1,b:2/pd/cluster-1", 2},
		{"etcd://[::1]:2379/x", "etcd://[::1]:2379/x", 1},
	} {
		cfg, err := ParseURL(c.in)
		if err != nil || cfg.String() != c.want || len(cfg.Endpoints) != c.eps {
			t.Errorf("ParseURL(%q) = %v (%d endpoints), %v; want %s", c.in, cfg, len(cfg.Endpoints), err, c.want)
		}
	}
	many := "etcd://"
	for i := range 17 {
		many += fmt.Sprintf("h%d:1,", i)
	}
	for _, bad := range []string{"", "etcd:/a:1", "redis://a:1", "etcd://", "etcd://a", "etcd://a:1,", "etcd://:1", "etcd://a:1/p q",
		"etcd://a:1/" + string(bytes.Repeat([]byte("p"), 129)), many[:len(many)-1], "etcd://a:1/\x7f"} {
		if _, err := ParseURL(bad); err == nil {
			t.Errorf("ParseURL(%q) accepted", bad)
		}
	}
}

func FuzzDecodeValue(f *testing.F) {
	f.Add(EncodeValue(sampleDescriptor(3)))
	f.Add(EncodeValue(sampleDescriptor(0)))
	f.Add(header(valueStub, 0, []byte("h:1")))
	f.Add([]byte("KVFM\x01\x01\x01\x00garbage"))
	f.Fuzz(func(t *testing.T, b []byte) {
		d, name, err := DecodeValue(b)
		if err == nil {
			if d == nil || name != d.Name {
				t.Fatalf("accepted without a descriptor, or named %q for %q", name, d.Name)
			}
			// What decodes encodes back to a value that decodes the same.
			d2, _, err := DecodeValue(EncodeValue(d))
			if err != nil || !bytes.Equal(d2.Encode(), d.Encode()) {
				t.Fatalf("round trip of an accepted value: %v", err)
			}
		} else if !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrTooLarge) {
			t.Fatalf("error %v is neither ErrMalformed nor ErrTooLarge", err)
		}
	})
}

func FuzzParseURL(f *testing.F) {
	for _, s := range []string{"etcd://127.0.0.1:2379", "etcd://a:1,b:2/p", "etcd://[::1]:1/x/y", "etcd://a:1/\x00"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		cfg, err := ParseURL(s)
		if err != nil {
			return
		}
		if len(cfg.Endpoints) == 0 || len(cfg.Endpoints) > 16 || cfg.Prefix == "" || len(cfg.Prefix) > 128 {
			t.Fatalf("ParseURL(%q) accepted %+v", s, cfg)
		}
		// The canonical form parses to the same configuration.
		again, err := ParseURL(cfg.String())
		if err != nil || again.String() != cfg.String() {
			t.Fatalf("ParseURL(%q).String() = %q does not parse back: %v", s, cfg.String(), err)
		}
	})
}
