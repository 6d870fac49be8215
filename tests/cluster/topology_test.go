package cluster

import (
	"bufio"
	"errors"
	"fmt"
	"io"
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

const (
	nodePort = 7000
	etcdPort = 2379
	pageSize = 256 << 10
)

// etcdBin is the etcd server the meta host runs (etcdtest.Binary).
var etcdBin string

// topo is the simulated cluster: its namespaces, addresses and processes.
type topo struct {
	t      *testing.T
	prefix string // of every namespace of this run
	net    string // "10.77.X"
	dir    string // etcd's data, the node binary
	bin    string // the node program
	sw     string // the switch namespace, holding the bridge
	meta   string // the namespace etcd runs in
	metaIP string
	hosts  []*host
	etcd   *exec.Cmd
	etcdMu sync.Mutex
}

// host is one simulated machine: a namespace with one veth, its eth0.
type host struct {
	ns, ip, role string
	idx          int // among the hosts of its role
	node         *nodeProc
}

func (h *host) name() string { return fmt.Sprintf("%s%d", h.role[:1], h.idx) } // "p0", "d3"
func (h *host) seg() string  { return fmt.Sprintf("%s:%d", h.ip, nodePort) }

// run runs a command and returns its error with its output.
func run(args ...string) error {
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// pickSubnet chooses X of 10.77.X.0/24 among those the host has no address
// or route in (the namespaces would not clash with it anyway; this keeps
// a reader of `ip route` from being misled).
func pickSubnet() string {
	out, _ := exec.Command("ip", "-4", "route", "show", "table", "all").Output()
	addrs, _ := exec.Command("ip", "-4", "addr").Output()
	used := string(out) + string(addrs)
	for x := 100 + os.Getpid()%100; ; x = 100 + (x-99)%150 {
		n := fmt.Sprintf("10.77.%d", x)
		if !strings.Contains(used, n+".") {
			return n
		}
	}
}

// newTopo builds the namespaces, the bridge and the veths, starts etcd and
// builds the node program. Everything goes at the end of the test, and by
// the janitor if the test process dies first.
func newTopo(t *testing.T, nHosts int) *topo {
	dir, err := os.MkdirTemp("", "kvferry-cluster-")
	if err != nil {
		t.Fatal(err)
	}
	tp := &topo{t: t, prefix: fmt.Sprintf("%s%d-", nsPrefix, os.Getpid()), net: pickSubnet(), dir: dir}
	stop, err := startJanitor(tp.prefix, dir)
	if err != nil {
		_ = os.RemoveAll(dir)
		t.Skipf("cannot start the janitor that removes the cluster however the run ends: %v", err)
	}
	t.Cleanup(func() {
		tp.stopAll()
		removeRun(tp.prefix)
		_ = os.RemoveAll(dir)
		stop()
		for _, ns := range listNS() {
			if strings.HasPrefix(ns, tp.prefix) {
				t.Errorf("namespace %s left behind", ns)
			}
		}
	})

	tp.bin = filepath.Join(dir, "node")
	build := exec.Command("go", "build", "-o", tp.bin, "github.com/kvferry/kvferry/tests/cluster/node")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the node program: %v: %s", err, out)
	}

	tp.sw = tp.prefix + "sw"
	if err := run("ip", "netns", "add", tp.sw); err != nil {
		t.Skipf("cannot create network namespaces here: %v", err)
	}
	must := func(args ...string) {
		t.Helper()
		if err := run(args...); err != nil {
			t.Fatal(err)
		}
	}
	must("ip", "-n", tp.sw, "link", "add", "br0", "type", "bridge")
	must("ip", "-n", tp.sw, "link", "set", "br0", "up")
	addHost := func(ns, ip string, port int) {
		must("ip", "netns", "add", ns)
		must("ip", "-n", ns, "link", "set", "lo", "up")
		p := fmt.Sprintf("p%d", port)
		must("ip", "-n", tp.sw, "link", "add", p, "type", "veth", "peer", "name", "eth0", "netns", ns)
		must("ip", "-n", tp.sw, "link", "set", p, "master", "br0", "up")
		must("ip", "-n", ns, "addr", "add", ip+"/24", "dev", "eth0")
		must("ip", "-n", ns, "link", "set", "eth0", "up")
	}
	tp.meta = tp.prefix + "meta"
	tp.metaIP = tp.net + ".250"
	addHost(tp.meta, tp.metaIP, 250)
	for i := 0; i < nHosts; i++ {
		role, idx := "prefill", i
		if i >= nHosts/2 {
			role, idx = "decode", i-nHosts/2
		}
		h := &host{ns: fmt.Sprintf("%sh%d", tp.prefix, i), ip: fmt.Sprintf("%s.%d", tp.net, 10+i), role: role, idx: idx}
		addHost(h.ns, h.ip, i)
		tp.hosts = append(tp.hosts, h)
	}
	tp.startEtcd()
	return tp
}

func (tp *topo) metadataURL() string {
	return fmt.Sprintf("etcd://%s:%d/%s", tp.metaIP, etcdPort, strings.TrimSuffix(tp.prefix, "-"))
}

// startEtcd runs etcd in the meta namespace (its data in the run's
// directory, kept across restarts) and waits until it takes connections.
func (tp *topo) startEtcd() {
	t := tp.t
	t.Helper()
	client := fmt.Sprintf("http://%s:%d", tp.metaIP, etcdPort)
	peer := "http://127.0.0.1:2380"
	cmd := exec.Command("ip", "netns", "exec", tp.meta, etcdBin, "--name", "meta",
		"--data-dir", filepath.Join(tp.dir, "etcd"),
		"--listen-client-urls", client, "--advertise-client-urls", client,
		"--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
		"--initial-cluster", "meta="+peer, "--logger", "zap", "--log-level", "error")
	cmd.Stdout, cmd.Stderr = io.Discard, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start etcd: %v", err)
	}
	go func() { _ = cmd.Wait() }()
	tp.etcdMu.Lock()
	tp.etcd = cmd
	tp.etcdMu.Unlock()
	addr := fmt.Sprintf("%s:%d", tp.metaIP, etcdPort)
	deadline := time.Now().Add(30 * time.Second)
	for !tp.dialFrom(tp.meta, addr) {
		if time.Now().After(deadline) {
			t.Fatalf("etcd does not take connections at %s within 30 s", addr)
		}
		time.Sleep(50 * time.Millisecond) // polling etcd's port: the condition itself is awaited
	}
}

// killEtcd kills etcd (SIGKILL: no goodbye to its clients).
func (tp *topo) killEtcd() {
	tp.etcdMu.Lock()
	defer tp.etcdMu.Unlock()
	if tp.etcd != nil {
		_ = tp.etcd.Process.Kill()
		tp.etcd = nil
	}
}

// dialFrom reports whether a TCP connection to addr opens from inside ns.
func (tp *topo) dialFrom(ns, addr string) bool {
	exe, err := os.Executable()
	if err != nil {
		return false
	}
	cmd := exec.Command("ip", "netns", "exec", ns, exe, "-test.run=^$", addr)
	cmd.Env = append(os.Environ(), roleEnv+"=dial")
	return cmd.Run() == nil
}

func (tp *topo) stopAll() {
	for _, h := range tp.hosts {
		if h.node != nil {
			h.node.kill()
		}
	}
	tp.killEtcd()
}

func (tp *topo) of(role string) []*host {
	var hs []*host
	for _, h := range tp.hosts {
		if h.role == role {
			hs = append(hs, h)
		}
	}
	return hs
}

// Faults. Each lives in the host's own namespace (an nftables table, a
// qdisc on its eth0), so it goes with the namespace whatever ends the run.

// cutLink drops every packet in and out of h's eth0.
func (tp *topo) cutLink(h *host) error {
	return tp.nft(h, `table inet kvfc_cut {
  chain in { type filter hook input priority -10; policy accept; iifname "eth0" drop; }
  chain out { type filter hook output priority -10; policy accept; oifname "eth0" drop; }
}`)
}

func (tp *topo) healLink(h *host) error {
	return run("ip", "netns", "exec", h.ns, "nft", "delete", "table", "inet", "kvfc_cut")
}

// addLoss drops pct percent of the packets h receives on eth0, at random.
func (tp *topo) addLoss(h *host, pct int) error {
	return tp.nft(h, fmt.Sprintf(`table inet kvfc_loss {
  chain in { type filter hook input priority -10; policy accept; iifname "eth0" numgen random mod 100 < %d drop; }
}`, pct))
}

func (tp *topo) removeLoss(h *host) error {
	return run("ip", "netns", "exec", h.ns, "nft", "delete", "table", "inet", "kvfc_loss")
}

func (tp *topo) nft(h *host, ruleset string) error {
	cmd := exec.Command("ip", "netns", "exec", h.ns, "nft", "-f", "-")
	cmd.Stdin = strings.NewReader(ruleset)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("nft in %s: %v: %s", h.ns, err, strings.TrimSpace(string(out)))
	}
	return nil
}

// shape limits what h sends on eth0 (tc tbf).
func (tp *topo) shape(h *host, rate string) error {
	return run("ip", "netns", "exec", h.ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
		"rate", rate, "burst", "256kb", "latency", "100ms")
}

func (tp *topo) unshape(h *host) error {
	return run("ip", "netns", "exec", h.ns, "tc", "qdisc", "del", "dev", "eth0", "root")
}

// netemAvailable tries a netem qdisc on h's eth0 (and removes it).
func (tp *topo) netemAvailable(h *host) (bool, error) {
	err := run("ip", "netns", "exec", h.ns, "tc", "qdisc", "add", "dev", "eth0", "root", "netem", "delay", "1ms")
	if err != nil {
		return false, err
	}
	_ = tp.unshape(h)
	return true, nil
}

// nodeProc is a running node program in a host's namespace; answers to its
// commands are matched by their first two words.
type nodeProc struct {
	h     *host
	cmd   *exec.Cmd
	ready string // its first line

	inMu  sync.Mutex
	stdin io.WriteCloser

	mu      sync.Mutex
	waiters map[string]chan string
	exited  chan struct{}
}

var errNodeGone = errors.New("node process gone")

// startNode runs the node program of h's role in h's namespace and waits
// for it to name itself.
func (tp *topo) startNode(h *host) (*nodeProc, error) {
	cmd := exec.Command("ip", "netns", "exec", h.ns, tp.bin, "-role", h.role, "-host", h.ip,
		"-port", strconv.Itoa(nodePort), "-metadata", tp.metadataURL())
	cmd.Stderr = os.Stderr
	// ip execs the node program in place: killing this process kills the
	// node, and so does this test process's death.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	n := &nodeProc{h: h, cmd: cmd, stdin: stdin, waiters: map[string]chan string{}, exited: make(chan struct{})}
	first := make(chan string, 1)
	go func() {
		defer func() {
			_ = cmd.Wait()
			close(n.exited)
		}()
		sc := bufio.NewScanner(stdout)
		if sc.Scan() {
			first <- sc.Text()
		}
		close(first)
		for sc.Scan() {
			l := sc.Text()
			f := strings.Fields(l)
			if len(f) < 2 {
				continue
			}
			key := f[0] + " " + f[1]
			n.mu.Lock()
			ch := n.waiters[key]
			delete(n.waiters, key)
			n.mu.Unlock()
			switch {
			case ch != nil:
				ch <- l
			case f[0] == "submitted":
				// Only fenced requests wait for it.
			default:
				fmt.Fprintf(os.Stderr, "cluster: %s said, unasked: %s\n", h.name(), l)
			}
		}
	}()
	select {
	case l, ok := <-first:
		if !ok || !strings.HasPrefix(l, "ready ") {
			n.kill()
			return nil, fmt.Errorf("node %s did not start (first line %q)", h.name(), l)
		}
		n.ready = l
	case <-time.After(30 * time.Second):
		n.kill()
		return nil, fmt.Errorf("node %s not ready within 30 s", h.name())
	}
	return n, nil
}

// ask sends line and waits up to d for the answer keyed by key.
func (n *nodeProc) ask(line, key string, d time.Duration) (string, error) {
	ch := make(chan string, 1)
	n.mu.Lock()
	n.waiters[key] = ch
	n.mu.Unlock()
	return n.send(line, key, ch, d)
}

// expect registers for a line keyed by key that no command asks for (a
// prefill's "submitted"); wait then waits for it.
func (n *nodeProc) expect(key string) chan string {
	ch := make(chan string, 1)
	n.mu.Lock()
	n.waiters[key] = ch
	n.mu.Unlock()
	return ch
}

// wait waits up to d for the line expect registered for; a line that
// never comes stays registered until the node exits.
func (n *nodeProc) wait(ch chan string, d time.Duration) (string, error) {
	select {
	case l := <-ch:
		return l, nil
	case <-n.exited:
		return "", fmt.Errorf("%s: %w", n.h.name(), errNodeGone)
	case <-time.After(d):
		return "", fmt.Errorf("%s: no line awaited within %v", n.h.name(), d)
	}
}

func (n *nodeProc) send(line, key string, ch chan string, d time.Duration) (string, error) {
	n.inMu.Lock()
	_, err := io.WriteString(n.stdin, line+"\n")
	n.inMu.Unlock()
	if err != nil {
		return "", fmt.Errorf("%s: %w: %v", n.h.name(), errNodeGone, err)
	}
	select {
	case l := <-ch:
		return l, nil
	case <-n.exited:
		return "", fmt.Errorf("%s: %w", n.h.name(), errNodeGone)
	case <-time.After(d):
		n.mu.Lock()
		delete(n.waiters, key)
		n.mu.Unlock()
		return "", fmt.Errorf("%s: no answer to %q within %v", n.h.name(), line, d)
	}
}

// kill sends SIGKILL and waits for the process to be gone.
func (n *nodeProc) kill() {
	_ = n.cmd.Process.Kill()
	<-n.exited
}
