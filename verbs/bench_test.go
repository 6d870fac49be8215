package verbs_test

import (
	"fmt"
	"testing"
	"time"
	"unsafe"

	"github.com/kvferry/kvferry/internal/fakeverbs"
	"github.com/kvferry/kvferry/verbs"
)

// BenchmarkPostSend measures what posting costs per work request through
// the C shim (one cgo call per batch) against the fake provider: the time
// inside PostSend only, reported as post-ns/wr, for batches of 1 to 64
// 64-byte RDMA WRITEs on a loopback RC pair. Completions are polled outside
// the timed part.
func BenchmarkPostSend(b *testing.B) {
	lib, err := verbs.Open(fakeverbs.Path(b))
	if err != nil {
		b.Fatal(err)
	}
	ctx, err := lib.OpenContext(0)
	if err != nil {
		b.Fatal(err)
	}
	defer ctx.Close()
	pd, _ := ctx.AllocPD()
	defer pd.Dealloc()
	cq, _ := ctx.CreateCQ(4096)
	defer cq.Destroy()
	buf := make([]byte, 1<<20)
	addr := uint64(uintptr(unsafe.Pointer(&buf[0])))
	mr, err := pd.RegMR(addr, uint64(len(buf)), verbs.AccessLocalWrite|verbs.AccessRemoteWrite|verbs.AccessRemoteRead, false)
	if err != nil {
		b.Fatal(err)
	}
	defer mr.Dereg()
	qa, _ := pd.CreateQP(cq, cq, 1024, 16, 0)
	qb, _ := pd.CreateQP(cq, cq, 1024, 16, 0)
	defer qa.Destroy()
	defer qb.Destroy()
	port := ctx.Ports[0]
	for _, x := range []struct{ q, peer *verbs.QP }{{qa, qb}, {qb, qa}} {
		access := verbs.AccessLocalWrite | verbs.AccessRemoteWrite | verbs.AccessRemoteRead
		if err := x.q.ToInit(port.Num, access); err != nil {
			b.Fatal(err)
		}
		r := verbs.Remote{QPN: x.peer.Num, PSN: 7, LID: port.LID, GID: port.GID, Global: port.Ethernet(), MTU: port.ActiveMTU}
		if err := x.q.ToRTR(r, port.Num, port.ActiveMTU, port.GIDIndex); err != nil {
			b.Fatal(err)
		}
		if err := x.q.ToRTS(7, 14, 7); err != nil {
			b.Fatal(err)
		}
	}
	wcs := make([]verbs.WC, 256)
	for _, batch := range []int{1, 4, 16, 64} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			wrs := make([]verbs.WR, batch)
			for i := range wrs {
				wrs[i] = verbs.WR{
					ID: uint64(i), LocalAddr: addr + uint64(i)*64, Length: 64, LKey: mr.LKey,
					RemoteAddr: addr + 512<<10 + uint64(i)*64, RKey: mr.RKey, Opcode: verbs.OpWrite, Flags: verbs.FlagSignaled,
				}
			}
			var posting time.Duration
			total := 0
			for b.Loop() {
				t0 := time.Now()
				n, err := qa.PostSend(wrs)
				posting += time.Since(t0)
				if err != nil || n != batch {
					b.Fatalf("post: %d of %d: %v", n, batch, err)
				}
				for got := 0; got < batch; {
					k := cq.Poll(wcs)
					for _, wc := range wcs[:max(k, 0)] {
						if wc.Status != verbs.WCSuccess {
							b.Fatalf("completion status %d (%s)", wc.Status, lib.WCStatusString(wc.Status))
						}
					}
					got += max(k, 0)
				}
				total += batch
			}
			b.ReportMetric(float64(posting.Nanoseconds())/float64(total), "post-ns/wr")
		})
	}
}
