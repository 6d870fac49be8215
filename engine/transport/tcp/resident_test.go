package tcp

import (
	"bytes"
	"context"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/engine/transport/transporttest"
)

// resident tells memory that a copy could fault on (mapped, never touched)
// from memory that is in place, so only the latter is copied with
// RawSyscall.
func TestResidentTellsUntouchedMemory(t *testing.T) {
	const size = 4 << 20
	populated, _, err := memory.Alloc(size)
	if err != nil {
		t.Fatal(err)
	}
	defer memory.Free(populated)
	if !resident(populated) || !resident(populated[12345:size-678]) {
		t.Error("memory mapped with MAP_POPULATE reads as not resident")
	}
	lazy, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(lazy)
	if resident(lazy) || resident(lazy[size/2:size/2+10]) {
		t.Error("memory mapped and never touched reads as resident")
	}
	for i := 0; i < size; i += 4096 {
		lazy[i] = 1
	}
	if !resident(lazy) {
		t.Error("memory touched page by page reads as not resident")
	}
	if !resident(nil) {
		t.Error("no memory at all reads as not resident")
	}
}

// Slices between memory that was mapped and never touched, on both sides,
// move whole: those copies take the Syscall path, and fault pages in.
func TestCopiesIntoAndOutOfUntouchedMemory(t *testing.T) {
	const size = 2 << 20
	lazy := func() []byte {
		m, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = unix.Munmap(m) })
		return m
	}
	owned, local := lazy(), lazy()
	oreg, oregion, lregion := transporttest.Register(t, owned, local)
	srv, cli := New(Options{}), New(Options{})
	t.Cleanup(func() { _ = cli.Close(); _ = srv.Close() })
	addr, err := srv.Listen(transporttest.NewOwner(oreg))
	if err != nil {
		t.Fatal(err)
	}
	ep, err := cli.Dial(context.Background(), addr, "lazy:1")
	if err != nil {
		t.Fatal(err)
	}
	move := func(op transport.Op, from, to int) {
		t.Helper()
		done := make(chan error, 1)
		ep.Post([]*transport.Slice{{Op: op, Local: local[from : from+size/2], LocalReg: lregion, Key: oregion.Key,
			Remote: memory.AddrOf(owned) + uint64(to), Done: func(_ *transport.Slice, err error) { done <- err }}})
		if err := <-done; err != nil {
			t.Fatalf("%v: %v", op, err)
		}
	}
	// READ untouched owner memory (zeros) into untouched local memory.
	move(transport.Read, 0, 0)
	if !bytes.Equal(local[:size/2], make([]byte, size/2)) {
		t.Fatal("READ of untouched memory did not read zeros")
	}
	// WRITE untouched local memory's second half, then a pattern, into
	// untouched owner memory.
	move(transport.Write, size/2, size/2)
	for i := range local[:size/2] {
		local[i] = byte(i * 7)
	}
	move(transport.Write, 0, size/2)
	if !bytes.Equal(owned[size/2:], local[:size/2]) {
		t.Fatal("WRITE into untouched memory did not land")
	}
}
