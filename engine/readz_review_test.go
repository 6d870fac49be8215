package engine_test

// Hostile review of compressed READ answers (READ_DATA_Z) against SAFETY.md
// promises 1 and 7, on the paths the existing abort and fence rows do not
// take: UnregisterMemory striking mid-snapshot, and GPU ranges, which an
// owner compressing its answers serves through serveReadZ's plain fallback
// (staging copy and write inside the guard).

import (
	"bytes"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
)

// Promise 1 (UnregisterMemory) on compressed READ answers: once
// UnregisterMemory returned, no byte the owner puts in the range reaches a
// READ admitted before it, and the READ does not complete. Each 64 KiB
// slice waits 20 ms at the owner between admission and its snapshot, so
// the unregistration strikes between the two. No unsafe row: no test
// switch turns the region's guard off.
// Passes on 8e1cb3a.
func TestReviewUnregisterMidCompressedRead(t *testing.T) {
	const size = 4 << 20
	owner := newEngineWith(t, engine.Options{Compression: "huff0", Testing: engine.Testing{ApplyDelay: 20 * time.Millisecond}})
	init := newEngineWith(t, engine.Options{SliceSize: 64 << 10})
	src := make([]byte, size)
	fillByte(src, oldByte)
	if _, err := owner.RegisterMemory(src, "cpu"); err != nil {
		t.Fatal(err)
	}
	dst := alloc(t, init, size)
	fillByte(dst, 0)
	seg := openSegment(t, init, owner.Name())
	b := submit(t, init, read(dst, seg, engine.AddrOf(src), size))
	waitFor(t, 10*time.Second, "first slices answered compressed", func() bool { return owner.Stats().CompressedSlices > 0 })
	if err := owner.UnregisterMemory(engine.AddrOf(src)); err != nil {
		t.Fatal(err)
	}
	fillByte(src, reusedByte)
	r := waitBatch(t, b, 60*time.Second)[0]
	leaked := bytes.Count(dst, []byte{reusedByte})
	t.Logf("task %v after %d bytes (%v); %d bytes written after UnregisterMemory reached the reader", r.Status, r.Transferred, r.Err, leaked)
	if leaked != 0 {
		t.Fatalf("a compressed READ admitted before UnregisterMemory read %d bytes written after it returned", leaked)
	}
	if r.Status == engine.Completed {
		t.Fatal("the READ completed although its range was unregistered in its middle")
	}
}

// Promise 1 on a GPU range of an owner that compresses its READ answers:
// serveReadZ hands staged targets to the plain path, whose staging copy
// and write run inside the guard. Each device-to-host staging copy takes
// 20 ms, so the abort strikes while slices admitted before it are still
// to be staged. Protected: Safe, and no byte the owner puts in the GPU
// range afterwards reaches the reader; unsafe (UnsafeAbort, ACK on heard):
// the same check finds them, so the test can fail. GPU answers go plain.
// Passes on 8e1cb3a (both rows).
func TestReviewAbortMidCompressedOwnersGPURead(t *testing.T) {
	needFakeGPU(t, "slow copies")
	const n, rid = 8 << 20, 67
	for _, unsafe := range []bool{false, true} {
		name := map[bool]string{false: "protected", true: "unsafe"}[unsafe]
		t.Run(name, func(t *testing.T) {
			tst := engine.Testing{UnsafeAbort: unsafe}
			owner := newEngineWith(t, gpuOpts(t, engine.Options{Compression: "huff0", Testing: tst}))
			init := newEngineWith(t, gpuOpts(t, engine.Options{SliceSize: 256 << 10, Testing: tst}))
			d, ownerGPU := gpuAlloc(t, 0, n)
			registerMemory(t, owner, ownerGPU, "cuda:0")
			gpuWrite(t, d, 0, ownerGPU, bytes.Repeat([]byte{oldByte}, n))
			dst := alloc(t, init, n)
			fillByte(dst, 0)
			seg := openSegment(t, init, owner.Name())
			if err := d.Control("delay op=cuMemcpyDtoHAsync_v2 us=20000"); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = d.Control("reset") })
			b := submit(t, init, withRID(read(dst, seg, engine.AddrOf(ownerGPU), n), rid, 0))
			waitFor(t, 10*time.Second, "first slices read", func() bool { return owner.Stats().OwnerBytesOut > 0 })
			res, err := owner.Abort(testCtx(t, 10*time.Second), rid, []string{init.Name()})
			if err != nil || !res.Safe {
				t.Fatalf("abort = %+v, %v; want Safe", res, err)
			}
			gpuWrite(t, d, 0, ownerGPU, bytes.Repeat([]byte{reusedByte}, n))
			_ = d.Control("reset")
			r := waitBatch(t, b, 60*time.Second)[0]
			leaked := bytes.Count(dst, []byte{reusedByte})
			t.Logf("task %v after %d bytes (%v); %d bytes written after Safe reached the reader; owner sent %d slices compressed",
				r.Status, r.Transferred, r.Err, leaked, owner.Stats().CompressedSlices)
			if unsafe {
				if leaked == 0 {
					t.Fatal("with the protection off no byte written after Safe reached the reader: the protected row proves nothing")
				}
				return
			}
			if leaked != 0 {
				t.Fatalf("a READ of GPU memory admitted before Abort read %d bytes written after it returned Safe", leaked)
			}
			if r.Status == engine.Completed {
				t.Error("the READ completed although the abort struck in its middle")
			}
			if c := owner.Stats().CompressedSlices; c != 0 {
				t.Errorf("%d GPU slices answered compressed; the README says GPU ranges go plain", c)
			}
		})
	}
}
