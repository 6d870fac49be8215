// Package childproc runs a test binary again as a child process and talks
// to it over its stdin and stdout, one line at a time. Tests that need two
// engines in two processes (the engine's process tests, the prefill/decode
// tests, the network-fault suite) start their peers through it: the child
// is the same binary with -test.run=^$ and an environment that tells its
// TestMain which role to play.
//
// It is test support: only _test.go files import it.
package childproc

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Config says how to start a child.
type Config struct {
	// Name is what messages call the child ("target", "prefill", "peer").
	Name string
	// Env is added to this process's environment for the child.
	Env []string
	// KillWithParent has the kernel kill the child if this process dies
	// first (a test binary killed by its timeout leaves no child behind).
	KillWithParent bool
	// OnLine, when set, is given each line after the first (which First
	// returns), in order, on the goroutine that reads the child's stdout;
	// otherwise every line is kept for First, Line and Lines.
	OnLine func(line string)
	// Lines is how many lines Lines holds before the reader waits for the
	// test to take one (default 16).
	Lines int
}

// Proc is a running child.
type Proc struct {
	// Cmd is the child's command, started.
	Cmd *exec.Cmd

	name  string
	first chan string // the first line, when OnLine takes the others
	lines chan string

	inMu  sync.Mutex
	stdin io.WriteCloser

	exited chan struct{} // its stdout ended

	doneMu sync.Mutex
	done   bool // Wait was called
}

// Start runs the test binary as a child with cfg and starts reading its
// stdout. The child's stderr is this process's: what it says on failure
// shows in the test's output, and no goroutine of ours copies it (the
// leak checks count goroutines). When the test ends the child is stopped:
// resumed if paused, its stdin closed, killed if it has not exited 10 s
// later.
func Start(t testing.TB, cfg Config) *Proc {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), cfg.Env...)
	cmd.Stderr = os.Stderr
	if cfg.KillWithParent {
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", cfg.Name, err)
	}
	n := cfg.Lines
	if n <= 0 {
		n = 16
	}
	p := &Proc{Cmd: cmd, name: cfg.Name, lines: make(chan string, n), stdin: stdin, exited: make(chan struct{})}
	if cfg.OnLine != nil {
		p.first = make(chan string, 1)
	}
	go p.read(stdout, cfg.OnLine)
	t.Cleanup(func() { p.Stop(t) })
	return p
}

func (p *Proc) read(stdout io.Reader, onLine func(string)) {
	defer close(p.exited)
	defer close(p.lines)
	sc := bufio.NewScanner(stdout)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for n := 0; sc.Scan(); n++ {
		l := sc.Text()
		switch {
		case onLine == nil:
			p.lines <- l
		case n == 0:
			p.first <- l
		default:
			onLine(l)
		}
	}
}

// First waits up to d for the child's first line (where it names itself),
// failing the test if the child exits first or d passes.
func (p *Proc) First(t testing.TB, d time.Duration) string {
	t.Helper()
	if p.first == nil {
		return p.Line(t, d)
	}
	select {
	case l := <-p.first:
		return l
	case <-p.exited:
		select {
		case l := <-p.first:
			return l
		default:
		}
		t.Fatalf("%s ended before its first line", p.name)
	case <-time.After(d):
		t.Fatalf("%s said nothing within %v", p.name, d)
	}
	return ""
}

// Lines are the child's lines not yet taken by First or Line, when
// Config.OnLine is not set; the channel is closed once the child's stdout
// ends.
func (p *Proc) Lines() <-chan string { return p.lines }

// Line waits up to d for the next line on Lines, failing the test if the
// child's stdout ends first or d passes.
func (p *Proc) Line(t testing.TB, d time.Duration) string {
	t.Helper()
	select {
	case l, ok := <-p.lines:
		if !ok {
			t.Fatalf("%s ended early", p.name)
		}
		return l
	case <-time.After(d):
		t.Fatalf("%s said nothing within %v", p.name, d)
	}
	return ""
}

// Exited is closed once the child's stdout has ended (it exited, or closed
// stdout) and every line was handed on.
func (p *Proc) Exited() <-chan struct{} { return p.exited }

// Send writes line and a newline to the child's stdin, in one write.
func (p *Proc) Send(line string) error {
	p.inMu.Lock()
	defer p.inMu.Unlock()
	_, err := io.WriteString(p.stdin, line+"\n")
	return err
}

// CloseStdin closes the child's stdin: the children of these tests end
// their work and exit when it closes.
func (p *Proc) CloseStdin() {
	p.inMu.Lock()
	defer p.inMu.Unlock()
	_ = p.stdin.Close()
}

// Finish closes the child's stdin, waits up to d for its stdout to end,
// failing the test if it does not, and returns how the child exited.
func (p *Proc) Finish(t testing.TB, d time.Duration) error {
	t.Helper()
	p.CloseStdin()
	if !p.exitedWithin(d) {
		t.Fatalf("%s still running %v after its stdin closed", p.name, d)
	}
	return p.wait()
}

// exitedWithin reports whether the child's stdout ends within d.
func (p *Proc) exitedWithin(d time.Duration) bool {
	select {
	case <-p.exited:
		return true
	case <-time.After(d):
		return false
	}
}

// WaitKilled waits up to d for a child sent SIGKILL to be gone, failing
// the test if it is still running, and returns how it exited.
func (p *Proc) WaitKilled(t testing.TB, d time.Duration) error {
	t.Helper()
	if !p.exitedWithin(d) {
		t.Fatalf("killed %s still running %v later", p.name, d)
	}
	return p.wait()
}

// Stop ends the child if Finish did not: resumes it (it may be paused),
// closes its stdin, and kills it if it has not exited 10 s later. Lines
// nobody took are read and dropped meanwhile: the reader would otherwise
// block handing one on, and the child's stdout would never be seen to end.
func (p *Proc) Stop(t testing.TB) {
	p.doneMu.Lock()
	done := p.done
	p.doneMu.Unlock()
	if done {
		return
	}
	go func() {
		for range p.lines {
		}
	}()
	_ = p.Cmd.Process.Signal(syscall.SIGCONT)
	p.CloseStdin()
	if !p.exitedWithin(10 * time.Second) {
		t.Errorf("%s %d did not exit within 10s of its stdin closing; killing it", p.name, p.Cmd.Process.Pid)
		_ = p.Cmd.Process.Kill()
		if !p.exitedWithin(10 * time.Second) {
			// Something else holds its stdout (a child of its own, or an
			// OnLine that blocks): the kill is done, Wait reaps it.
			t.Errorf("%s %d: stdout still open 10s after the kill", p.name, p.Cmd.Process.Pid)
		}
	}
	_ = p.wait()
}

func (p *Proc) wait() error {
	p.doneMu.Lock()
	defer p.doneMu.Unlock()
	if p.done {
		return nil
	}
	p.done = true
	return p.Cmd.Wait()
}

// Signal sends sig to the child. For SIGSTOP it waits until the kernel
// shows the child stopped, so that nothing the child does afterwards can be
// mistaken for what it did before.
func (p *Proc) Signal(t testing.TB, sig syscall.Signal) {
	t.Helper()
	if err := p.Cmd.Process.Signal(sig); err != nil {
		t.Fatalf("signal %v: %v", sig, err)
	}
	if sig != syscall.SIGSTOP {
		return
	}
	stat := fmt.Sprintf("/proc/%d/stat", p.Cmd.Process.Pid)
	var err error
	stopped := Poll(5*time.Second, time.Millisecond, func() bool {
		var b []byte
		if b, err = os.ReadFile(stat); err != nil {
			return true
		}
		return Stopped(b)
	})
	if err != nil {
		t.Fatal(err)
	}
	if !stopped {
		t.Fatalf("%s did not stop within 5s", p.name)
	}
}

// Stopped reports whether stat, the contents of /proc/<pid>/stat, shows
// the process stopped: by a signal ('T'), or in a tracing stop ('t', where
// a debugger or tracer holds the stopped child).
func Stopped(stat []byte) bool {
	// The state follows the command name, which is in parentheses.
	i := bytes.LastIndexByte(stat, ')')
	return i >= 0 && i+2 < len(stat) && (stat[i+2] == 'T' || stat[i+2] == 't')
}

// Poll calls cond every interval until it holds or d has passed, and
// reports whether it held. cond is called at least once.
func Poll(d, interval time.Duration, cond func() bool) bool {
	for end := time.Now().Add(d); ; time.Sleep(interval) {
		if cond() {
			return true
		}
		if time.Now().After(end) {
			return false
		}
	}
}

// ParseBuffer parses the "<address> <length>" fields with which a child
// names its registered buffer, and reports whether they are two numbers
// and the length is want.
func ParseBuffer(fields []string, want int) (addr uint64, ok bool) {
	if len(fields) != 2 {
		return 0, false
	}
	addr, err := strconv.ParseUint(fields[0], 10, 64)
	if err != nil {
		return 0, false
	}
	n, err := strconv.Atoi(fields[1])
	return addr, err == nil && n == want
}

// Receive waits up to d for a value on ch; ok is false when d passed
// first or ch was closed.
func Receive[T any](ch <-chan T, d time.Duration) (v T, ok bool) {
	select {
	case v, ok = <-ch:
		return v, ok
	case <-time.After(d):
		return v, false
	}
}

// LineWriter writes whole lines to a child's stdout from many goroutines:
// each line reaches the parent in one piece and at once.
type LineWriter struct {
	mu sync.Mutex
	w  *bufio.Writer
}

// NewLineWriter returns a LineWriter on w (a child's os.Stdout).
func NewLineWriter(w io.Writer) *LineWriter { return &LineWriter{w: bufio.NewWriter(w)} }

// Printf writes one line, format and a newline, and flushes it.
func (o *LineWriter) Printf(format string, args ...any) {
	o.mu.Lock()
	defer o.mu.Unlock()
	fmt.Fprintf(o.w, format+"\n", args...)
	_ = o.w.Flush()
}

// StartJanitor runs the test binary again as a janitor: a child, in a
// process group of its own (a Ctrl-C that ends the test must not end it
// before it cleaned up), that says "ready" once it is set up and cleans up
// when its stdin ends, which happens when stop is called or this process
// dies, however. env is added to this process's environment for it (the
// role its TestMain reads). It is not tied to a testing.TB: TestMain
// starts it, before any test.
func StartJanitor(env ...string) (stop func(), err error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), env...)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	ready := make(chan string, 1)
	go func() {
		l, _ := bufio.NewReader(out).ReadString('\n')
		ready <- l
	}()
	select {
	case l := <-ready:
		if l != "ready\n" {
			_ = in.Close()
			_ = cmd.Wait()
			return nil, fmt.Errorf("janitor said %q", l)
		}
	case <-time.After(30 * time.Second):
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return nil, fmt.Errorf("janitor not ready within 30s")
	}
	return func() {
		_ = in.Close()
		_ = cmd.Wait()
	}, nil
}
