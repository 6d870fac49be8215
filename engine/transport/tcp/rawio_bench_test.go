package tcp

import (
	"context"
	"fmt"
	"testing"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/engine/transport/transporttest"
)

// BenchmarkGuardedSyscall moves slices over one loopback path with the
// guarded copies made as rawIovec chooses (Auto: RawSyscall on memory
// mincore finds resident, as this benchmark's is, after one mincore per
// copy), always by RawSyscall (the code before the choice) and always by
// Syscall, in the same run:
//
//	go test -run XXX -bench GuardedSyscall -count 6 ./engine/transport/tcp/
func BenchmarkGuardedSyscall(b *testing.B) {
	for _, op := range []transport.Op{transport.Write, transport.Read} {
		for _, size := range []int{64 << 10, 1 << 20} {
			for _, mode := range []struct {
				name string
				mode int
			}{{"Auto", copyAuto}, {"RawSyscall", copyRaw}, {"Syscall", copySyscall}} {
				b.Run(fmt.Sprintf("%s/%dKiB/%s", op, size>>10, mode.name), func(b *testing.B) {
					copyMode = mode.mode
					defer func() { copyMode = copyAuto }()
					benchPath(b, op, size)
				})
			}
		}
	}
}

// benchPath posts b.N slices of size bytes, 16 at a time, on one path.
func benchPath(b *testing.B, op transport.Op, size int) {
	const window = 16
	owned, _, err := memory.Alloc(window * size)
	if err != nil {
		b.Fatal(err)
	}
	defer memory.Free(owned)
	local, _, err := memory.Alloc(window * size)
	if err != nil {
		b.Fatal(err)
	}
	defer memory.Free(local)
	oreg, oregion, lregion := transporttest.Register(b, owned, local)
	srv := New(Options{})
	defer srv.Close()
	addr, err := srv.Listen(transporttest.NewOwner(oreg))
	if err != nil {
		b.Fatal(err)
	}
	cli := New(Options{})
	defer cli.Close()
	ep, err := cli.Dial(context.Background(), addr, "bench:1")
	if err != nil {
		b.Fatal(err)
	}
	done := make(chan error, window)
	slices := make([]*transport.Slice, window)
	for i := range slices {
		slices[i] = &transport.Slice{Op: op, Local: local[i*size : (i+1)*size], LocalReg: lregion, Key: oregion.Key,
			Remote: memory.AddrOf(owned) + uint64(i*size), Done: func(_ *transport.Slice, err error) { done <- err }}
	}
	b.SetBytes(int64(size))
	b.ResetTimer()
	for n := 0; n < b.N; n += window {
		for _, s := range slices {
			s.Reset()
		}
		ep.Post(slices)
		for range slices {
			if err := <-done; err != nil {
				b.Fatal(err)
			}
		}
	}
}
