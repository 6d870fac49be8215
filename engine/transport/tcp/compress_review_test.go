package tcp_test

// Hostile review of WRITE_Z (compress.go): what a peer can make the owner
// hold, and whether WRITE_Z mixes with the read-ahead buffer.

import (
	"bytes"
	"runtime"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/kvcodec"
	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport/tcp"
	"github.com/kvferry/kvferry/engine/transport/transporttest"
)

// heapAllocated is the bytes allocated by this process so far.
func heapAllocated() uint64 {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.TotalAlloc
}

// A WRITE_Z header alone (64 bytes, no payload, a key and address that name
// nothing) makes the owner allocate the frame's whole declared length
// before one payload byte or the access was checked: serveWriteZ takes the
// budget and getZBuf(n) before reading, and before Admit. A plain WRITE
// admits first and reads straight into owner memory, allocating nothing.
// FAILS on a666369: about 64 MiB allocated per such header.
func TestReviewWriteZHeaderAloneAllocatesNothing(t *testing.T) {
	// The owner holds admission: a frame it reached admission with is
	// seen waiting there (before the fix the block was allocated, and the
	// payload waited for, before admission: the wait below then fails).
	owner := transporttest.NewOwner(memory.NewRegistry())
	release := owner.Hold()
	defer release()
	_, addr := ownerWith(t, tcp.Options{}, owner)
	c := dialFrom(t, addr, "")
	sayHelloCompressed(t, c, "hdr:1")
	enc, _ := kvcodec.NewEncoder(kvcodec.CodecHuff0)
	blockHdr, _ := enc.Encode(nil, make([]byte, tcp.MaxCompressedSlice), 1)
	runtime.GC()
	before := heapAllocated()
	// The frame and its block's 8-byte header (declaring 4 MiB), no more.
	f := append(rawFrame(frameWriteZ, 1, tcp.MaxCompressedSlice, 12345, 4096), blockHdr[:8]...)
	if _, err := c.Write(f); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the owner at admission of the block", func() bool { return owner.Waiting.Load() == 1 })
	if grew := heapAllocated() - before; grew > 2<<20 {
		t.Fatalf("a WRITE_Z naming no registered memory made the owner allocate %d MiB before its access was checked", grew>>20)
	}
}

// Four peers' WRITE_Z headers (256 bytes in all, naming no registered
// memory, sending no payload) pin the whole 256 MiB decoding budget for
// their frame deadlines (FrameTimeout + 64 MiB at MinRate: 74 s by
// default); every other peer's compressed WRITE, valid and admissible, is
// then refused after 1 s with statusRefused, which is final for its
// request. FAILS on a666369: the legitimate block is answered status 4.
func TestReviewWriteZBudgetCannotBePinnedByHeadersAlone(t *testing.T) {
	const size = 1 << 20
	mem := make([]byte, size)
	reg := memory.NewRegistry()
	regs, err := reg.Register([]memory.Range{{Mem: mem}})
	if err != nil {
		t.Fatal(err)
	}
	srv, addr := ownerWith(t, tcp.Options{}, transporttest.NewOwner(reg))
	enc, _ := kvcodec.NewEncoder(kvcodec.CodecHuff0)
	blockHdr, _ := enc.Encode(nil, make([]byte, tcp.MaxCompressedSlice), 1)
	for i := 0; i < 4; i++ {
		c := dialFrom(t, addr, "")
		sayHelloCompressed(t, c, "squatter:1")
		// A 64 MiB frame whose block declares 4 MiB, and no more bytes.
		if _, err := c.Write(append(rawFrame(frameWriteZ, 1, tcp.MaxSliceLength, 999, 4096), blockHdr[:8]...)); err != nil {
			t.Fatal(err)
		}
	}
	// Every squatter's frame was looked at (refused as malformed: a block
	// larger than it declares) before the honest peer writes; before the
	// fix they held the budget instead, and this wait fails.
	waitFor(t, 10*time.Second, "the squatters' frames refused", func() bool { return srv.Stats().CompressedMalformed == 4 })
	c := dialFrom(t, addr, "")
	sayHelloCompressed(t, c, "honest:1")
	data := bytes.Repeat([]byte{1, 2, 3, 4}, size/4)
	block, _ := enc.Encode(nil, data, 2)
	if _, err := c.Write(append(rawFrame(frameWriteZ, 1, uint32(len(block)), regs[0].Key, memory.AddrOf(mem)), block...)); err != nil {
		t.Fatal(err)
	}
	a := readAck(t, c, 4, 1)
	if a.status != 0 || a.done != size {
		t.Fatalf("an honest peer's valid compressed WRITE was answered status %d, %d bytes (final for its request), because four idle headers hold the budget (stats %+v)",
			a.status, a.done, srv.Stats())
	}
}

// Regression (passes on a666369): READ headers read ahead with a WRITE_Z
// header and part of its block; the owner takes the buffered block bytes
// first, the block lands whole, and the READs are answered.
func TestReviewWriteZAfterReadAheadLands(t *testing.T) {
	const size = 256 << 10
	mem := make([]byte, size)
	reg := memory.NewRegistry()
	regs, err := reg.Register([]memory.Range{{Mem: mem}})
	if err != nil {
		t.Fatal(err)
	}
	_, addr := ownerWith(t, tcp.Options{}, transporttest.NewOwner(reg))
	c := dialFrom(t, addr, "")
	sayHelloCompressed(t, c, "mix:1")
	enc, _ := kvcodec.NewEncoder(kvcodec.CodecS2)
	data := bytes.Repeat([]byte{9, 8, 7, 6, 5, 4, 3, 2}, size/8)
	block, _ := enc.Encode(nil, data, 2)
	var f []byte
	f = append(f, rawFrame(5, 1, 4096, regs[0].Key, memory.AddrOf(mem))...)
	f = append(f, rawFrame(5, 2, 4096, regs[0].Key, memory.AddrOf(mem))...)
	f = append(f, rawFrame(frameWriteZ, 3, uint32(len(block)), regs[0].Key, memory.AddrOf(mem))...)
	f = append(f, block...)
	if _, err := c.Write(f); err != nil {
		t.Fatal(err)
	}
	got := readAnswers(t, c, 2)
	for i, g := range got {
		if g.status != 0 {
			t.Fatalf("READ %d: status %d", i+1, g.status)
		}
	}
	if a := readAck(t, c, 4, 3); a.status != 0 || a.done != size {
		t.Fatalf("WRITE_Z after READs: status %d, %d bytes", a.status, a.done)
	}
	// Inside the region's guard, as the owner wrote: the race detector
	// sees no order through the socket, only through the guard.
	if err := regs[0].Enter(); err != nil {
		t.Fatal(err)
	}
	landed := bytes.Equal(mem, data)
	regs[0].Leave()
	if !landed {
		t.Fatal("WRITE_Z after READs did not land as sent")
	}
}
