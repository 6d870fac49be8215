package control_test

import (
	"bytes"
	"context"
	"testing"

	"github.com/kvferry/kvferry/engine/auth"
	"github.com/kvferry/kvferry/engine/auth/authtest"
	"github.com/kvferry/kvferry/engine/control"
)

// BenchmarkPlaneRequest times one request and its reply between two planes
// over loopback: a PING with an empty body (the control plane's latency)
// and with a 1 MiB body (its throughput for large descriptors), with the
// NULL mechanism and with CURVE (every frame boxed).
func BenchmarkPlaneRequest(b *testing.B) {
	for _, mech := range []string{"null", "curve"} {
		for _, size := range []int{0, 1 << 20} {
			b.Run(mech+"/"+map[int]string{0: "empty", 1 << 20: "1MiB"}[size], func(b *testing.B) {
				benchPlaneRequest(b, mech == "curve", size)
			})
		}
	}
}

func benchPlaneRequest(b *testing.B, curve bool, size int) {
	a, c := echoPlanes(b, curve)
	// Incompressible, so that zstd does not make the 1 MiB case a
	// benchmark of compression.
	body := make([]byte, size)
	for i := range body {
		body[i] = byte(i*2654435761>>13) ^ byte(i>>7)
	}
	ctx := context.Background()
	if _, _, err := a.Request(ctx, c.Name(), control.MsgPing, body); err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(size))
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		_, got, err := a.Request(ctx, c.Name(), control.MsgPing, body)
		if err != nil || !bytes.Equal(got, body) {
			b.Fatalf("request %d: %v", i, err)
		}
	}
}

// BenchmarkCurveHandshake times a new connection's CURVE handshake and its
// first request, against the same over NULL: what authentication adds to
// opening a peer.
func BenchmarkCurveHandshake(b *testing.B) {
	for _, curve := range []bool{false, true} {
		b.Run(map[bool]string{false: "null", true: "curve"}[curve], func(b *testing.B) {
			a, c := echoPlanes(b, curve)
			ctx := context.Background()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, _, err := a.Request(ctx, c.Name(), control.MsgPing, nil); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				a.Forget(c.Name())
				// Forget is queued to a's loop; a PING to itself runs on
				// that loop after it, so the next request dials anew.
				_, _, _ = a.Request(ctx, a.Name(), control.MsgPing, nil)
				b.StartTimer()
			}
		})
	}
}

// echoPlanes starts two planes that answer PING with PONG, each allowing the
// other when curve is set.
func echoPlanes(b *testing.B, curve bool) (*control.Plane, *control.Plane) {
	ids := []auth.Identity{authtest.NewIdentity(b), authtest.NewIdentity(b)}
	mk := func(i int) *control.Plane {
		var a *auth.Authority
		if curve {
			a = authtest.Authority(b, ids[i], ids[0].Public, ids[1].Public)
		}
		p, err := control.ListenWith("127.0.0.1", 0, control.Options{Auth: a}, nil)
		if err != nil {
			b.Fatal(err)
		}
		p.Handle(control.MsgPing, func(_ string, body []byte) (control.MsgType, []byte) { return control.MsgPong, body })
		p.Start()
		b.Cleanup(func() { _ = p.Close() })
		return p
	}
	return mk(0), mk(1)
}
