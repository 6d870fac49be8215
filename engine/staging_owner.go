package engine

import (
	"fmt"
	"time"

	"github.com/kvferry/kvferry/cuda"
	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
)

// reserveOwnerStage takes n bytes of the owner-side staging budget,
// waiting up to ownerStageWait for room; it reports whether it got them.
func (e *Engine) reserveOwnerStage(n int) bool {
	deadline := time.Now().Add(ownerStageWait)
	for {
		e.gpu.ownerMu.Lock()
		if e.gpu.ownerBytes+n <= ownerStageMax || e.gpu.ownerBytes == 0 {
			e.gpu.ownerBytes += n
			e.gpu.ownerMu.Unlock()
			return true
		}
		if e.gpu.ownerFreed == nil {
			e.gpu.ownerFreed = make(chan struct{})
		}
		freed := e.gpu.ownerFreed
		e.gpu.ownerMu.Unlock()
		left := time.Until(deadline)
		if left <= 0 {
			return false
		}
		select {
		case <-freed:
		case <-time.After(left):
			return false
		case <-e.closed:
			return false
		}
	}
}

// releaseOwnerStage gives n bytes of the owner-side staging budget back.
func (e *Engine) releaseOwnerStage(n int) {
	e.gpu.ownerMu.Lock()
	e.gpu.ownerBytes -= n
	if e.gpu.ownerFreed != nil {
		close(e.gpu.ownerFreed)
		e.gpu.ownerFreed = nil
	}
	e.gpu.ownerMu.Unlock()
}

// ownerStage is an admitted access to GPU memory, staged in host memory.
type ownerStage struct {
	e    *Engine
	dev  int
	addr uint64 // GPU address of the access
	buf  *stageBuf
	n    int
}

func (s *ownerStage) Fill() error {
	return s.e.gpu.drv.Copy(s.dev, cuda.DeviceToHost, memory.AddrOf(s.buf.mem), s.addr, uint64(s.n))
}

func (s *ownerStage) Flush() error {
	return s.e.gpu.drv.Copy(s.dev, cuda.HostToDevice, s.addr, memory.AddrOf(s.buf.mem), uint64(s.n))
}

// Device names the GPU memory of the access (transport.DeviceStage).
func (s *ownerStage) Device() (int, uint64) { return s.dev, s.addr }

func (s *ownerStage) Release() {
	s.e.putStage(s.buf)
	s.e.releaseOwnerStage(len(s.buf.mem))
}

// stageTarget turns an admitted target in GPU memory into one staged in
// host memory.
func (e *Engine) stageTarget(t transport.Target, r *memory.Region, a *transport.Access) (transport.Target, error) {
	dev := gpuOrdinal(r.Location)
	if dev < 0 {
		return t, nil
	}
	if _, err := e.cuda(); err != nil {
		return transport.Target{}, fmt.Errorf("%w: %w: GPU memory without the CUDA driver: %w", ErrRefused, errGPUStaging, err)
	}
	size := stageSize(int(a.Length))
	if !e.reserveOwnerStage(size) {
		e.stats.ownerStageRefused.Add(1)
		return transport.Target{}, fmt.Errorf("%w: %w: GPU staging for peers' accesses is at its bound (%d MiB)", ErrRefused, errGPUStaging, ownerStageMax>>20)
	}
	buf, err := e.getStage(dev, int(a.Length))
	if err != nil {
		e.releaseOwnerStage(size)
		return transport.Target{}, fmt.Errorf("%w: %w: %w", ErrRefused, errGPUStaging, err)
	}
	t.Mem = buf.mem[:a.Length:a.Length]
	t.Stage = &ownerStage{e: e, dev: dev, addr: a.Addr, buf: buf, n: int(a.Length)}
	return t, nil
}
