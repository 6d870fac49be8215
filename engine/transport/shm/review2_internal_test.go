package shm

// Second hostile review of the same-host transport (branch review-shm2):
// the fixes of the first review (the lease drain that may last forever).
//
//	go test -count=1 -run 'TestReview2' ./engine/transport/shm

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
)

const review2ChildEnv = "KVF_REVIEW2_OWNER"

// TestReview2HelperOwner is not a test: run with review2ChildEnv set to an
// abstract socket name, it is an owner process that accepts one initiator,
// enters its lease for the first slice and exits inside the chunk (what a
// SIGKILL or an OOM kill of the owner does while it copies).
func TestReview2HelperOwner(t *testing.T) {
	name := os.Getenv(review2ChildEnv)
	if name == "" {
		t.Skip("helper process only")
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: name, Net: "unix"})
	if err != nil {
		fmt.Println("listen:", err)
		os.Exit(2)
	}
	fmt.Println("listening")
	c, err := ln.AcceptUnix()
	if err != nil {
		os.Exit(2)
	}
	buf := make([]byte, FrameSize+maxName)
	oob := make([]byte, unix.CmsgSpace(4))
	_, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		os.Exit(2)
	}
	msgs, _ := unix.ParseSocketControlMessage(oob[:oobn])
	fds, _ := unix.ParseUnixRights(&msgs[0])
	l, err := mapLease(fds[0])
	if err != nil {
		os.Exit(2)
	}
	if _, err := c.Write(frame(header{typ: frameHelloAck, epoch: helloAttach})); err != nil {
		os.Exit(2)
	}
	var fb [FrameSize]byte
	if err := readFull(c, fb[:]); err != nil {
		os.Exit(2)
	}
	if !l.enter() {
		os.Exit(2)
	}
	fmt.Println("entered")
	os.Exit(0) // inside the chunk: the lease word stays counted
}

// review2Owner starts the helper owner process and returns its address.
func review2Owner(t *testing.T) (string, *exec.Cmd, *bufio.Scanner) {
	t.Helper()
	boot, err := BootID()
	if err != nil {
		t.Fatal(err)
	}
	var r [8]byte
	_, _ = rand.Read(r[:])
	name := "@kvferry-review2-" + hex.EncodeToString(r[:])
	cmd := exec.Command(os.Args[0], "-test.run=^TestReview2HelperOwner$", "-test.count=1")
	cmd.Env = append(os.Environ(), review2ChildEnv+"="+name)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	sc := bufio.NewScanner(out)
	if !sc.Scan() || !strings.Contains(sc.Text(), "listening") {
		t.Fatalf("helper owner: %q", sc.Text())
	}
	return boot + name, cmd, sc
}

// TestReview2SlicesEndOnceTheOwnerExitedInsideItsChunk (promises 1 and 3,
// liveness): an owner process that dies while it is inside a chunk of our
// memory leaves the lease word counted forever. The sweep ends the path's
// slices only when the lease drains or owner.gone() says the process
// exited, and gone() is always false without a pidfd of the owner: on
// kernels before 6.5 (no SO_PEERPIDFD) with the owner in another pid
// namespace (SO_PEERCRED gives pid 0, so pidfd_open is not tried), before
// 5.3, or where seccomp denies pidfd_open. Then the slices never end, the
// batch never completes, every cancel reports ErrMemoryInUse, and a
// goroutine polls the lease every millisecond for the life of the process.
//
// With a pidfd of the owner the slices end once it exited; without one
// (forced here after the dial, as the review found it) they would not,
// which is why a path is not opened without one
// (TestReview2NoPidfdMeansNoSHMPath); the subtest shows what that prevents.
func TestReview2SlicesEndOnceTheOwnerExitedInsideItsChunk(t *testing.T) {
	for _, withPidfd := range []bool{true, false} {
		t.Run(map[bool]string{true: "with pidfd", false: "without pidfd"}[withPidfd], func(t *testing.T) {
			if !withPidfd && os.Getenv("KVFERRY_SHOW_NO_PIDFD") != "1" {
				t.Skip("what a path without a pidfd of its owner would do (slices never end); Dial refuses such a path " +
					"(TestReview2NoPidfdMeansNoSHMPath); KVFERRY_SHOW_NO_PIDFD=1 runs it")
			}
			addr, cmd, sc := review2Owner(t)
			initSide, err := New(Options{StopBound: 100 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = initSide.Close() })
			reg := memory.NewRegistry()
			reg.Watch(initSide)
			dst, _, err := memory.Alloc(64 << 10)
			if err != nil {
				t.Fatal(err)
			}
			regs, err := reg.Register([]memory.Range{{Mem: dst, Location: "cpu"}})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			tep, err := initSide.Dial(ctx, addr, "initiator")
			if err != nil {
				t.Fatal(err)
			}
			ep := tep.(*endpoint)
			if ep.owner.pidfd < 0 {
				t.Skip("no pidfd of the owner on this host: the control cannot run")
			}
			if !withPidfd {
				// As on a host where neither SO_PEERPIDFD nor pidfd_open
				// gives one (nothing runs on the endpoint yet).
				_ = unix.Close(ep.owner.pidfd)
				ep.owner.pidfd = -1
			}
			done := make(chan error, 1)
			s := &transport.Slice{Op: transport.Read, Local: dst, LocalReg: regs[0], Key: 1, Remote: 0x1000,
				Done: func(_ *transport.Slice, err error) { done <- err }}
			s.Reset()
			ep.Post([]*transport.Slice{s})
			if !sc.Scan() || sc.Text() != "entered" {
				t.Fatalf("helper owner: %q", sc.Text())
			}
			_ = cmd.Wait() // the owner process exited, inside its chunk
			// Nothing can touch dst any more: the only process that could is gone.
			select {
			case err := <-done:
				t.Logf("slice ended: %v", err)
			case <-time.After(10 * time.Second):
				t.Errorf("the slice never ended although the owner process exited (StopsUnconfirmed %d); its memory is reported in use forever",
					initSide.Stats().StopsUnconfirmed)
			}
			ctx2, cancel2 := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel2()
			if err := ep.Cancel(ctx2, nil); err != nil {
				t.Errorf("Cancel after the owner exited: %v", err)
			}
			_ = memory.Free(dst) // leaked on failure: the sweep may still run
		})
	}
}

// TestReview2NoPidfdMeansNoSHMPath: where the kernel gives no pidfd of the
// owner (no SO_PEERPIDFD and no pidfd_open, or its pid is not visible
// here), an owner that dies inside a chunk could never be told from one
// that is merely stopped, and the path's slices would never end: Dial
// refuses such a path with a connection error, and the engine takes tcp.
func TestReview2NoPidfdMeansNoSHMPath(t *testing.T) {
	owner, err := New(Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = owner.Close() })
	addr, err := owner.Listen(nil)
	if err != nil {
		t.Fatal(err)
	}
	initSide, err := New(Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = initSide.Close() })
	testNoPidfd.Store(true)
	defer testNoPidfd.Store(false)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ep, err := initSide.Dial(ctx, addr, "initiator")
	if err == nil {
		_ = ep.Close()
		t.Fatal("a path was opened without a pidfd of its owner")
	}
	if !errors.Is(err, transport.ErrConnection) {
		t.Errorf("Dial without a pidfd: %v; want an error matching transport.ErrConnection (the engine then takes tcp)", err)
	}
}
