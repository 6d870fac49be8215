// Package fakeverbs finds, building them when needed, the fake libibverbs of
// tests/fakeverbs and the fake libcuda of tests/fakecuda (CUDAPath). The first is the one of
// tests/fakeverbs for tests of the rdma code on machines without an RDMA
// NIC (every CI machine). The fake is a C library with libibverbs' ABI that
// the real loader opens; its NICs live in shared memory (see its README).
package fakeverbs

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"testing"

	"github.com/kvferry/kvferry/verbs"
)

// fake is one fake library, built at most once per process.
type fake struct {
	once sync.Once
	lib  string
	err  error
}

// path builds `make target` once and returns build/<target>/<file>. A
// failed build fails the test: the fakes are part of the tree.
func (f *fake) path(t testing.TB, target, file string) string {
	t.Helper()
	f.once.Do(func() {
		root := Root()
		lib := filepath.Join(root, "build", target, file)
		out, err := exec.Command("make", "-C", root, "--no-print-directory", "-s", target).CombinedOutput()
		if err != nil {
			f.err = fmt.Errorf("make %s: %v\n%s", target, err, out)
			return
		}
		if _, err := os.Stat(lib); err != nil {
			f.err = fmt.Errorf("make %s left no %s: %w", target, lib, err)
			return
		}
		f.lib = lib
	})
	if f.err != nil {
		t.Fatalf("the fake library: %v", f.err)
	}
	return f.lib
}

var verbsLib fake

// Root is the repository root.
func Root() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..")
}

// Path returns the fake libibverbs, built once per process with `make
// fakeverbs`.
func Path(t testing.TB) string { return verbsLib.path(t, "fakeverbs", "libibverbs.so.1") }

// UseFabric points this process (and the children it starts afterwards)
// at a fake fabric of its own, named after the process, so parallel test
// processes never share NICs. Call it before the fake library is loaded;
// call cleanup when the process's tests are done: it removes the fabric's
// shared memory, unless a parent process set the fabric.
func UseFabric() (cleanup func()) {
	if v := os.Getenv("FAKEVERBS_FABRIC"); v != "" {
		return func() {} // a parent set it: share its fabric, and leave it
	}
	name := fmt.Sprintf("/kvferry-fakeverbs-test-%d", os.Getpid())
	_ = os.Setenv("FAKEVERBS_FABRIC", name)
	return func() { _ = os.Remove("/dev/shm" + name) }
}

// Control gives the fake libibverbs of this process a fault command (see
// tests/fakeverbs/README.md); the faults are reset when the test ends.
func Control(t testing.TB, cmd string) {
	t.Helper()
	lib, err := verbs.Open(Path(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := lib.Control(cmd); err != nil {
		t.Fatalf("fakeverbs_control(%q): %v", cmd, err)
	}
	t.Cleanup(func() { _ = lib.Control("reset") })
}
