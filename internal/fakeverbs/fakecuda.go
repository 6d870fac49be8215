package fakeverbs

import "testing"

var cudaLib fake

// CUDAPath returns the fake libcuda (tests/fakecuda), built once per
// process with `make fakecuda`.
func CUDAPath(t testing.TB) string { return cudaLib.path(t, "fakecuda", "libcuda.so.1") }
