package shm

// Hostile review of the same-host transport (branch review-shm). Each test
// names the SAFETY.md promise it attacks. Tests that fail on the code as
// reviewed are findings; the others are regression tests of attacks the
// code resists.
//
//	go test -count=1 -run 'TestHostile' ./engine/transport/shm

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/engine/transport/transporttest"
)

// hostileOwner is a real owner serving one registered buffer.
func hostileOwner(t *testing.T, opts Options) (*Transport, string, *memory.Region) {
	t.Helper()
	mem, _, err := memory.Alloc(64 << 10)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = memory.Free(mem) }) // after the owner closed
	return serveBuffer(t, opts, mem)
}

// serveBuffer registers mem with an owner of opts and serves it; the owner
// is closed when the test ends.
func serveBuffer(tb testing.TB, opts Options, mem []byte) (*Transport, string, *memory.Region) {
	tb.Helper()
	reg := memory.NewRegistry()
	regs, err := reg.Register([]memory.Range{{Mem: mem, Location: "cpu"}})
	if err != nil {
		tb.Fatal(err)
	}
	tr, err := New(opts)
	if err != nil {
		tb.Fatal(err)
	}
	addr, err := tr.Listen(transporttest.NewOwner(reg))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = tr.Close() })
	return tr, addr, regs[0]
}

// rawPeer connects to an owner as a hand-written initiator of our user and
// says HELLO properly (no probe: no cross-memory attach).
func rawPeer(t *testing.T, addr string) *net.UnixConn {
	t.Helper()
	_, name, err := splitAddr(addr)
	if err != nil {
		t.Fatal(err)
	}
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: name, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	l, fd, err := newLease()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.unmap)
	hello := frame(header{typ: frameHello, length: 7})
	_, _, err = c.WriteMsgUnix(append(hello, "hostile"...), unix.UnixRights(fd), nil)
	_ = unix.Close(fd)
	if err != nil {
		t.Fatal(err)
	}
	var ack [FrameSize]byte
	if err := readFull(c, ack[:]); err != nil {
		t.Fatalf("no HELLO_ACK: %v", err)
	}
	return c
}

// sealedMemfd makes a memfd of size bytes (sparse: no page of it is
// allocated) sealed against shrinking, as checkSealed wants.
func sealedMemfd(t *testing.T, size int64, seals int) int {
	t.Helper()
	fd, err := unix.MemfdCreate("hostile", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Close(fd) })
	if err := unix.Ftruncate(fd, size); err != nil {
		t.Fatal(err)
	}
	if seals != 0 {
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, seals); err != nil {
			t.Fatal(err)
		}
	}
	return fd
}

// TestHostileSparseShareIsNotCommittedByOwner (promise 5, "what a peer can
// make an engine spend"): a peer of our user hands the owner a sparse
// memfd that costs the peer nothing. share() maps it with MAP_POPULATE, so
// the owner allocates every page of it (charged to the owner's memory
// cgroup) and blocks in mmap meanwhile. decode/share accept up to 1<<46
// bytes (64 TiB) per SHARE and 4096 SHAREs per connection: one peer can
// have the owner commit all of the host's memory (OOM) or exhaust its
// address space (the Go runtime then dies). Shown here at 32 MiB.
func TestHostileSparseShareIsNotCommittedByOwner(t *testing.T) {
	const size = 32 << 20
	_, addr, reg := hostileOwner(t, Options{IOTimeout: 10 * time.Second})
	c := rawPeer(t, addr)
	fd := sealedMemfd(t, size, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		t.Fatal(err)
	}
	before := st.Blocks * 512
	if _, _, err := c.WriteMsgUnix(frame(header{typ: frameShare, local: 1, offset: size}), unix.UnixRights(fd), nil); err != nil {
		t.Fatal(err)
	}
	// A slice naming the share with a key the owner never issued: refused,
	// but answered only after the SHARE before it was handled.
	if _, err := c.Write(frame(header{typ: frameWrite, status: reachShared, seq: 1, length: 64, key: reg.Key + 12345, addr: reg.Addr, local: 1})); err != nil {
		t.Fatal(err)
	}
	var ans [FrameSize]byte
	_ = c.SetReadDeadline(time.Now().Add(time.Minute))
	if err := readFull(c, ans[:]); err != nil {
		t.Fatalf("no ANSWER after the SHARE (the owner dropped the connection?): %v", err)
	}
	if err := unix.Fstat(fd, &st); err != nil {
		t.Fatal(err)
	}
	committed := st.Blocks*512 - before
	if committed > 1<<20 {
		t.Errorf("the owner committed %d bytes of a sparse %d-byte share the peer never touched (MAP_POPULATE in share, owner.go): "+
			"with SHARE sizes up to 64 TiB a peer makes the owner allocate the host's memory", committed, size)
	}
}

// TestHostileShareOfAShrinkableMemfdIsRefused (regression, promise 5: no
// SIGBUS by truncation): a memfd not sealed against shrinking is refused
// and the connection dropped; a sealed one cannot be truncated under the
// owner's view afterwards.
func TestHostileShareOfAShrinkableMemfdIsRefused(t *testing.T) {
	tr, addr, _ := hostileOwner(t, Options{IOTimeout: 10 * time.Second})
	c := rawPeer(t, addr)
	fd := sealedMemfd(t, 1<<20, 0)
	if _, _, err := c.WriteMsgUnix(frame(header{typ: frameShare, local: 1, offset: 1 << 20}), unix.UnixRights(fd), nil); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(time.Minute))
	var b [FrameSize]byte
	if _, err := c.Read(b[:]); err == nil {
		t.Fatal("the owner answered after a SHARE of an unsealed memfd")
	}
	if tr.Stats().ProtocolErrors == 0 {
		t.Error("the unsealed SHARE was not counted as a protocol error")
	}
	sealed := sealedMemfd(t, 1<<20, unix.F_SEAL_SHRINK)
	if err := unix.Ftruncate(sealed, 4096); err == nil {
		t.Error("a memfd sealed against shrinking was truncated")
	}
}

// fakeOwner is a hand-written owner that completes the handshake, maps
// the initiator's lease, and serves the first slice like the real owner's
// copySlice does, but is "stopped" (SIGSTOP, cgroup freezer, a page fault
// on swapped memory) right after it entered the lease for its chunk: it
// goes on only when resume is closed.
type fakeOwner struct {
	addr    string
	entered chan header
	target  chan []byte // the initiator's buffer the slice names (same process)
	resume  chan struct{}
	done    chan struct{}
}

func startFakeOwner(t *testing.T, pattern byte) *fakeOwner {
	t.Helper()
	boot, err := BootID()
	if err != nil {
		t.Fatal(err)
	}
	var r [8]byte
	_, _ = rand.Read(r[:])
	name := "@kvferry-hostile-" + hex.EncodeToString(r[:])
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: name, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeOwner{addr: boot + name, entered: make(chan header, 1), target: make(chan []byte, 1), resume: make(chan struct{}), done: make(chan struct{})}
	t.Cleanup(func() {
		_ = ln.Close()
		select {
		case <-f.resume:
		default:
			close(f.resume)
		}
		<-f.done
	})
	go func() {
		defer close(f.done)
		c, err := ln.AcceptUnix()
		if err != nil {
			return
		}
		defer c.Close()
		buf := make([]byte, FrameSize+maxName)
		oob := make([]byte, unix.CmsgSpace(4))
		n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
		if err != nil || n < FrameSize {
			return
		}
		msgs, _ := unix.ParseSocketControlMessage(oob[:oobn])
		if len(msgs) != 1 {
			return
		}
		fds, _ := unix.ParseUnixRights(&msgs[0])
		if len(fds) != 1 {
			return
		}
		l, err := mapLease(fds[0])
		_ = unix.Close(fds[0])
		if err != nil {
			return
		}
		defer l.unmap()
		// Our pid is the initiator's: cross-memory attach reaches it.
		if _, err := c.Write(frame(header{typ: frameHelloAck, epoch: helloAttach})); err != nil {
			return
		}
		var fb [FrameSize]byte
		if err := readFull(c, fb[:]); err != nil {
			return
		}
		var h header
		if h.decode(fb[:]) != nil || h.typ != frameRead || h.status != reachAttach {
			return
		}
		if !l.enter() {
			return
		}
		f.entered <- h
		<-f.resume
		// The rest of the chunk: what process_vm_writev or the memcpy into a
		// shared view does once the owner runs again.
		dst := <-f.target
		if addrOf(dst) != h.local || len(dst) != int(h.length) {
			return
		}
		for i := range dst {
			dst[i] = pattern
		}
		l.leave()
	}()
	return f
}

// TestHostileUnregisterReturnsWhileTheOwnerIsInsideItsChunk (promise 3):
// the initiator's stop of a path waits for the owner's chunk in progress
// only StopBound long; an owner stopped inside its chunk (SIGSTOP, a
// freezer, a fault on swapped memory) then finishes it when it resumes.
// Unregister must not report the memory free meanwhile: it returns an
// error matching transport.ErrInUse, and the slice does not end (so no
// transfer reports it over) until the owner left; then it does. (As
// reviewed, Unregister returned nil and the slice ended at once.)
func TestHostileUnregisterReturnsWhileTheOwnerIsInsideItsChunk(t *testing.T) {
	const n = 64 << 10
	fo := startFakeOwner(t, 0x5a)
	initSide, err := New(Options{StopBound: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = initSide.Close() })
	initReg := memory.NewRegistry()
	initReg.Watch(initSide)
	dst, _, err := memory.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = memory.Free(dst) })
	regs, err := initReg.Register([]memory.Range{{Mem: dst, Location: "cpu"}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ep, err := initSide.Dial(ctx, fo.addr, "initiator")
	if err != nil {
		t.Fatal(err)
	}
	defer ep.Close()
	done := make(chan error, 1)
	s := &transport.Slice{Op: transport.Read, Local: dst, LocalReg: regs[0], Key: 1, Remote: 0x1000,
		Done: func(_ *transport.Slice, err error) { done <- err }}
	s.Reset()
	fo.target <- dst
	ep.Post([]*transport.Slice{s})
	select {
	case <-fo.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the fake owner never entered the lease")
	}
	_, uerr := initReg.Unregister([]uint64{regs[0].Addr})
	if !errors.Is(uerr, transport.ErrInUse) {
		t.Errorf("Unregister returned %v while the owner was inside its chunk; want an error matching transport.ErrInUse", uerr)
	}
	select {
	case err := <-done:
		t.Errorf("the slice ended (%v) while the owner could still write its memory", err)
	default:
	}
	snapshot := bytes.Clone(dst)
	close(fo.resume)
	<-fo.done
	if bytes.Equal(snapshot, dst) {
		t.Errorf("the stopped owner's chunk did not land once resumed: the scenario proves nothing")
	}
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the slice never ended after the owner left the memory")
	}
	if n := initSide.Stats().StopsUnconfirmed; n != 1 {
		t.Errorf("StopsUnconfirmed %d, want 1", n)
	}
}

// nobodyPeer starts a process of another user (nobody) that connects to
// name (abstract, without '@') and, with hello, says HELLO with a proper
// lease; it prints "ok" once connected (and, with hello, the ack's status)
// and holds the connection until its stdin closes.
func nobodyPeer(t *testing.T, name string, hello bool) (*exec.Cmd, string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to run a process of another user")
	}
	py, err := exec.LookPath("/usr/bin/python3")
	if err != nil {
		t.Skip("no /usr/bin/python3")
	}
	script := `
import os, socket, struct, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\0" + sys.argv[1])
out = "ok"
if sys.argv[2] == "1":
    fd = os.memfd_create("lease", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    import fcntl
    fcntl.fcntl(fd, 1033, 2 | 4 | 1)  # F_ADD_SEALS: shrink, grow, seal
    name = b"nobody"
    fr = struct.pack("<HBBIQQIIQQQQQQ", 0x534b, 1, 1, 0, 0, 0, 0, len(name), 0, 0, 0, 0, 0, 0)
    ack = b""
    try:
        socket.send_fds(s, [fr + name], [fd])
        while len(ack) < 80:
            b = s.recv(80 - len(ack))
            if not b:
                break
            ack += b
    except OSError:
        pass
    out = "ok status=%d" % struct.unpack("<I", ack[4:8])[0] if len(ack) == 80 else "ok closed"
sys.stdout.write(out + "\n")
sys.stdout.flush()
sys.stdin.read()
`
	cmd := exec.Command(py, "-c", script, name, map[bool]string{true: "1", false: "0"}[hello])
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Skipf("cannot start a process as nobody: %v", err)
	}
	t.Cleanup(func() {
		_ = stdin.Close()
		_ = cmd.Wait()
	})
	var line []byte
	b := make([]byte, 1)
	for {
		k, err := stdout.Read(b)
		if k == 1 && b[0] != '\n' {
			line = append(line, b[0])
			continue
		}
		if err != nil || k == 1 {
			break
		}
	}
	return cmd, string(line)
}

// TestHostileAnotherUserIsRefused (regression, promise 5): a process of
// another user that says HELLO properly gets no HELLO_ACK of success: its
// connection is closed at accept (or, were it let through, answered
// REFUSED at its HELLO), and it is counted.
func TestHostileAnotherUserIsRefused(t *testing.T) {
	tr, addr, _ := hostileOwner(t, Options{})
	_, name, _ := splitAddr(addr)
	_, got := nobodyPeer(t, name[1:], true)
	if !strings.HasPrefix(got, "ok") {
		t.Fatalf("the other user's peer said %q", got)
	}
	if got != "ok closed" && got != fmt.Sprintf("ok status=%d", statusRefused) {
		t.Errorf("another user's HELLO answered %q, want the connection closed or status %d (refused)", got, statusRefused)
	}
	if tr.Stats().RefusedPeers == 0 {
		t.Error("the other user's connection was not counted as refused")
	}
}

// TestHostileAnotherUserCannotHoldConnectionSlots (promise 5): the owner
// checks a peer's user only after its HELLO, so a process of ANOTHER user
// (abstract sockets have no permissions) that connects and says nothing
// holds one of MaxConns slots for HandshakeTimeout, and reconnecting keeps
// it: MaxConns such connections refuse every legitimate initiator of the
// host. Shown with MaxConns 1.
func TestHostileAnotherUserCannotHoldConnectionSlots(t *testing.T) {
	tr, addr, _ := hostileOwner(t, Options{MaxConns: 1, HandshakeTimeout: time.Minute})
	_, name, _ := splitAddr(addr)
	if _, got := nobodyPeer(t, name[1:], false); got != "ok" {
		t.Fatalf("the other user's peer said %q", got)
	}
	// Wait until the owner took the other user's connection, or refused it.
	if !transporttest.WaitFor(10*time.Second, func() bool { return tr.Stats().Conns != 0 || tr.Stats().RefusedPeers != 0 }) {
		t.Fatal("the owner neither took nor refused the other user's connection")
	}
	initSide, err := New(Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer initSide.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ep, err := initSide.Dial(ctx, addr, "legit")
	if err != nil {
		t.Errorf("a legitimate initiator of the owner's user was refused while a silent peer of another user held the slot "+
			"(uid checked only after HELLO, owner.go handshake; slot counted at accept, shm.go accept): %v", err)
		return
	}
	_ = ep.Close()
}
