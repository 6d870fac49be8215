package shm

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// peerProc is the process at the other end of a unix connection, as the
// kernel names it (SO_PEERCRED): never as the peer says it is.
type peerProc struct {
	pid   int
	uid   uint32
	pidfd int // -1 when pidfd_open failed (then cross-memory attach is off)
}

// peerOf reads the peer's credentials and takes a pidfd on it, which tells
// when it exits (its pid may then be reused by another process). The
// kernel's own pidfd of the peer (SO_PEERPIDFD, Linux 6.5) names the very
// process that connected; pidfd_open of its pid is the fallback on older
// kernels, with the small window in which that pid could be reused.
func peerOf(c *net.UnixConn) (peerProc, error) {
	p := peerProc{pidfd: -1}
	rc, err := c.SyscallConn()
	if err != nil {
		return p, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := rc.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
		if cerr == nil {
			if pfd, err := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_PEERPIDFD); err == nil && pfd >= 0 {
				p.pidfd = pfd
			}
		}
	}); err != nil {
		return p, err
	}
	if cerr != nil {
		return p, fmt.Errorf("SO_PEERCRED: %w", cerr)
	}
	p.pid, p.uid = int(cred.Pid), cred.Uid
	if p.pidfd < 0 && p.pid > 0 {
		if fd, err := unix.PidfdOpen(p.pid, 0); err == nil {
			p.pidfd = fd
		}
	}
	if testNoPidfd.Load() && p.pidfd >= 0 {
		_ = unix.Close(p.pidfd)
		p.pidfd = -1
	}
	return p, nil
}

// testNoPidfd, set by tests only, makes peerOf find no pidfd, as on a
// kernel or under a seccomp policy that gives none.
var testNoPidfd atomic.Bool

// peerUID is the user the kernel says the peer runs as.
func peerUID(c *net.UnixConn) (uint32, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return 0, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := rc.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return 0, err
	}
	if cerr != nil {
		return 0, cerr
	}
	return cred.Uid, nil
}

// gone reports whether the peer process exited.
func (p *peerProc) gone() bool {
	if p.pidfd < 0 {
		return false
	}
	fds := []unix.PollFd{{Fd: int32(p.pidfd), Events: unix.POLLIN}}
	n, err := unix.Poll(fds, 0)
	return err == nil && n > 0
}

func (p *peerProc) close() {
	if p.pidfd >= 0 {
		_ = unix.Close(p.pidfd)
		p.pidfd = -1
	}
}

// attach copies between local and the peer's memory at remote with
// process_vm_readv (read: peer -> local) or process_vm_writev. It returns
// the bytes copied; a short count comes with the error that stopped it.
func (p *peerProc) attach(read bool, local []byte, remote uint64) (int, error) {
	if len(local) == 0 {
		return 0, nil
	}
	liov := []unix.Iovec{{Base: &local[0]}}
	liov[0].SetLen(len(local))
	riov := []unix.RemoteIovec{{Base: uintptr(remote), Len: len(local)}}
	done := 0
	for done < len(local) {
		var n int
		var err error
		if read {
			n, err = unix.ProcessVMReadv(p.pid, liov, riov, 0)
		} else {
			n, err = unix.ProcessVMWritev(p.pid, liov, riov, 0)
		}
		if err != nil {
			if errors.Is(err, unix.EINTR) {
				continue
			}
			return done, err
		}
		if n <= 0 {
			return done, fmt.Errorf("process_vm_%sv moved no byte", map[bool]string{true: "read", false: "write"}[read])
		}
		done += n
		if done == len(local) {
			break
		}
		liov[0].Base = &local[done]
		liov[0].SetLen(len(local) - done)
		riov[0].Base += uintptr(n)
		riov[0].Len -= n
	}
	return done, nil
}

// probeAttach reports whether cross-memory attach reaches the peer: it
// reads want from the peer's address with process_vm_readv. Reading and
// writing need the same permission (PTRACE_MODE_ATTACH: the same user, and
// Yama's ptrace_scope allowing it), so a read that works means both do.
func (p *peerProc) probeAttach(addr, want uint64) error {
	if p.pid <= 0 {
		return errors.New("the peer's pid is not visible here (another pid namespace)")
	}
	if p.pidfd < 0 {
		return errors.New("pidfd_open failed: the peer's exit could not be told from a reused pid")
	}
	var got uint64
	b := unsafe.Slice((*byte)(unsafe.Pointer(&got)), 8)
	if _, err := p.attach(true, b, addr); err != nil {
		return fmt.Errorf("process_vm_readv: %w (%s)", err, ptraceScope())
	}
	if got != want {
		return fmt.Errorf("process_vm_readv read %#x, the peer announced %#x: not the process it says", got, want)
	}
	return nil
}

// ptraceScope describes Yama's ptrace_scope, which decides whether one
// process may attach to another of the same user.
func ptraceScope() string {
	b, err := os.ReadFile("/proc/sys/kernel/yama/ptrace_scope")
	if err != nil {
		return "no Yama ptrace_scope"
	}
	return "Yama ptrace_scope " + strings.TrimSpace(string(b))
}

// AttachPolicy describes, for tools and logs, whether cross-memory attach
// can work between processes of this user on this host.
func AttachPolicy() string {
	b, err := os.ReadFile("/proc/sys/kernel/yama/ptrace_scope")
	if err != nil {
		return "cross-memory attach: allowed between processes of the same user (no Yama ptrace_scope)"
	}
	switch strings.TrimSpace(string(b)) {
	case "0":
		return "cross-memory attach: allowed between processes of the same user (Yama ptrace_scope 0)"
	case "1":
		return "cross-memory attach: only into descendants (Yama ptrace_scope 1); other memory than engine buffers goes over tcp"
	default:
		return "cross-memory attach: off (Yama ptrace_scope " + strings.TrimSpace(string(b)) + "); other memory than engine buffers goes over tcp"
	}
}

// BootID is the kernel's boot id: two processes see the same one only on
// the same host, since the host booted.
func BootID() (string, error) {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return "", fmt.Errorf("boot id: %w", err)
	}
	id := strings.TrimSpace(string(b))
	if len(id) == 0 || strings.ContainsAny(id, "|@ ") {
		return "", fmt.Errorf("boot id %q: unexpected", id)
	}
	return id, nil
}
