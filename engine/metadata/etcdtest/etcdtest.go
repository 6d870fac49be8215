// Package etcdtest runs a throwaway single-member etcd server for tests:
// on free loopback ports, with its data in a temporary directory, killed
// and started again on the same ports and data to play a store that goes
// away and comes back.
package etcdtest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Binary finds the etcd server: $KVFERRY_ETCD, else etcd on PATH (Debian's
// etcd-server package puts it at /usr/bin/etcd).
func Binary() (string, error) {
	if p := os.Getenv("KVFERRY_ETCD"); p != "" {
		return p, nil
	}
	if p, err := exec.LookPath("etcd"); err == nil {
		return p, nil
	}
	return "", errors.New("no etcd server (install Debian's etcd-server package, as `make deps` does, or set KVFERRY_ETCD)")
}

// Server is one etcd member.
type Server struct {
	t          testing.TB
	bin, dir   string
	clientPort int
	peerPort   int

	mu     sync.Mutex
	cmd    *exec.Cmd
	out    *os.File
	exited chan error // the member's exit status, once
}

// Start starts a member, skipping the test (with the reason) where no etcd
// server is installed, and stops it when the test ends.
func Start(t testing.TB) *Server {
	t.Helper()
	bin, err := Binary()
	if err != nil {
		t.Skip(err.Error())
	}
	s := &Server{t: t, bin: bin, dir: t.TempDir()}
	var last error
	for range 5 {
		s.clientPort, s.peerPort = freePort(t), freePort(t)
		if last = s.start(); last == nil {
			t.Cleanup(s.Kill)
			return s
		}
	}
	t.Fatalf("start etcd: %v", last)
	return nil
}

func freePort(t testing.TB) int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// Endpoint is the client address, "127.0.0.1:port".
func (s *Server) Endpoint() string { return "127.0.0.1:" + strconv.Itoa(s.clientPort) }

// URL is the engine's Metadata option for the server and prefix.
func (s *Server) URL(prefix string) string { return "etcd://" + s.Endpoint() + "/" + prefix }

func (s *Server) start() error {
	client := "http://" + s.Endpoint()
	peer := "http://127.0.0.1:" + strconv.Itoa(s.peerPort)
	out, err := os.OpenFile(filepath.Join(s.dir, "etcd.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	cmd := exec.Command(s.bin, "--name", "test", "--data-dir", filepath.Join(s.dir, "data"),
		"--listen-client-urls", client, "--advertise-client-urls", client,
		"--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
		"--initial-cluster", "test="+peer, "--log-level", "warn")
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		out.Close()
		return fmt.Errorf("start %s: %w", s.bin, err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	// Ready when its health endpoint says so; a member that exits (port
	// taken) fails at once.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for {
		if healthy(ctx, s.Endpoint()) {
			break
		}
		select {
		case err := <-exited:
			out.Close()
			log, _ := os.ReadFile(filepath.Join(s.dir, "etcd.log"))
			return fmt.Errorf("etcd exited (%v): %s", err, tail(log))
		case <-ctx.Done():
			_ = cmd.Process.Kill()
			<-exited
			out.Close()
			return errors.New("etcd not healthy within 30 s")
		case <-time.After(50 * time.Millisecond):
		}
	}
	s.mu.Lock()
	s.cmd, s.out, s.exited = cmd, out, exited
	s.mu.Unlock()
	return nil
}

func tail(b []byte) string {
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return string(b)
}

// healthy asks the member's /health endpoint once.
func healthy(ctx context.Context, endpoint string) bool {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", endpoint)
	if err != nil {
		return false
	}
	defer c.Close()
	dl, _ := ctx.Deadline()
	_ = c.SetDeadline(dl)
	if _, err := c.Write([]byte("GET /health HTTP/1.0\r\nHost: etcd\r\n\r\n")); err != nil {
		return false
	}
	body, _ := io.ReadAll(io.LimitReader(c, 4096))
	return strings.Contains(string(body), `"health":"true"`)
}

// Kill kills the member (SIGKILL), as a host that dies would; its data
// stays for Restart. Killing a killed member does nothing.
func (s *Server) Kill() {
	s.mu.Lock()
	cmd, out, exited := s.cmd, s.out, s.exited
	s.cmd, s.out, s.exited = nil, nil, nil
	s.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Kill()
	<-exited
	out.Close()
}

// Restart starts the killed member again, on the same ports and data.
func (s *Server) Restart() {
	s.t.Helper()
	var err error
	// The ports were just released; another process may have taken one
	// meanwhile, which fails the test plainly.
	for range 3 {
		if err = s.start(); err == nil {
			return
		}
	}
	s.t.Fatalf("restart etcd: %v", err)
}
