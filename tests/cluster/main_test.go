package cluster

import (
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/metadata/etcdtest"
	"github.com/kvferry/kvferry/internal/childproc"
)

// Environment of the test and of the processes it starts.
const (
	gateEnv   = "KVFERRY_CLUSTER"        // "1": run the test (make test-cluster sets it)
	hostsEnv  = "KVFERRY_CLUSTER_HOSTS"  // hosts of the cluster, half prefill and half decode (default 8)
	roleEnv   = "KVFERRY_CLUSTER_ROLE"   // what a child of the test binary runs: "janitor" or "dial"
	prefixEnv = "KVFERRY_CLUSTER_PREFIX" // the janitor's: the run's namespace prefix
	dirEnv    = "KVFERRY_CLUSTER_DIR"    // the janitor's: the run's temporary directory
)

// nsPrefix starts the name of every namespace of every run; the pid of the
// run's test process follows, so that a later run can tell a dead run's
// namespaces from a live one's.
const nsPrefix = "kvfc"

var staleNS = regexp.MustCompile(`^` + nsPrefix + `([0-9]+)-`)

// skipReason, when set, is why the test skips.
var skipReason string

func TestMain(m *testing.M) {
	switch role := os.Getenv(roleEnv); role {
	case "":
	case "janitor":
		os.Exit(runJanitor())
	case "dial":
		os.Exit(runDial())
	default:
		fmt.Fprintf(os.Stderr, "cluster: unknown %s=%q\n", roleEnv, role)
		os.Exit(2)
	}
	switch {
	case os.Getenv(gateEnv) != "1":
		skipReason = "the cluster test creates network namespaces, a bridge and an etcd server, injects faults " +
			"and runs for about a minute: it runs alone, through `make test-cluster` (" + gateEnv + "=1)"
	default:
		skipReason = missingTools()
	}
	if skipReason == "" {
		sweepStale()
	}
	os.Exit(m.Run())
}

// missingTools says why the cluster cannot be built here, or "".
func missingTools() string {
	if uid := os.Geteuid(); uid != 0 {
		return fmt.Sprintf("needs root to create network namespaces and packet filters (running as uid %d)", uid)
	}
	var missing []string
	for _, tool := range []string{"ip", "nft", "tc"} {
		if _, err := exec.LookPath(tool); err != nil {
			missing = append(missing, tool)
		}
	}
	if len(missing) > 0 {
		return fmt.Sprintf("needs %s (iproute2, nftables)", strings.Join(missing, ", "))
	}
	bin, err := etcdtest.Binary()
	if err != nil {
		return "needs " + err.Error()
	}
	etcdBin = bin
	return ""
}

// sweepStale removes the namespaces, and stops the processes in them, of
// runs whose test process is gone (killed before it and its janitor could
// clean up).
func sweepStale() {
	for _, ns := range listNS() {
		m := staleNS.FindStringSubmatch(ns)
		if m == nil {
			continue
		}
		pid, _ := strconv.Atoi(m[1])
		if pid > 0 && syscall.Kill(pid, 0) == syscall.ESRCH {
			fmt.Fprintf(os.Stderr, "cluster: removing namespace %s of a run that is gone\n", ns)
			removeNS(ns)
		}
	}
}

// listNS returns the names of the named network namespaces.
func listNS() []string {
	out, err := exec.Command("ip", "netns", "list").Output()
	if err != nil {
		return nil
	}
	var names []string
	for _, l := range strings.Split(string(out), "\n") {
		if f := strings.Fields(l); len(f) > 0 {
			names = append(names, f[0])
		}
	}
	return names
}

// removeNS kills the processes in ns and deletes it; the veth ends in it
// and a bridge in it go with it.
func removeNS(ns string) {
	out, _ := exec.Command("ip", "netns", "pids", ns).Output()
	for _, f := range strings.Fields(string(out)) {
		if pid, err := strconv.Atoi(f); err == nil && pid > 1 {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	_ = exec.Command("ip", "netns", "del", ns).Run()
}

// removeRun removes every namespace of the run named by prefix.
func removeRun(prefix string) {
	for _, ns := range listNS() {
		if strings.HasPrefix(ns, prefix) {
			removeNS(ns)
		}
	}
}

// startJanitor starts a child that removes the run's namespaces (and the
// processes in them) and its directory once this process is gone, however
// it went: its stdin, a pipe only we hold, then reads EOF. stop closes the
// pipe and waits for it.
func startJanitor(prefix, dir string) (stop func(), err error) {
	return childproc.StartJanitor(roleEnv+"=janitor", prefixEnv+"="+prefix, dirEnv+"="+dir)
}

func runJanitor() int {
	signal.Ignore(syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGQUIT, syscall.SIGPIPE)
	prefix, dir := os.Getenv(prefixEnv), os.Getenv(dirEnv)
	if !strings.HasPrefix(prefix, nsPrefix) {
		fmt.Fprintf(os.Stderr, "cluster janitor: refusing prefix %q\n", prefix)
		return 2
	}
	fmt.Println("ready")
	_, _ = io.Copy(io.Discard, os.Stdin)
	removeRun(prefix)
	if dir != "" {
		_ = os.RemoveAll(dir)
	}
	return 0
}

// runDial, run inside a namespace, exits 0 once it could connect to the
// address in its argument, 1 if it could not within 200 ms: the test
// process, outside every namespace, asks it whether a server there is up.
func runDial() int {
	addr := flag1()
	c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
	if err != nil {
		return 1
	}
	_ = c.Close()
	return 0
}

// flag1 is the last command-line argument (after -test.run=^$).
func flag1() string {
	if len(os.Args) < 2 {
		return ""
	}
	return os.Args[len(os.Args)-1]
}

// requireCluster skips t when the cluster cannot be built here.
func requireCluster(t *testing.T) {
	t.Helper()
	if skipReason != "" {
		t.Skip(skipReason)
	}
}
