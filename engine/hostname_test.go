package engine_test

import (
	"bytes"
	"context"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
)

// Host names work where addresses do: an engine created on "localhost" or
// on the machine's own name is known by that name ("localhost:port"), and
// a peer opens its segment by that name and moves data both ways. A name
// that does not resolve is an error that says which name and why.
func TestHostNamesAsEngineAndSegmentNames(t *testing.T) {
	hosts := []string{"localhost"}
	if h, err := os.Hostname(); err == nil {
		if _, err := net.LookupHost(h); err == nil {
			hosts = append(hosts, h)
		} else {
			t.Logf("the machine's name %q does not resolve here (%v): only localhost is tried", h, err)
		}
	}
	for _, host := range hosts {
		t.Run(host, func(t *testing.T) {
			owner := newEngineWith(t, engine.Options{IgnoreEnv: true, Protocol: "tcp", Host: host})
			if !strings.HasPrefix(owner.Name(), host+":") {
				t.Fatalf("engine on %q is named %q, want %q:port", host, owner.Name(), host)
			}
			init := newEngineWith(t, engine.Options{IgnoreEnv: true, Protocol: "tcp", Host: host})
			const n = 1 << 20
			dst := alloc(t, owner, n)
			src := alloc(t, init, n)
			for i := range src {
				src[i] = byte(i * 7)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			seg, err := init.OpenSegment(ctx, owner.Name())
			if err != nil {
				t.Fatalf("open segment %q: %v", owner.Name(), err)
			}
			if seg.Name() != owner.Name() {
				t.Fatalf("segment opened as %q is named %q", owner.Name(), seg.Name())
			}
			res, err := init.Transfer(ctx, []engine.Request{write(src, seg, engine.AddrOf(dst), n)})
			if err != nil || res[0].Status != engine.Completed {
				t.Fatalf("WRITE to %q: %+v, %v", owner.Name(), res, err)
			}
			if !bytes.Equal(src, dst) {
				t.Fatal("the WRITE's bytes differ at the owner")
			}
		})
	}
	_, err := engine.New(engine.Options{IgnoreEnv: true, Protocol: "tcp", Host: "no-such-host.invalid"})
	if err == nil || !strings.Contains(err.Error(), `"no-such-host.invalid"`) {
		t.Fatalf("engine on an unresolvable name: %v, want an error naming it", err)
	}
	t.Logf("unresolvable name: %v", err)
}
