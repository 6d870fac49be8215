package engine_test

import (
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
)

// hostOf is the host part of a "host:port".
func hostOf(t *testing.T, hostport string) string {
	t.Helper()
	h, _, err := net.SplitHostPort(hostport)
	if err != nil {
		t.Fatalf("%q: %v", hostport, err)
	}
	return h
}

// moveBothWays opens owner's segment from init by its name and writes and
// reads back 1 MiB.
func moveBothWays(t *testing.T, init, owner *engine.Engine) {
	t.Helper()
	const n = 1 << 20
	dst, src, back := alloc(t, owner, n), alloc(t, init, n), alloc(t, init, n)
	fillPattern(src, 21)
	seg := openSegment(t, init, owner.Name())
	transfer(t, init, 30*time.Second, write(src, seg, engine.AddrOf(dst), n))
	transfer(t, init, 30*time.Second, read(back, seg, engine.AddrOf(dst), n))
	requireEqual(t, "read back", back, src)
}

// An engine bound on a wildcard address advertises an address peers can
// reach (never 0.0.0.0 or ::) in its name and in its data-plane address,
// and a peer moves data through them.
func TestAWildcardBindAdvertisesAReachableAddress(t *testing.T) {
	for _, wildcard := range []string{"0.0.0.0", "::"} {
		t.Run(wildcard, func(t *testing.T) {
			owner, err := engine.New(engine.Options{IgnoreEnv: true, Protocol: "tcp", Host: wildcard})
			if err != nil {
				t.Skipf("bind %s here: %v", wildcard, err)
			}
			t.Cleanup(func() { _ = owner.Close() })
			host := hostOf(t, owner.Name())
			if host == "0.0.0.0" || host == "::" || host == "" {
				t.Fatalf("engine on %s is named %q", wildcard, owner.Name())
			}
			if dh := hostOf(t, owner.Descriptor().Transports[0].Addr); dh != host {
				t.Fatalf("data address host %q, segment name host %q", dh, host)
			}
			moveBothWays(t, newEngine(t), owner)
		})
	}
}

// AdvertiseHost names the segment and the data-plane address whatever the
// bind, as a container's or NAT's outside name would; IPv6 included.
func TestAdvertiseHostNamesTheSegmentAndItsDataAddress(t *testing.T) {
	cases := []struct{ bind, advertise, name string }{
		{"127.0.0.1", "localhost", "localhost"},
		{"0.0.0.0", "127.0.0.1", "127.0.0.1"},
		{"::", "::1", "::1"},
		{"::1", "[::1]", "::1"},
	}
	for _, c := range cases {
		t.Run(c.bind+"->"+c.advertise, func(t *testing.T) {
			owner, err := engine.New(engine.Options{IgnoreEnv: true, Protocol: "tcp", Host: c.bind, AdvertiseHost: c.advertise})
			if err != nil {
				if strings.Contains(c.bind, ":") {
					t.Skipf("no IPv6 loopback here: %v", err)
				}
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = owner.Close() })
			if h := hostOf(t, owner.Name()); h != c.name {
				t.Fatalf("name %q, want host %q", owner.Name(), c.name)
			}
			if h := hostOf(t, owner.Descriptor().Transports[0].Addr); h != c.name {
				t.Fatalf("data address %q, want host %q", owner.Descriptor().Transports[0].Addr, c.name)
			}
			moveBothWays(t, newEngine(t), owner)
		})
	}
}

func TestAnUnusableAdvertiseHostIsAnInvalidArgument(t *testing.T) {
	for _, bad := range []string{"0.0.0.0", "::", "not a host", "-bad-.", strings.Repeat("a", 300)} {
		_, err := engine.New(engine.Options{IgnoreEnv: true, Protocol: "tcp", AdvertiseHost: bad})
		if !errors.Is(err, engine.ErrInvalidArg) {
			t.Errorf("AdvertiseHost %q: %v, want ErrInvalidArg", bad, err)
		}
	}
}
