package control_test

import (
	"bytes"
	"context"
	"testing"

	"github.com/kvferry/kvferry/engine/control"
)

// BenchmarkPlaneRequest times one request and its reply between two planes
// over loopback: a PING with an empty body (the control plane's latency)
// and with a 1 MiB body (its throughput for large descriptors).
func BenchmarkPlaneRequest(b *testing.B) {
	for _, size := range []int{0, 1 << 20} {
		b.Run(map[int]string{0: "empty", 1 << 20: "1MiB"}[size], func(b *testing.B) {
			mk := func() *control.Plane {
				p, err := control.Listen("127.0.0.1", 0, nil)
				if err != nil {
					b.Fatal(err)
				}
				p.Handle(control.MsgPing, func(_ string, body []byte) (control.MsgType, []byte) { return control.MsgPong, body })
				p.Start()
				b.Cleanup(func() { _ = p.Close() })
				return p
			}
			a, c := mk(), mk()
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
		})
	}
}
