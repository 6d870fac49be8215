package tcp

import (
	"errors"
	"io"
	"os"
	"runtime"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvferry/kvferry/engine/transport"
)

// guard is held around each non-blocking copy into or out of registered
// memory. It is never held while the goroutine waits for the socket, so a
// peer that stops mid-frame cannot stall an Unregister or an Abort.
type guard = transport.Guard

// rawConn reads and writes a socket with non-blocking syscalls, waiting in
// Go's netpoller (which honours the connection's deadlines) between them.
type rawConn struct {
	rc      syscall.RawConn
	scratch []byte   // where refused bytes are read to, and zeros are written from; made on first use
	iovLim  [][]byte // reused by writevParts
	spans   []span   // reused by writevParts
	limUser []bool   // reused by writevParts
	// beforeWait, when set, runs each time a read is about to wait for
	// the socket (not when bytes are already there): the owner arms its
	// read deadline there, so a connection that never waits pays nothing.
	beforeWait func()
}

// scratchLen is the size of a rawConn's scratch buffer.
const scratchLen = 64 << 10

func newRawConn(rc syscall.RawConn) *rawConn {
	return &rawConn{rc: rc}
}

// scratchBuf returns the scratch buffer, zeroed when zero is set. It is
// made on first use: most connections never drop or pad a payload, and an
// idle connection should cost little memory.
func (c *rawConn) scratchBuf(zero bool) []byte {
	if c.scratch == nil {
		c.scratch = make([]byte, scratchLen)
	} else if zero {
		clear(c.scratch)
	}
	return c.scratch
}

// readFull fills p from the socket.
func (c *rawConn) readFull(p []byte) error {
	_, _, _, err := c.readGuarded(p, nil, nil)
	return err
}

// maxGuardedCopy bounds the bytes one syscall copies into or out of owner
// memory under a guard: an abort or unregistration waits for copies under
// way, so this bounds that wait (under 100 us at memcpy speed). 256 KiB
// showed no better abort latency here and cost some throughput.
const maxGuardedCopy = 512 << 10

// rawIO is readv(2) or writev(2) (nr) of the non-empty parts of a, b and c
// on a non-blocking socket, where user (one of them, or nil) is the
// registered memory the copy touches under its guard.
func rawIO(nr uintptr, fd int, a, b, c, user []byte) (int, error) {
	var iov [3]unix.Iovec
	k := 0
	for _, p := range [3][]byte{a, b, c} {
		if len(p) > 0 {
			iov[k].Base = &p[0]
			iov[k].SetLen(len(p))
			k++
		}
	}
	return rawIovec(nr, fd, iov[:k], resident(user))
}

// rawWritev is writev(2) of parts like rawIO, for up to maxRawIov parts
// (the rest waits for the next call); user[i] says that parts[i] is
// registered memory.
func rawWritev(fd int, parts [][]byte, user []bool) (int, error) {
	var iov [maxRawIov]unix.Iovec
	k := 0
	// Registered parts that follow each other in memory (slices of one
	// request) are looked at together: one mincore for the run.
	res := true
	var start, n uintptr // the run of registered parts not looked at yet
	for i, p := range parts {
		if k == len(iov) {
			break
		}
		if len(p) == 0 {
			continue
		}
		iov[k].Base = &p[0]
		iov[k].SetLen(len(p))
		k++
		if !user[i] || !res {
			continue
		}
		if a := uintptr(unsafe.Pointer(&p[0])); n > 0 && a == start+n {
			n += uintptr(len(p))
		} else {
			res = residentRange(start, n)
			start, n = a, uintptr(len(p))
		}
	}
	res = res && residentRange(start, n)
	return rawIovec(unix.SYS_WRITEV, fd, iov[:k], res)
}

// maxRawIov bounds the parts of one raw writev: a gathered READ answer has
// three per READ plus the held answers.
const maxRawIov = 3*maxGatheredReads + 1

// How guarded copies make their system call. Benchmarks set copyMode to
// compare the two calls in one run; it is copyAuto otherwise.
const (
	copyAuto    = iota // RawSyscall when the memory is resident, else Syscall
	copyRaw            // always RawSyscall
	copySyscall        // always Syscall
)

var copyMode = copyAuto

// rawIovec makes readv(2) or writev(2) (nr) of iov, the copies made under a
// guard (at most maxGuardedCopy bytes, tens of microseconds).
//
// The call is made without entering the scheduler (RawSyscall) only when the
// registered memory it copies was just found resident: the goroutine keeps
// its P, so the guard around the call is left as soon as the kernel's copy
// is done. With Syscall the runtime may hand the P to another goroutine
// during a copy that runs long, and the guard then stays held until a P is
// free again (and throughput may suffer: BenchmarkGuardedSyscall compares
// the two calls). But the memory is the user's: a tensor or array that was
// allocated and never touched, memory swapped out, or a file-backed map
// faults inside the kernel's copy, and a fault may wait for a page to be
// read from disk. Under RawSyscall the goroutine keeps its P through that
// wait and cannot be stopped, so a garbage collection's stop-the-world waits
// for it and the whole process stalls; with Syscall only this copy waits.
func rawIovec(nr uintptr, fd int, iov []unix.Iovec, resident bool) (int, error) {
	if len(iov) == 0 {
		return 0, nil
	}
	call := unix.Syscall
	if copyMode == copyRaw || copyMode == copyAuto && resident {
		call = unix.RawSyscall
	}
	n, _, errno := call(nr, uintptr(fd), uintptr(unsafe.Pointer(&iov[0])), uintptr(len(iov)))
	runtime.KeepAlive(iov)
	if errno != 0 {
		return 0, errno
	}
	return int(n), nil
}

// pageSize is the unit of mincore's answer.
var pageSize = uintptr(os.Getpagesize())

// resident reports whether every page of b is in memory now, as mincore(2)
// tells: a copy into or out of b then takes no fault that waits for a disk
// (at most a soft one: a first write to a page that reads as zeros, or one
// shared copy-on-write). Pages can leave between this look and the copy;
// that window is microseconds. The look costs one short system call per
// 512 KiB (it reads page tables and touches none of b); registered parts
// that follow each other in memory are looked at in one call.
func resident(b []byte) bool {
	if len(b) == 0 {
		return true
	}
	return residentRange(uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)))
}

// residentRange is resident for the n bytes at start.
func residentRange(start, n uintptr) bool {
	var vec [maxGuardedCopy/4096 + 2]byte
	for n > 0 {
		chunk := min(n, maxGuardedCopy)
		base := start &^ (pageSize - 1)
		length := start + chunk - base
		pages := (length + pageSize - 1) / pageSize
		if pages > uintptr(len(vec)) {
			return false
		}
		_, _, errno := unix.RawSyscall(unix.SYS_MINCORE, base, length, uintptr(unsafe.Pointer(&vec[0])))
		if errno != 0 {
			return false
		}
		for _, v := range vec[:pages] {
			if v&1 == 0 {
				return false
			}
		}
		start, n = start+chunk, n-chunk
	}
	return true
}

// readGuarded fills dst from the socket, entering g around each read. Once
// g refuses, the remaining bytes are read and discarded so the stream stays
// in step; it returns how many bytes landed in dst, g's refusal and any
// socket error. Bytes past dst that the socket already holds are read into
// tail (up to its length) in the same syscall; tailN says how many.
func (c *rawConn) readGuarded(dst []byte, g guard, tail []byte) (landed, tailN int, refusal, err error) {
	for landed < len(dst) {
		d, t := dst[landed:], tail[tailN:]
		if len(d) > maxGuardedCopy {
			d, t = d[:maxGuardedCopy], nil // the tail follows the whole payload only
		}
		nd, nt, refusal, err := c.readv(d, t, g, true)
		landed += nd
		tailN += nt
		if refusal != nil {
			return landed, tailN, refusal, c.discard(len(dst) - landed)
		}
		if err != nil {
			return landed, tailN, nil, err
		}
	}
	return landed, tailN, nil, nil
}

// readv makes one non-blocking read into dst and then tail, entering g
// around it when dst is not empty. When the socket holds nothing it waits for
// it if wait is set, and otherwise returns 0, 0 and no error.
func (c *rawConn) readv(dst, tail []byte, g guard, wait bool) (nd, nt int, refusal, err error) {
	var n int
	var opErr error
	blocked := false
	pollErr := c.rc.Read(func(fd uintptr) bool {
		guarded := g != nil && len(dst) > 0
		if guarded {
			if e := g.Enter(); e != nil {
				refusal = e
				return true
			}
		}
		for {
			switch {
			case guarded:
				n, opErr = rawIO(unix.SYS_READV, int(fd), dst, tail, nil, dst)
			case len(tail) == 0:
				n, opErr = unix.Read(int(fd), dst)
			case len(dst) == 0:
				n, opErr = unix.Read(int(fd), tail)
			default:
				n, opErr = unix.Readv(int(fd), [][]byte{dst, tail})
			}
			if opErr != unix.EINTR {
				break
			}
		}
		if guarded {
			g.Leave()
		}
		if opErr == unix.EAGAIN {
			if wait {
				if c.beforeWait != nil {
					c.beforeWait()
				}
				return false
			}
			blocked = true
		}
		return true
	})
	if refusal != nil {
		return 0, 0, refusal, nil
	}
	if blocked && pollErr == nil {
		return 0, 0, nil, nil
	}
	if err := sockErr(pollErr, opErr, n); err != nil {
		return 0, 0, nil, err
	}
	nd = min(n, len(dst))
	return nd, n - nd, nil, nil
}

// discard reads and drops n bytes.
func (c *rawConn) discard(n int) error {
	for n > 0 {
		scratch := c.scratchBuf(false)
		chunk := scratch[:min(n, len(scratch))]
		var m int
		var opErr error
		rerr := c.rc.Read(func(fd uintptr) bool {
			for {
				m, opErr = unix.Read(int(fd), chunk)
				if opErr != unix.EINTR {
					break
				}
			}
			if opErr == unix.EAGAIN {
				if c.beforeWait != nil {
					c.beforeWait()
				}
				return false
			}
			return true
		})
		if err := sockErr(rerr, opErr, m); err != nil {
			return err
		}
		n -= m
	}
	return nil
}

// writeGuarded writes hdr, payload and trailer in as few syscalls as the
// socket allows, entering g around each write that reads payload. Once g
// refuses, zeros stand in for the rest of the payload so the frame stays
// whole, and the trailer (which only goes out after the whole payload) is
// not sent; it returns how many payload bytes were sent from memory, g's
// refusal and any socket error.
func (c *rawConn) writeGuarded(hdr, payload []byte, g guard, trailer ...byte) (sent int, refusal error, err error) {
	h, t := 0, 0
	var iov [3][]byte
	for h < len(hdr) || sent < len(payload) || t < len(trailer) {
		var n int
		var opErr error
		werr := c.rc.Write(func(fd uintptr) bool {
			usesPayload := sent < len(payload)
			if usesPayload && g != nil {
				if e := g.Enter(); e != nil {
					refusal = e
					return true
				}
			}
			pl, tr := payload[sent:], trailer[t:]
			if g != nil && len(pl) > maxGuardedCopy {
				pl, tr = pl[:maxGuardedCopy], nil // the trailer follows the whole payload only
			}
			parts := iov[:0]
			for _, p := range [][]byte{hdr[h:], pl, tr} {
				if len(p) > 0 {
					parts = append(parts, p)
				}
			}
			for {
				switch {
				case usesPayload && g != nil:
					n, opErr = rawIO(unix.SYS_WRITEV, int(fd), hdr[h:], pl, tr, pl)
				case len(parts) == 1:
					n, opErr = unix.Write(int(fd), parts[0])
				default:
					n, opErr = unix.Writev(int(fd), parts)
				}
				if opErr != unix.EINTR {
					break
				}
			}
			if usesPayload && g != nil {
				g.Leave()
			}
			return opErr != unix.EAGAIN
		})
		if refusal != nil {
			if h < len(hdr) {
				if err := c.finishFrame(hdr[h:], 0); err != nil {
					return sent, refusal, err
				}
			}
			return sent, refusal, c.finishFrame(nil, len(payload)-sent)
		}
		if werr != nil {
			return sent, nil, werr
		}
		if opErr != nil {
			return sent, nil, opErr
		}
		hn := min(n, len(hdr)-h)
		h += hn
		n -= hn
		pn := min(n, len(payload)-sent)
		sent += pn
		t += n - pn
	}
	return sent, nil, nil
}

// finishFrame writes the rest of a frame after a refusal: what is left of
// its header, then n zero bytes in place of the payload not sent.
func (c *rawConn) finishFrame(header []byte, n int) error {
	scratch := c.scratchBuf(true)
	if len(header) > 0 {
		if _, _, err := c.writeGuarded(header, nil, nil); err != nil {
			return err
		}
	}
	for n > 0 {
		chunk := scratch[:min(n, len(scratch))]
		if _, _, err := c.writeGuarded(nil, chunk, nil); err != nil {
			return err
		}
		n -= len(chunk)
	}
	return nil
}

// sockErr turns the results of one raw read into an error: the netpoller's
// (deadline, closed), the syscall's, or io.ErrUnexpectedEOF for a peer that
// closed mid-stream.
func sockErr(pollErr, opErr error, n int) error {
	if pollErr != nil {
		return pollErr
	}
	if opErr != nil {
		return opErr
	}
	if n == 0 {
		return io.ErrUnexpectedEOF
	}
	return nil
}

// isClosed reports whether err only says the connection was closed.
func isClosed(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, unix.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}
