package engine_test

// Hostile review of compressed WRITEs (WRITE_Z) against SAFETY.md promises
// 1 and 7: Fence by range and UnregisterMemory racing WRITE_Z frames. The
// writer passes no request id; its constant source compresses to a few
// bytes a slice, so every slice goes as WRITE_Z; the owner sleeps
// ApplyDelay between admitting each block and copying it, so the fence or
// the unregistration strikes between admission and copy.

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
)

func compressedFenceRig(t *testing.T, unsafe bool, size int) (owner, init *engine.Engine, seg *engine.Segment, dst, src []byte) {
	t.Helper()
	owner = newEngineWith(t, engine.Options{Testing: engine.Testing{UnsafeFence: unsafe, ApplyDelay: 2 * time.Millisecond}})
	init = newEngineWith(t, engine.Options{Compression: "huff0", SliceSize: 64 << 10})
	dst, src = alloc(t, owner, size), alloc(t, init, size)
	seg = openSegment(t, init, owner.Name())
	return
}

// Promise 7 on WRITE_Z: protected, no byte lands after a Safe fence and the
// next transfer into the pages passes; unsafe (Testing.UnsafeFence), the
// same check finds old bytes, so the test can fail.
// Passes on a666369 (both rows).
func TestReviewFenceMidCompressedWrite(t *testing.T) {
	const size = 32 << 20
	for _, unsafe := range []bool{false, true} {
		name := map[bool]string{false: "protected", true: "unsafe"}[unsafe]
		t.Run(name, func(t *testing.T) {
			owner, init, seg, dst, src := compressedFenceRig(t, unsafe, size)
			fillByte(src, oldByte)
			old := submit(t, init, write(src, seg, engine.AddrOf(dst), size))
			waitFor(t, 10*time.Second, "first bytes landed", func() bool { return bytes.IndexByte(dst, oldByte) >= 0 })
			requireSafeFence(t, owner, dst)
			fillByte(dst, reusedByte)
			oldRes := waitBatch(t, old, 60*time.Second)[0]
			corrupt := bytes.Count(dst, []byte{oldByte})
			if init.Stats().CompressedSlices == 0 || owner.Stats().CompressedIn == 0 {
				t.Fatalf("not sent compressed: %+v", init.Stats())
			}
			t.Logf("old task %v after %d bytes (%v); %d old bytes in the reused pages", oldRes.Status, oldRes.Transferred, oldRes.Err, corrupt)
			if unsafe {
				if corrupt == 0 {
					t.Fatal("with the fence off no old byte landed: the protected row proves nothing")
				}
				return
			}
			if corrupt != 0 {
				t.Fatalf("%d bytes of a WRITE_Z planned before the fence landed after it returned Safe", corrupt)
			}
			if oldRes.Status == engine.Completed || !errors.Is(oldRes.Err, engine.ErrFenced) {
				t.Errorf("old task %v, %v; want it refused as fenced", oldRes.Status, oldRes.Err)
			}
			fillByte(src, newByte)
			transfer(t, init, 60*time.Second, write(src, seg, engine.AddrOf(dst), size))
			requireAll(t, "next compressed transfer into the fenced pages", dst, newByte)
		})
	}
}

// Promise 1 (UnregisterMemory) on WRITE_Z: once UnregisterMemory returned,
// no byte of a compressed WRITE admitted before it lands.
// Passes on a666369.
func TestReviewUnregisterMidCompressedWrite(t *testing.T) {
	const size = 16 << 20
	owner := newEngineWith(t, engine.Options{Testing: engine.Testing{ApplyDelay: 2 * time.Millisecond}})
	init := newEngineWith(t, engine.Options{Compression: "huff0", SliceSize: 64 << 10})
	dst := make([]byte, size)
	if _, err := owner.RegisterMemory(dst, "cpu"); err != nil {
		t.Fatal(err)
	}
	src := alloc(t, init, size)
	fillByte(src, oldByte)
	seg := openSegment(t, init, owner.Name())
	old := submit(t, init, write(src, seg, engine.AddrOf(dst), size))
	waitFor(t, 10*time.Second, "first bytes landed", func() bool { return bytes.IndexByte(dst, oldByte) >= 0 })
	if err := owner.UnregisterMemory(engine.AddrOf(dst)); err != nil {
		t.Fatal(err)
	}
	fillByte(dst, reusedByte)
	r := waitBatch(t, old, 60*time.Second)[0]
	if init.Stats().CompressedSlices == 0 {
		t.Fatal("not sent compressed")
	}
	if r.Status == engine.Completed {
		t.Fatalf("the WRITE completed although its target was unregistered mid-way")
	}
	requireAll(t, "unregistered range after UnregisterMemory returned", dst, reusedByte)
}
