package netfault

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"strings"
	"syscall"
	"testing"

	"github.com/kvferry/kvferry/internal/childproc"
)

// Environment of the suite and of the processes it starts.
const (
	gateEnv = "KVFERRY_NETFAULT"      // "1": run the suite (make test-netfault sets it)
	hostEnv = "KVFERRY_NETFAULT_HOST" // "1": inject faults on the host's loopback even where a namespace of our own could be had
	soakEnv = "KVFERRY_NETFAULT_SOAK" // the soak's length, a Go duration ("3m"); default defaultSoak
	nsEnv   = "KVFERRY_NETFAULT_NS"   // set in the test process re-run inside its own network namespace
	roleEnv = "KVFERRY_NETFAULT_ROLE" // what a child process of the suite runs: "peer" or "janitor"
)

var (
	// skipReason, when set, is why every test of the suite skips.
	skipReason string
	// where names the loopback the faults are injected on, for the logs.
	where string
)

func TestMain(m *testing.M) {
	switch role := os.Getenv(roleEnv); role {
	case "":
	case "peer":
		os.Exit(runPeer())
	case "janitor":
		os.Exit(runJanitor())
	default:
		fmt.Fprintf(os.Stderr, "netfault: unknown %s=%q\n", roleEnv, role)
		os.Exit(2)
	}
	os.Exit(setUpAndRun(m))
}

// setUpAndRun decides whether the suite can run here and where its faults
// go, then runs the tests (or, outside the namespace, the process that runs
// them inside it) and returns the exit code.
func setUpAndRun(m *testing.M) int {
	if os.Getenv(gateEnv) != "1" {
		skipReason = "the network-fault suite drops packets and shapes lo, and measures deadlines: " +
			"it runs alone, through `make test-netfault` (" + gateEnv + "=1)"
		return m.Run()
	}
	if reason := missingTools(); reason != "" {
		skipReason = reason
		return m.Run()
	}
	switch {
	case os.Getenv(nsEnv) == "1":
		// Inside the namespace: its loopback starts down.
		if out, err := exec.Command("ip", "link", "set", "lo", "up").CombinedOutput(); err != nil {
			skipReason = fmt.Sprintf("cannot bring lo up in the suite's network namespace: %v: %s", err, bytesTrim(out))
			return m.Run()
		}
		where = "lo of the suite's own network namespace"
	case os.Getenv(hostEnv) != "1":
		code, err := runInNamespace()
		if err == nil {
			return code
		}
		fmt.Fprintf(os.Stderr, "netfault: no network namespace of our own (%v): faults go to the host's lo, and a janitor removes them\n", err)
		fallthrough
	default:
		stop, err := startJanitor()
		if err != nil {
			skipReason = fmt.Sprintf("cannot start the janitor that removes the faults whatever ends the run: %v", err)
			return m.Run()
		}
		defer stop()
		where = "the host's lo (a janitor removes the faults when the test process exits)"
	}
	if err := removeFaults(); err != nil { // what a run before us left, if anything
		skipReason = fmt.Sprintf("cannot remove earlier faults: %v", err)
		return m.Run()
	}
	if err := probeFaults(); err != nil {
		skipReason = fmt.Sprintf("cannot inject faults here: %v", err)
	}
	return m.Run()
}

// missingTools says why faults cannot be injected here, or "".
func missingTools() string {
	if uid := os.Geteuid(); uid != 0 {
		return fmt.Sprintf("needs root to change packet filtering and queueing disciplines (running as uid %d)", uid)
	}
	var missing []string
	for _, tool := range []string{"nft", "tc", "ip"} {
		if _, err := exec.LookPath(tool); err != nil {
			missing = append(missing, tool)
		}
	}
	if len(missing) > 0 {
		return fmt.Sprintf("needs %s on PATH (nftables, iproute2)", strings.Join(missing, ", "))
	}
	return ""
}

// runInNamespace runs this test binary again, with the same arguments, in
// a new network namespace, and returns its exit code. The faults the tests
// inject there (nftables rules, lo's qdisc) belong to that namespace, which
// the kernel destroys when its last process exits: nothing is left behind
// whatever ends the run (a panic, a test timeout, SIGKILL). An error means
// the process could not be started (no namespace allowed here).
func runInNamespace() (int, error) {
	exe, err := os.Executable()
	if err != nil {
		return 0, err
	}
	// Pdeathsig is tied to the thread that starts the child: keep this
	// goroutine on it until the child ended.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cmd := exec.Command(exe, os.Args[1:]...)
	cmd.Env = append(os.Environ(), nsEnv+"=1")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET, Pdeathsig: syscall.SIGKILL}
	// Signals meant for the test binary (go test sends SIGQUIT at its
	// timeout) go to the process that runs the tests.
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGQUIT)
	defer signal.Stop(sigs)
	if err := cmd.Start(); err != nil {
		return 0, err
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	for {
		select {
		case s := <-sigs:
			_ = cmd.Process.Signal(s)
		case err := <-done:
			var ee *exec.ExitError
			switch {
			case err == nil:
				return 0, nil
			case errors.As(err, &ee) && ee.ExitCode() >= 0:
				return ee.ExitCode(), nil
			default:
				fmt.Fprintf(os.Stderr, "netfault: the test process in the namespace ended: %v\n", err)
				return 1, nil
			}
		}
	}
}

// startJanitor starts the janitor: a child process that removes the
// suite's faults from the host once this process is gone, however it went
// (its stdin, a pipe only we hold, then reads EOF). stop closes the pipe
// and waits for it.
func startJanitor() (stop func(), err error) {
	return childproc.StartJanitor(roleEnv + "=janitor")
}

// runJanitor waits for its stdin to end, then removes the suite's faults.
func runJanitor() int {
	signal.Ignore(syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGQUIT, syscall.SIGPIPE)
	fmt.Println("ready")
	_, _ = io.Copy(io.Discard, os.Stdin)
	left, err := faultsPresent()
	if err == nil && left != "" {
		fmt.Fprintf(os.Stderr, "netfault janitor: the test process left %s behind; removing it\n", left)
	}
	if err := removeFaults(); err != nil {
		fmt.Fprintf(os.Stderr, "netfault janitor: %v\n", err)
		return 1
	}
	return 0
}

// requireSuite skips t when the suite cannot run here.
func requireSuite(t *testing.T) {
	t.Helper()
	if skipReason != "" {
		t.Skip(skipReason)
	}
}

func bytesTrim(b []byte) string { return strings.TrimSpace(string(b)) }
