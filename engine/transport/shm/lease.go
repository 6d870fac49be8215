package shm

import (
	"fmt"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// A lease is how an initiator stays in charge of its own memory while the
// owner copies into and out of it: one word in a page of shared memory per
// connection, which the initiator creates and hands over in HELLO. The
// owner enters the lease around each chunk it copies from or to the
// initiator's memory (never across a wait); the initiator revokes it when
// it stops the path, and then waits until no chunk is in progress, after
// which the owner touches none of its memory again on that connection.
//
// The word holds the number of chunks in progress, and leaseRevoked.
type lease struct {
	page []byte
	word *uint32
}

const (
	leaseSize    = 4096
	leaseRevoked = 1 << 31
)

// newLease creates a lease page and returns it with its memfd, which the
// caller sends to the owner and closes.
func newLease() (*lease, int, error) {
	fd, err := unix.MemfdCreate("kvferry-lease", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, -1, fmt.Errorf("lease: memfd_create: %w", err)
	}
	if err := unix.Ftruncate(fd, leaseSize); err != nil {
		_ = unix.Close(fd)
		return nil, -1, fmt.Errorf("lease: ftruncate: %w", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		_ = unix.Close(fd)
		return nil, -1, fmt.Errorf("lease: seal: %w", err)
	}
	l, err := mapLease(fd)
	if err != nil {
		_ = unix.Close(fd)
		return nil, -1, err
	}
	return l, fd, nil
}

// mapLease maps a lease page from its memfd, checking that it is one (a
// sealed file of leaseSize bytes), so that a peer cannot make us fault.
func mapLease(fd int) (*lease, error) {
	if err := checkSealed(fd, leaseSize); err != nil {
		return nil, fmt.Errorf("lease: %w", err)
	}
	page, err := unix.Mmap(fd, 0, leaseSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return nil, fmt.Errorf("lease: mmap: %w", err)
	}
	return &lease{page: page, word: (*uint32)(unsafe.Pointer(&page[0]))}, nil
}

// checkSealed checks that fd is a memfd of size bytes that can no longer
// shrink, on plain shared memory (tmpfs), so mapping size bytes of it
// never faults past its end. A hugetlbfs memfd is refused: its owner could
// punch a hole and give its huge pages back, and our next touch of the
// hole would fault (SIGBUS) where no page is left to take.
func checkSealed(fd int, size uint64) error {
	var fs unix.Statfs_t
	if err := unix.Fstatfs(fd, &fs); err != nil {
		return fmt.Errorf("fstatfs: %w", err)
	}
	if fs.Type != unix.TMPFS_MAGIC {
		return fmt.Errorf("a file on a filesystem of type %#x, not shared memory (tmpfs)", fs.Type)
	}
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return fmt.Errorf("not a sealable memfd: %w", err)
	}
	if seals&unix.F_SEAL_SHRINK == 0 {
		return fmt.Errorf("memfd not sealed against shrinking")
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("fstat: %w", err)
	}
	if st.Size < 0 || uint64(st.Size) != size {
		return fmt.Errorf("memfd of %d bytes, %d announced", st.Size, size)
	}
	return nil
}

// enter starts a chunk; it fails once the lease is revoked.
func (l *lease) enter() bool {
	if atomic.AddUint32(l.word, 1)&leaseRevoked != 0 {
		atomic.AddUint32(l.word, ^uint32(0))
		return false
	}
	return true
}

// leave ends a chunk.
func (l *lease) leave() { atomic.AddUint32(l.word, ^uint32(0)) }

// revoke stops every later chunk.
func (l *lease) revoke() { atomic.OrUint32(l.word, leaseRevoked) }

// busy reports whether a chunk is in progress.
func (l *lease) busy() bool { return atomic.LoadUint32(l.word)&^leaseRevoked != 0 }

// drain waits until no chunk is in progress, or until gone reports that the
// owner process exited (it copies nothing more then), or until bound. It
// reports whether the owner certainly touches the memory no more.
func (l *lease) drain(bound time.Duration, gone func() bool) bool {
	deadline := time.Now().Add(bound)
	for wait := time.Microsecond; l.busy(); wait = min(2*wait, time.Millisecond) {
		if gone() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(wait)
	}
	return true
}

// unmap releases the page; the lease must not be used after.
func (l *lease) unmap() {
	_ = unix.Munmap(l.page)
}
