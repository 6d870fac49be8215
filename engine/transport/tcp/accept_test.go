package tcp_test

import (
	"context"
	"net"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport/tcp"
	"github.com/kvferry/kvferry/engine/transport/transporttest"
)

// A peer that opens connections until the owner's process runs out of
// file descriptors makes accept fail; once they are closed the owner
// serves new connections again: a failed accept is retried, never the end
// of serving. The process's descriptor limit is lowered for the test, so
// that a few connections exhaust it.
func TestAcceptSurvivesRunningOutOfFileDescriptors(t *testing.T) {
	srv := tcp.New(tcp.Options{})
	addr, err := srv.Listen(transporttest.NewOwner(memory.NewRegistry()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	cli := tcp.New(tcp.Options{HandshakeTimeout: 2 * time.Second})
	t.Cleanup(func() { _ = cli.Close() })

	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("cannot count open file descriptors: %v", err)
	}
	var saved unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &saved); err != nil {
		t.Fatal(err)
	}
	low := saved
	low.Cur = uint64(len(fds) + 16)
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &low); err != nil {
		t.Skipf("cannot lower the descriptor limit: %v", err)
	}
	restored := false
	restore := func() {
		if !restored {
			restored = true
			if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &saved); err != nil {
				t.Errorf("restore the descriptor limit: %v", err)
			}
		}
	}
	t.Cleanup(restore)
	// Each connection costs a descriptor here and one at the owner (the
	// same process): the owner's accept runs out while the kernel still
	// completes connects into the listen backlog.
	var conns []net.Conn
	t.Cleanup(func() {
		for _, c := range conns {
			_ = c.Close()
		}
	})
	deadline := time.Now().Add(20 * time.Second)
	for srv.Stats().AcceptErrors == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("no accept failed after %d connections", len(conns))
		}
		if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
			conns = append(conns, c)
		} else {
			time.Sleep(time.Millisecond) // out of descriptors here too: poll the owner's counter
		}
	}
	for _, c := range conns {
		_ = c.Close()
	}
	conns = nil
	restore()

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ep, err := cli.Dial(ctx, addr, "initiator:1")
	if err != nil {
		t.Fatalf("after its accept failed (%d times) and the connections closed, the owner no longer serves: %v", srv.Stats().AcceptErrors, err)
	}
	_ = ep.Close()
}
