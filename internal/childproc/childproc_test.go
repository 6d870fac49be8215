package childproc

import (
	"bufio"
	"fmt"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"
)

const roleEnv = "CHILDPROC_TEST_ROLE" // "echo": the child of these tests

func TestMain(m *testing.M) {
	if os.Getenv(roleEnv) == "echo" {
		os.Exit(echo())
	}
	os.Exit(m.Run())
}

// echo is the child: it names a buffer, then answers each stdin line
// "<x>" with "got <x>" until stdin closes.
func echo() int {
	out := NewLineWriter(os.Stdout)
	out.Printf("ready 4096 8")
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		out.Printf("got %s", in.Text())
	}
	return 0
}

func startEcho(t *testing.T, onLine func(string)) *Proc {
	t.Helper()
	return Start(t, Config{Name: "echo", Env: []string{roleEnv + "=echo"}, KillWithParent: true, OnLine: onLine})
}

func TestChildNamesItselfAnswersLinesAndExitsWhenStdinCloses(t *testing.T) {
	p := startEcho(t, nil)
	first := p.First(t, time.Minute)
	if f := strings.Fields(first); len(f) != 3 || f[0] != "ready" {
		t.Fatalf("first line %q", first)
	}
	if addr, ok := ParseBuffer(strings.Fields(first)[1:], 8); !ok || addr != 4096 {
		t.Fatalf("ParseBuffer(%q) = %d, %v; want 4096, true", first, addr, ok)
	}
	for i := range 3 {
		if err := p.Send(fmt.Sprint(i)); err != nil {
			t.Fatal(err)
		}
		if l, want := p.Line(t, time.Minute), fmt.Sprintf("got %d", i); l != want {
			t.Fatalf("line %q, want %q", l, want)
		}
	}
	if err := p.Finish(t, time.Minute); err != nil {
		t.Fatalf("child exited: %v", err)
	}
	if _, ok := <-p.Lines(); ok {
		t.Fatal("Lines still open after the child exited")
	}
}

func TestOnLineGetsEveryLineAfterTheFirstInOrder(t *testing.T) {
	got := make(chan string, 8)
	p := startEcho(t, func(l string) { got <- l })
	if l := p.First(t, time.Minute); !strings.HasPrefix(l, "ready") {
		t.Fatalf("first line %q", l)
	}
	for _, s := range []string{"a", "b", "c"} {
		if err := p.Send(s); err != nil {
			t.Fatal(err)
		}
	}
	for _, s := range []string{"a", "b", "c"} {
		if l, ok := Receive(got, time.Minute); !ok || l != "got "+s {
			t.Fatalf("OnLine got %q (%v), want %q", l, ok, "got "+s)
		}
	}
}

func TestSignalStopReturnsOnlyOnceTheChildIsStopped(t *testing.T) {
	p := startEcho(t, nil)
	p.First(t, time.Minute)
	p.Signal(t, syscall.SIGSTOP)
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.Cmd.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	if !Stopped(b) {
		t.Fatalf("child's state after Signal(SIGSTOP): %q", b)
	}
	p.Signal(t, syscall.SIGCONT)
	if err := p.Send("x"); err != nil {
		t.Fatal(err)
	}
	if l := p.Line(t, time.Minute); l != "got x" {
		t.Fatalf("resumed child said %q", l)
	}
}

func TestWaitKilledReportsTheKill(t *testing.T) {
	p := startEcho(t, nil)
	p.First(t, time.Minute)
	p.Signal(t, syscall.SIGKILL)
	if err := p.WaitKilled(t, time.Minute); err == nil || !strings.Contains(err.Error(), "killed") {
		t.Fatalf("WaitKilled = %v, want the kill", err)
	}
}

func TestStopEndsAChildLeftStopped(t *testing.T) {
	// The subtest's cleanup resumes the child and closes its stdin.
	requireEndedByCleanup(t, func(t *testing.T, p *Proc) { p.Signal(t, syscall.SIGSTOP) })
}

// requireEndedByCleanup starts a child in a subtest, leaves it as leave
// does, and fails unless the subtest's cleanup (Stop) saw it exit cleanly.
func requireEndedByCleanup(t *testing.T, leave func(*testing.T, *Proc)) {
	t.Helper()
	var p *Proc
	t.Run("child", func(t *testing.T) {
		p = startEcho(t, nil)
		p.First(t, time.Minute)
		leave(t, p)
	})
	select {
	case <-p.Exited():
	default:
		t.Fatal("child's stdout still open after its test's cleanup")
	}
	if p.Cmd.ProcessState == nil || !p.Cmd.ProcessState.Success() {
		t.Fatalf("child's exit: %v", p.Cmd.ProcessState)
	}
}

func TestPollSeesAConditionThatComesTrueAndGivesUpOnOneThatDoesNot(t *testing.T) {
	n := 0
	if !Poll(time.Minute, time.Microsecond, func() bool { n++; return n == 3 }) || n != 3 {
		t.Fatalf("Poll returned after %d calls", n)
	}
	start := time.Now()
	if Poll(20*time.Millisecond, time.Millisecond, func() bool { return false }) {
		t.Fatal("Poll of a false condition held")
	}
	if took := time.Since(start); took < 20*time.Millisecond {
		t.Fatalf("Poll gave up after %v, before its 20ms", took)
	}
}

func TestParseBufferRefusesWhatIsNotAnAddressAndTheWantedLength(t *testing.T) {
	for _, f := range [][]string{{"1"}, {"x", "8"}, {"1", "x"}, {"1", "9"}, {"1", "8", "2"}} {
		if _, ok := ParseBuffer(f, 8); ok {
			t.Errorf("ParseBuffer(%q, 8) accepted", f)
		}
	}
}

// A test that ends without reading its child's lines must not leave
// Stop waiting forever: the reader would block handing a line on, so the
// child's stdout would never be seen to end, even once it was killed.
func TestStopEndsAChildWhoseLinesNobodyRead(t *testing.T) {
	requireEndedByCleanup(t, func(t *testing.T, p *Proc) {
		for i := range 64 { // more answers than Lines holds
			if err := p.Send(fmt.Sprint(i)); err != nil {
				t.Fatal(err)
			}
		}
	})
}

func TestStoppedReadsTheStateAfterTheCommandName(t *testing.T) {
	for stat, want := range map[string]bool{
		"12 (kv) T 1 2":      true,
		"12 (kv) t 1 2":      true,
		"12 (kv) S 1 2":      false,
		"12 (a) T (b) R 1 2": false, // a command name may hold ") T "
		"12 (a) T (b) t 1 2": true,
		"12 (kv":             false,
		"12 (kv) ":           false,
	} {
		if got := Stopped([]byte(stat)); got != want {
			t.Errorf("Stopped(%q) = %v, want %v", stat, got, want)
		}
	}
}
