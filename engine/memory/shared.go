package memory

import (
	"fmt"
	"sort"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// Shareable memory: allocations backed by a memfd, so that a process on the
// same host that is handed the file descriptor can map the same pages. The
// file is sealed against shrinking, so a process that maps it can never
// fault past its end (SIGBUS) because the other side truncated it.

// SharedFile describes the shareable allocation that holds a range.
type SharedFile struct {
	// ID names the allocation for as long as this process lives; an
	// allocation freed and made again at the same address gets a new one.
	ID uint64
	// FD is a duplicate of the allocation's memfd, owned by the caller
	// (who closes it); -1 when not asked for.
	FD int
	// Size is the allocation's size, the memfd's size.
	Size uint64
	// Offset is where the range asked for starts in the allocation.
	Offset uint64
}

type sharedAlloc struct {
	id   uint64
	addr uint64
	size uint64
	fd   int
}

var shared struct {
	mu     sync.RWMutex
	allocs []sharedAlloc // sorted by addr; allocations never overlap
	nextID atomic.Uint64
	hooks  map[uint64]func(id uint64)
	nextHk uint64
}

// AllocShared maps size bytes of shareable memory (a memfd sealed against
// shrinking and growing), populated, outside the Go heap. Free unmaps it
// and closes the memfd; processes that mapped it keep their view of the
// pages until they unmap it, but this process never sees them again.
func AllocShared(size int) ([]byte, error) {
	if size <= 0 {
		return nil, fmt.Errorf("allocate %d shareable bytes: %w", size, ErrInvalidRange)
	}
	fd, err := unix.MemfdCreate("kvferry-buffer", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("allocate %d shareable bytes: memfd_create: %w", size, err)
	}
	fail := func(what string, err error) ([]byte, error) {
		_ = unix.Close(fd)
		return nil, fmt.Errorf("allocate %d shareable bytes: %s: %w", size, what, err)
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		return fail("ftruncate", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		return fail("seal", err)
	}
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return fail("mmap", err)
	}
	if size >= hugePage {
		_ = unix.Madvise(mem, unix.MADV_HUGEPAGE) // honoured only where shmem huge pages are allowed
	}
	a := sharedAlloc{id: shared.nextID.Add(1), addr: AddrOf(mem), size: uint64(size), fd: fd}
	shared.mu.Lock()
	i := sort.Search(len(shared.allocs), func(i int) bool { return shared.allocs[i].addr >= a.addr })
	shared.allocs = append(shared.allocs, sharedAlloc{})
	copy(shared.allocs[i+1:], shared.allocs[i:])
	shared.allocs[i] = a
	shared.mu.Unlock()
	return mem, nil
}

// findShared returns the index of the allocation holding [addr, addr+n),
// or -1. The caller holds shared.mu.
func findShared(addr, n uint64) int {
	i := sort.Search(len(shared.allocs), func(i int) bool { return shared.allocs[i].addr+shared.allocs[i].size > addr })
	if i == len(shared.allocs) {
		return -1
	}
	a := &shared.allocs[i]
	if addr < a.addr || n > a.size || addr-a.addr > a.size-n {
		return -1
	}
	return i
}

// Shared reports the shareable allocation holding [addr, addr+n), if any.
// With dup set, FD is a duplicate of its memfd (close-on-exec) that the
// caller must close; taken under the table's lock, so a concurrent Free
// cannot hand over a descriptor number already reused.
func Shared(addr, n uint64, dup bool) (SharedFile, bool, error) {
	shared.mu.RLock()
	defer shared.mu.RUnlock()
	i := findShared(addr, n)
	if i < 0 {
		return SharedFile{FD: -1}, false, nil
	}
	a := shared.allocs[i]
	f := SharedFile{ID: a.id, FD: -1, Size: a.size, Offset: addr - a.addr}
	if dup {
		fd, err := unix.FcntlInt(uintptr(a.fd), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			return f, true, fmt.Errorf("dup the memfd of a shareable buffer: %w", err)
		}
		f.FD = fd
	}
	return f, true, nil
}

// OnSharedFree registers fn to be called with the id of each shareable
// allocation Free releases (so that a peer that mapped it can be told to
// unmap it), and returns the function that removes it. fn must not block.
func OnSharedFree(fn func(id uint64)) (remove func()) {
	shared.mu.Lock()
	if shared.hooks == nil {
		shared.hooks = map[uint64]func(uint64){}
	}
	shared.nextHk++
	k := shared.nextHk
	shared.hooks[k] = fn
	shared.mu.Unlock()
	return func() {
		shared.mu.Lock()
		delete(shared.hooks, k)
		shared.mu.Unlock()
	}
}

// freeShared drops mem's entry when it is a shareable allocation, closing
// its memfd, and reports whether it was one; the hooks are told after.
func freeShared(mem []byte) (bool, error) {
	addr := AddrOf(mem)
	shared.mu.Lock()
	i := findShared(addr, uint64(len(mem)))
	if i < 0 || shared.allocs[i].addr != addr || shared.allocs[i].size != uint64(len(mem)) {
		shared.mu.Unlock()
		return false, nil
	}
	a := shared.allocs[i]
	shared.allocs = append(shared.allocs[:i], shared.allocs[i+1:]...)
	hooks := make([]func(uint64), 0, len(shared.hooks))
	for _, h := range shared.hooks {
		hooks = append(hooks, h)
	}
	shared.mu.Unlock()
	err := unix.Munmap(mem)
	_ = unix.Close(a.fd)
	for _, h := range hooks {
		h(a.id)
	}
	if err != nil {
		return true, fmt.Errorf("free %d shareable bytes at %#x: munmap: %w", len(mem), addr, err)
	}
	return true, nil
}
