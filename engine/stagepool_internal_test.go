package engine

import (
	"testing"

	"github.com/kvferry/kvferry/internal/fakeverbs"
)

// The staging pool keeps at most stagePoolMax bytes of page-locked buffers
// for reuse, however many large accesses came at once: the rest are freed
// when given back.
func TestStagingPoolIsCappedInBytes(t *testing.T) {
	e, err := New(Options{IgnoreEnv: true, Protocol: "tcp", CUDALibrary: fakeverbs.CUDAPath(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close() })
	if _, err := e.cuda(); err != nil {
		t.Skipf("no CUDA driver: %v", err)
	}
	const n = 64 << 20
	var bufs []*stageBuf
	for range 6 {
		b, err := e.getStage(0, n)
		if err != nil {
			t.Fatal(err)
		}
		bufs = append(bufs, b)
	}
	for _, b := range bufs {
		e.putStage(b)
	}
	e.gpu.poolMu.Lock()
	kept := e.gpu.poolBytes
	e.gpu.poolMu.Unlock()
	if kept > stagePoolMax || kept == 0 {
		t.Errorf("the pool keeps %d bytes after 6 buffers of %d were given back; want some, at most %d", kept, n, stagePoolMax)
	}
	if in := e.stats.stagingInUse.Load(); in != 0 {
		t.Errorf("%d staging buffers counted in use", in)
	}
}
