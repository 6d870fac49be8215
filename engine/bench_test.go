package engine_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
)

// benchPair returns an initiator, its buffer, and the target segment with
// its buffer address, for n bytes on each side.
func benchPair(b *testing.B, opts engine.Options, n int) (*engine.Engine, []byte, *engine.Segment, uint64) {
	b.Helper()
	a, t := newEngineWith(b, opts), newEngineWith(b, opts)
	src, dst := alloc(b, a, n), alloc(b, t, n)
	seg, err := a.OpenSegment(context.Background(), t.Name())
	if err != nil {
		b.Fatal(err)
	}
	return a, src, seg, engine.AddrOf(dst)
}

// runBatches moves batches of `batch` requests of `block` bytes from 4
// goroutines until b.N requests moved.
func runBatches(b *testing.B, e *engine.Engine, op engine.Op, src []byte, seg *engine.Segment, dst uint64, block, batch int) {
	b.Helper()
	runBatchesWith(b, 4, e, op, src, seg, dst, block, batch)
}

// runBatchesWith is runBatches from workers goroutines.
func runBatchesWith(b *testing.B, workers int, e *engine.Engine, op engine.Op, src []byte, seg *engine.Segment, dst uint64, block, batch int) {
	b.Helper()
	b.SetBytes(int64(block))
	b.ResetTimer()
	per := len(src) / workers / block * block
	errs := make(chan error, workers)
	for w := 0; w < workers; w++ {
		go func() {
			base := uint64(w * per)
			off := uint64(0)
			reqs := make([]engine.Request, batch)
			for done := 0; done < b.N/workers; done += batch {
				for i := range reqs {
					if off+uint64(block) > uint64(per) {
						off = 0
					}
					reqs[i] = engine.Request{Op: op, Local: engine.AddrOf(src) + base + off, Segment: seg, Remote: dst + base + off, Length: uint64(block)}
					off += uint64(block)
				}
				if _, err := e.Transfer(context.Background(), reqs); err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}()
	}
	for w := 0; w < workers; w++ {
		if err := <-errs; err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkTCP moves blocks between two engines over loopback TCP with 4
// paths; compare with BenchmarkRawTCP of the same run.
func BenchmarkTCP(b *testing.B) {
	for _, op := range []engine.Op{engine.Write, engine.Read} {
		for _, block := range []int{64 << 10, 1 << 20, 4 << 20} {
			b.Run(fmt.Sprintf("%s/%dKiB", op, block>>10), func(b *testing.B) {
				e, src, seg, dst := benchPair(b, engine.Options{PathsPerPeer: 4}, 64<<20)
				runBatches(b, e, op, src, seg, dst, block, 16)
			})
		}
	}
}

// BenchmarkSHM moves blocks between two engines over the same-host
// transport and over tcp, side by side in one run, with one path and one
// submitting goroutine: the ratio is what shm gains where both ends share
// a host (engine buffers: the owner copies through views of them).
func BenchmarkSHM(b *testing.B) {
	for _, op := range []engine.Op{engine.Write, engine.Read} {
		for _, block := range []int{64 << 10, 1 << 20, 4 << 20} {
			for _, proto := range []string{"tcp", "shm"} {
				b.Run(fmt.Sprintf("%s/%dKiB/%s", op, block>>10, proto), func(b *testing.B) {
					e, src, seg, dst := benchPair(b, engine.Options{Protocol: proto}, 64<<20)
					runBatchesWith(b, 1, e, op, src, seg, dst, block, 16)
				})
			}
		}
	}
}

// BenchmarkTCPAuth moves blocks as BenchmarkTCP does, without and with
// authentication (a cluster secret on both engines), side by side in one
// run: after the handshakes the data path is the same, so the ratio is
// what authentication costs a running transfer.
func BenchmarkTCPAuth(b *testing.B) {
	dir := b.TempDir()
	secret := dir + "/cluster.secret"
	if err := os.WriteFile(secret, []byte("benchmark cluster secret, 32 bytes"), 0o600); err != nil {
		b.Fatal(err)
	}
	for _, block := range []int{64 << 10, 1 << 20, 4 << 20} {
		for _, auth := range []string{"off", "on"} {
			b.Run(fmt.Sprintf("%dKiB/%s", block>>10, auth), func(b *testing.B) {
				opts := engine.Options{PathsPerPeer: 4}
				if auth == "on" {
					opts.ClusterSecretFile = secret
				}
				e, src, seg, dst := benchPair(b, opts, 64<<20)
				runBatches(b, e, engine.Write, src, seg, dst, block, 16)
			})
		}
	}
}

// BenchmarkSliceSize moves 4 MiB requests with several slice sizes: the
// figures behind DefaultSliceSize.
func BenchmarkSliceSize(b *testing.B) {
	for _, slice := range []int{64 << 10, 256 << 10, 1 << 20, 4 << 20} {
		b.Run(fmt.Sprintf("%dKiB", slice>>10), func(b *testing.B) {
			e, src, seg, dst := benchPair(b, engine.Options{PathsPerPeer: 4, SliceSize: slice}, 64<<20)
			runBatches(b, e, engine.Write, src, seg, dst, 4<<20, 4)
		})
	}
}

// BenchmarkLocal measures submit + wait of small requests to the engine's
// own segment: the per-request cost of the engine itself.
func BenchmarkLocal(b *testing.B) {
	for _, batch := range []int{1, 64, 1024} {
		b.Run(fmt.Sprintf("batch%d_64B", batch), func(b *testing.B) {
			e, err := engine.New(engine.Options{IgnoreEnv: true, Protocol: "tcp"})
			if err != nil {
				b.Fatal(err)
			}
			defer e.Close()
			buf, _ := e.AllocBuffer(1<<20, "cpu")
			self, _ := e.OpenSegment(context.Background(), e.Name())
			reqs := make([]engine.Request, batch)
			for i := range reqs {
				reqs[i] = engine.Request{Op: engine.Write, Local: engine.AddrOf(buf) + uint64(i*64), Segment: self,
					Remote: engine.AddrOf(buf) + 512<<10 + uint64(i*64), Length: 64}
			}
			b.ResetTimer()
			for n := 0; n < b.N; n += batch {
				if _, err := e.Transfer(context.Background(), reqs); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkRawTCP is the baseline: 4 loopback TCP streams writing blocks
// from (and reading them into) 16 MiB per stream, as BenchmarkTCP does.
func BenchmarkRawTCP(b *testing.B) {
	for _, block := range []int{64 << 10, 1 << 20, 4 << 20} {
		b.Run(fmt.Sprintf("%dKiB", block>>10), func(b *testing.B) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				b.Fatal(err)
			}
			defer ln.Close()
			const streams, region = 4, 16 << 20
			b.SetBytes(int64(block))
			done := make(chan struct{}, streams)
			go func() {
				for i := 0; i < streams; i++ {
					c, err := ln.Accept()
					if err != nil {
						return
					}
					go func() {
						defer c.Close()
						buf := make([]byte, region)
						for off := 0; ; off = (off + block) % (region - region%block) {
							if _, err := io.ReadFull(c, buf[off:off+block]); err != nil {
								done <- struct{}{}
								return
							}
						}
					}()
				}
			}()
			b.ResetTimer()
			for w := 0; w < streams; w++ {
				go func() {
					c, err := net.DialTimeout("tcp", ln.Addr().String(), time.Second)
					if err != nil {
						done <- struct{}{}
						return
					}
					defer c.Close()
					buf := make([]byte, region)
					off := 0
					for n := 0; n < b.N/streams; n++ {
						if _, err := c.Write(buf[off : off+block]); err != nil {
							return
						}
						off = (off + block) % (region - region%block)
					}
				}()
			}
			for i := 0; i < streams; i++ {
				<-done
			}
		})
	}
}
