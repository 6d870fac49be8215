package engine_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/engine/transport/tcp"
)

// READs of many requests share one path, so the owner answers several in
// one gathered write, and the owner aborts requests at random while they
// are read. Checked on the bytes, not only the statuses: every COMPLETED
// READ holds the owner's bytes exactly (no zeros of an aborted neighbour
// in it); an ABORTED one holds only the owner's bytes, the zeros standing
// in for the refused rest, or what it held before; the gaps between the
// READs' buffers are never written; and no buffer changes after its
// Transfer returned (every slot's content at the end is what it held when
// its last Transfer returned).
func TestAbortedGatheredReadsTouchOnlyTheirOwnBuffers(t *testing.T) {
	const (
		block   = 192 << 10 // several READs per gathered write (4 MiB)
		gap     = 4 << 10   // never written
		perTx   = 4         // requests per Transfer, each its own request id
		workers = 4
		slots   = 8 // per worker, used in turn
		stride  = block + gap
		region  = perTx * slots * stride
		size    = workers * region
	)
	p := newAbortPair(t, engine.Options{PathsPerPeer: 1, MaxRetries: -1}, size)
	fillPattern(p.dst, 11)
	for i, b := range p.dst {
		if b == 0 || b == 0xcc || b == 0xdd {
			p.dst[i] = 0x5a // the owner's bytes never look like zeros or the markers
		}
	}
	for i := range p.src {
		p.src[i] = 0xdd // gaps, and slots never used
	}
	var next atomic.Uint64
	var current [workers * perTx]atomic.Uint64
	// last[w][slot][k]: the bytes slot k of worker w held when its Transfer returned.
	last := make([][][][]byte, workers)
	var aborted sync.Map
	var mu sync.Mutex
	var errs []string
	fail := func(f string, args ...any) {
		mu.Lock()
		if len(errs) < 20 {
			errs = append(errs, fmt.Sprintf(f, args...))
		}
		mu.Unlock()
	}
	counts := map[engine.TaskStatus]int{}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range workers {
		last[w] = make([][][]byte, slots)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for round := 0; ; round++ {
				select {
				case <-stop:
					return
				default:
				}
				slot := round % slots
				reqs := make([]engine.Request, perTx)
				offs := make([]int, perTx)
				for k := range perTx {
					off := w*region + (slot*perTx+k)*stride
					offs[k] = off
					for i := off; i < off+block; i++ {
						p.src[i] = 0xcc // what the buffer held before
					}
					rid := next.Add(1)
					current[w*perTx+k].Store(rid)
					reqs[k] = engine.Request{Op: engine.Read, Local: engine.AddrOf(p.src) + uint64(off), Segment: p.seg,
						Remote: engine.AddrOf(p.dst) + uint64(off), Length: block, RequestID: rid}
				}
				res, err := p.init.Transfer(context.Background(), reqs)
				if len(res) != perTx {
					fail("transfer: %v", err)
					return
				}
				snap := make([][]byte, perTx)
				for k, r := range res {
					off := offs[k]
					got, want := p.src[off:off+block], p.dst[off:off+block]
					snap[k] = append([]byte(nil), got...)
					_, wasAborted := aborted.Load(reqs[k].RequestID)
					mu.Lock()
					counts[r.Status]++
					mu.Unlock()
					switch r.Status {
					case engine.Completed:
						for i := range got {
							if got[i] != want[i] {
								fail("request %d COMPLETED (aborted: %v) but byte %d is %#x, the owner's %#x", reqs[k].RequestID, wasAborted, i, got[i], want[i])
								break
							}
						}
					case engine.Aborted:
						if !wasAborted {
							fail("request %d ended ABORTED without being aborted: %v", reqs[k].RequestID, r.Err)
						}
						for i := range got {
							if got[i] != want[i] && got[i] != 0 && got[i] != 0xcc {
								fail("request %d ABORTED: byte %d is %#x, neither the owner's %#x, zero nor what it held", reqs[k].RequestID, i, got[i], want[i])
								break
							}
						}
					default:
						fail("request %d (aborted: %v) ended %v: %v", reqs[k].RequestID, wasAborted, r.Status, r.Err)
					}
				}
				last[w][slot] = snap
			}
		}()
	}
	rng := rand.New(rand.NewPCG(5, 6))
	deadline := time.Now().Add(30 * time.Second) // under -race aborts strike mid-write less often
	for n := 0; time.Now().Before(deadline) && (n < 200 || p.owner.Stats().RefusedInFlight < 5); n++ {
		time.Sleep(time.Duration(rng.Int64N(int64(2 * time.Millisecond)))) // aborts at random moments
		rid := current[rng.IntN(len(current))].Load()
		if rid == 0 {
			continue
		}
		aborted.Store(rid, true)
		if _, err := p.owner.Abort(testCtx(t, 10*time.Second), rid, []string{p.init.Name()}); err != nil {
			t.Fatalf("abort %d: %v", rid, err)
		}
	}
	close(stop)
	within(t, time.Minute, "the readers", wg.Wait)
	// Whatever is still on its way lands by now: every path drained.
	if !waitUntil(10*time.Second, func() bool { return p.init.Stats().TasksInFlight == 0 }) {
		t.Fatalf("tasks still in flight: %+v", p.init.Stats())
	}
	for w := range workers {
		for slot := range slots {
			for k, snap := range last[w][slot] {
				off := w*region + (slot*perTx+k)*stride
				if got := p.src[off : off+block]; string(got) != string(snap) {
					fail("worker %d slot %d request %d: its buffer changed after its Transfer returned", w, slot, k)
				}
			}
		}
	}
	for off := 0; off < size; off += stride {
		for i := off + block; i < off+stride; i++ {
			if p.src[i] != 0xdd {
				fail("gap byte at %d written: %#x", i, p.src[i])
				break
			}
		}
	}
	st := p.owner.Stats()
	t.Logf("outcomes %v; owner refusals mid-write %d", counts, st.RefusedInFlight)
	for _, e := range errs {
		t.Error(e)
	}
	if st.RefusedInFlight == 0 {
		t.Fatal("no abort struck while a READ was being sent: the test proved nothing")
	}
}

// stagingBudget is what this test lets one peer address make an owner pin
// in host staging buffers at once: the size of the staging pool
// (stagePoolMax, engine/gpu.go). The number is the reviewer's proposal;
// today nothing bounds it but TCPMaxConnsPerPeer x 64 MiB (64 GiB).
const stagingBudget = 256 << 20

// A peer without credentials (it needs only the descriptor, which the
// control plane gives anyone) opens a few data connections and on each
// asks a 64 MiB READ of GPU memory that it never reads: the owner takes a
// host staging buffer for each (page-locked when the driver allows) and
// keeps it while the answer waits on the full socket, for IOTimeout. The
// connection caps bound the connections, not this memory; README: "What a
// peer without credentials can make an owner spend is bounded".
func TestPeerCannotPinUnboundedStagingMemory(t *testing.T) {
	const size, conns = 64 << 20, 8
	owner := newEngineWith(t, gpuOpts(t, engine.Options{}))
	_, g := gpuAlloc(t, 0, size)
	if _, err := owner.RegisterMemory(g, "*"); err != nil {
		t.Fatal(err)
	}
	// Before the GPU memory is freed: unregistering waits for the staging
	// copies under way (a READ may be between its staging buffer and its
	// copy when the test ends).
	t.Cleanup(func() { _ = owner.UnregisterMemory(engine.AddrOf(g)) })
	desc := owner.Descriptor()
	var addr string
	for _, tr := range desc.Transports {
		if tr.Name == "tcp" {
			addr = tr.Addr
		}
	}
	var key uint64
	for _, b := range desc.Buffers {
		if b.Addr == engine.AddrOf(g) {
			key = b.Key
		}
	}
	if addr == "" || key == 0 {
		t.Fatalf("descriptor %+v: no tcp address or GPU buffer", desc)
	}
	hello := func(name string) []byte {
		b := make([]byte, 64)
		binary.LittleEndian.PutUint16(b[0:], 0x464b)
		b[2], b[3] = 1, 1
		binary.LittleEndian.PutUint32(b[28:], uint32(len(name)))
		return append(b, name...)
	}
	readFrame := func() []byte {
		b := make([]byte, 64)
		binary.LittleEndian.PutUint16(b[0:], 0x464b)
		b[2], b[3] = 1, 5
		binary.LittleEndian.PutUint64(b[8:], 1)
		binary.LittleEndian.PutUint32(b[28:], size)
		binary.LittleEndian.PutUint64(b[32:], key)
		binary.LittleEndian.PutUint64(b[40:], engine.AddrOf(g))
		return b
	}
	for i := range conns {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close() })
		_ = c.(*net.TCPConn).SetReadBuffer(4 << 10) // and never read
		if _, err := c.Write(append(hello(fmt.Sprintf("greedy:%d", i+1)), readFrame()...)); err != nil {
			t.Fatal(err)
		}
	}
	// Each READ is either staged (and held) or refused.
	if !waitUntil(20*time.Second, func() bool {
		st := owner.Stats()
		return st.StagingInUse+int64(st.OwnerRefused) >= conns
	}) {
		t.Fatalf("the READs were neither staged nor refused: %+v", owner.Stats())
	}
	if held := owner.Stats().StagingInUse * size; held > stagingBudget {
		t.Fatalf("one peer that reads nothing holds %d MiB of the owner's staging memory (%d READs of %d MiB on %d connections), over %d MiB; with TCPMaxConnsPerPeer %d it could hold %d GiB",
			held>>20, held/size, size>>20, conns, stagingBudget>>20, tcp.DefaultMaxConnsPerPeer, tcp.DefaultMaxConnsPerPeer*size>>30)
	}
}
