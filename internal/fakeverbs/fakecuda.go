package fakeverbs

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
)

var (
	cudaOnce sync.Once
	cudaPath string
	cudaErr  error
)

// CUDAPath returns the fake libcuda (tests/fakecuda), built once per
// process with `make fakecuda`.
func CUDAPath(t testing.TB) string {
	t.Helper()
	cudaOnce.Do(func() {
		root := Root()
		lib := filepath.Join(root, "build", "fakecuda", "libcuda.so.1")
		out, err := exec.Command("make", "-C", root, "--no-print-directory", "-s", "fakecuda").CombinedOutput()
		if err != nil {
			cudaErr = fmt.Errorf("make fakecuda: %v\n%s", err, out)
			return
		}
		if _, err := os.Stat(lib); err != nil {
			cudaErr = fmt.Errorf("make fakecuda left no %s: %w", lib, err)
			return
		}
		cudaPath = lib
	})
	if cudaErr != nil {
		t.Fatalf("the fake libcuda: %v", cudaErr)
	}
	return cudaPath
}
