package main

import (
	"bytes"

	"strings"
	"testing"

	"github.com/kvferry/kvferry/internal/fakeverbs"
)

// topo prints what it found and exits 0 with or without GPUs and NICs; with
// the fake provider (two NICs on NUMA nodes 0 and 1) the matrix orders them
// by node.
func TestTopoPrintsAndExitsZero(t *testing.T) {
	var out bytes.Buffer
	if rc := runTopo(&out, "/sys"); rc != 0 {
		t.Fatalf("exit %d:\n%s", rc, out.String())
	}
	if !strings.Contains(out.String(), "GPUs (") || !strings.Contains(out.String(), "RDMA NICs (") {
		t.Fatalf("output:\n%s", out.String())
	}
	t.Logf("this machine:\n%s", out.String())

	cleanup := fakeverbs.UseFabric()
	defer cleanup()
	t.Setenv("KVFERRY_IBVERBS_LIBRARY", fakeverbs.Path(t))
	t.Setenv("FAKEVERBS_NUMA", "0,1")
	out.Reset()
	if rc := runTopo(&out, "/sys"); rc != 0 {
		t.Fatalf("exit %d:\n%s", rc, out.String())
	}
	t.Setenv("KVFERRY_CUDA_LIBRARY", fakeverbs.CUDAPath(t))
	out.Reset()
	if rc := runTopo(&out, "/sys"); rc != 0 {
		t.Fatalf("exit %d:\n%s", rc, out.String())
	}
	t.Logf("with the fakes:\n%s", out.String())
	for _, want := range []string{"fake0:1", "fake1:1", "cpu:1    fake1 fake0", "cpu:0    fake0 fake1",
		"cuda:0  kvferry fake GPU 0  pci 0000:20:00.0", "cuda:1  kvferry fake GPU 1  pci 0000:21:00.0",
		"cuda:0   fake0 fake1"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("want %q in:\n%s", want, out.String())
		}
	}
}
