package memory

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

const hugePage = 2 << 20

// Alloc maps size bytes of anonymous memory outside the Go heap, so the
// garbage collector never moves or frees it while it is registered. It tries
// 2 MiB huge pages first when size is a multiple of 2 MiB, and reports whether
// it got them; otherwise it asks the kernel for transparent huge pages.
func Alloc(size int) (mem []byte, huge bool, err error) {
	if size <= 0 {
		return nil, false, fmt.Errorf("allocate %d bytes: %w", size, ErrInvalidRange)
	}
	prot := unix.PROT_READ | unix.PROT_WRITE
	flags := unix.MAP_PRIVATE | unix.MAP_ANONYMOUS | unix.MAP_POPULATE
	if size%hugePage == 0 {
		if mem, err = unix.Mmap(-1, 0, size, prot, flags|unix.MAP_HUGETLB); err == nil {
			return mem, true, nil
		}
	}
	mem, err = unix.Mmap(-1, 0, size, prot, flags)
	if err != nil {
		return nil, false, fmt.Errorf("allocate %d bytes: mmap: %w", size, err)
	}
	if size >= hugePage {
		_ = unix.Madvise(mem, unix.MADV_HUGEPAGE) // a hint; refusal only costs TLB misses
	}
	return mem, false, nil
}

// Free unmaps memory returned by Alloc or AllocShared.
func Free(mem []byte) error {
	if ok, err := freeShared(mem); ok {
		return err
	}
	if err := unix.Munmap(mem); err != nil {
		return fmt.Errorf("free %d bytes at %#x: munmap: %w", len(mem), AddrOf(mem), err)
	}
	return nil
}

// NUMANode returns the NUMA node holding the page at the start of mem, or -1
// when the kernel cannot tell (no NUMA support, page not yet touched).
func NUMANode(mem []byte) int {
	if len(mem) == 0 {
		return -1
	}
	page := [1]uintptr{uintptr(AddrOf(mem)) &^ 4095}
	status := [1]int32{-1}
	_, _, errno := unix.Syscall6(unix.SYS_MOVE_PAGES, 0, 1,
		uintptr(unsafe.Pointer(&page[0])), 0, uintptr(unsafe.Pointer(&status[0])), 0)
	if errno != 0 || status[0] < 0 {
		return -1
	}
	return int(status[0])
}
