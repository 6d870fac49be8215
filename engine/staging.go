package engine

// GPU memory (locations "cuda:N"): detected and checked through the CUDA
// driver (package cuda, loaded at run time), moved by rdma directly and by
// tcp and the local transport through host staging buffers.

import (
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvferry/kvferry/cuda"
	"github.com/kvferry/kvferry/engine/memory"
)

// gpu is the engine's view of the CUDA driver, opened on first use.
type gpu struct {
	once sync.Once
	drv  *cuda.Driver
	err  error

	poolMu    sync.Mutex
	pool      map[int][]*stageBuf // free staging buffers by size class
	poolBytes int                 // bytes of the buffers in pool
	reg       *memory.Registry    // staging buffers, never published

	// Staging for peers' accesses (owner side), bounded in bytes: a peer
	// picks the length of each access, and holds its buffer while its
	// answer waits on a socket it does not read.
	ownerMu    sync.Mutex
	ownerBytes int           // bytes of staging buffers out for peers' accesses
	ownerFreed chan struct{} // closed (and replaced) when some are given back
}

// stageBuf is one host staging buffer.
type stageBuf struct {
	mem    []byte
	reg    *memory.Region
	cls    int
	pinned int // the device whose context pinned it, or -1
}

// Staging buffers are kept per size class (powers of two from 64 KiB);
// at most stageKeep of each class, and stagePoolMax bytes in all, wait for
// reuse (page-locked memory the pool keeps is memory the host loses).
const (
	stageMinClass = 16
	stageKeep     = 16
	stagePoolMax  = 256 << 20
	// ownerStageMax caps the staging buffers out for peers' accesses to
	// GPU memory at once; an access past it waits up to ownerStageWait for
	// room, then is refused.
	ownerStageMax  = 256 << 20
	ownerStageWait = time.Second
)

func (e *Engine) cuda() (*cuda.Driver, error) {
	e.gpu.once.Do(func() {
		e.gpu.drv, e.gpu.err = cuda.Open(e.opts.CUDALibrary)
		e.gpu.pool = map[int][]*stageBuf{}
		e.gpu.reg = memory.NewRegistry()
	})
	return e.gpu.drv, e.gpu.err
}

// gpuLocation checks GPU memory for a registration: with loc "cuda:N" it
// must be device N's; with "*" it reports "cuda:N" or "" for host memory.
func (e *Engine) gpuLocation(loc string, mem []byte) (string, error) {
	want := -1
	if strings.HasPrefix(loc, "cuda:") {
		n, err := strconv.Atoi(loc[5:])
		if err != nil || n < 0 || n > 1023 {
			return "", fmt.Errorf("%w: location %q: want cuda:N with N a device ordinal", ErrInvalidArg, loc)
		}
		want = n
	}
	drv, err := e.cuda()
	if err != nil {
		if want < 0 {
			return "", nil // "*" without a driver: host memory
		}
		return "", fmt.Errorf("location %q: %w: %w", loc, ErrUnsupported, err)
	}
	ord, _, _, err := drv.Pointer(memory.AddrOf(mem), uint64(len(mem)))
	switch {
	case err != nil && want < 0:
		return "", nil
	case err != nil:
		return "", fmt.Errorf("%w: location %q: %w", ErrInvalidArg, loc, err)
	case want >= 0 && ord != want:
		return "", fmt.Errorf("%w: location %q: the memory is on cuda:%d", ErrInvalidArg, loc, ord)
	}
	return "cuda:" + strconv.Itoa(ord), nil
}

// gpuOrdinal returns the device of a "cuda:N" location, or -1.
func gpuOrdinal(loc string) int {
	if !strings.HasPrefix(loc, "cuda:") {
		return -1
	}
	n, err := strconv.Atoi(loc[5:])
	if err != nil {
		return -1
	}
	return n
}

// stageSize is the size of the staging buffer an access of n bytes takes:
// its size class.
func stageSize(n int) int { return 1 << stageClass(n) }

// stageClass is the size class (log2 of the buffer size) for n bytes.
func stageClass(n int) int {
	cls := stageMinClass
	for 1<<cls < n {
		cls++
	}
	return cls
}

// getStage returns a staging buffer of at least n bytes, page-locked
// (pinned) through dev's context when the driver allows.
func (e *Engine) getStage(dev, n int) (*stageBuf, error) {
	cls := stageClass(n)
	e.gpu.poolMu.Lock()
	if free := e.gpu.pool[cls]; len(free) > 0 {
		b := free[len(free)-1]
		e.gpu.pool[cls] = free[:len(free)-1]
		e.gpu.poolBytes -= len(b.mem)
		e.gpu.poolMu.Unlock()
		e.stats.stagingInUse.Add(1)
		return b, nil
	}
	e.gpu.poolMu.Unlock()
	mem, _, err := memory.Alloc(1 << cls)
	if err != nil {
		return nil, fmt.Errorf("staging buffer of %d bytes: %w", 1<<cls, err)
	}
	regs, err := e.gpu.reg.Register([]memory.Range{{Mem: mem, Location: "cpu"}})
	if err != nil {
		_ = memory.Free(mem)
		return nil, err
	}
	b := &stageBuf{mem: mem, reg: regs[0], cls: cls, pinned: -1}
	if err := e.gpu.drv.HostRegister(dev, mem); err == nil {
		b.pinned = dev
	} else {
		e.log.Debug("kvferry: staging buffer not pinned; copies go through pageable memory", "err", err)
	}
	e.stats.stagingInUse.Add(1)
	return b, nil
}

func (e *Engine) freeStage(b *stageBuf) {
	_, _ = e.gpu.reg.Unregister([]uint64{b.reg.Addr})
	if b.pinned >= 0 {
		_ = e.gpu.drv.HostUnregister(b.pinned, b.mem)
	}
	_ = memory.Free(b.mem)
}

func (e *Engine) putStage(b *stageBuf) {
	e.stats.stagingInUse.Add(-1)
	e.gpu.poolMu.Lock()
	if len(e.gpu.pool[b.cls]) < stageKeep && e.gpu.poolBytes+len(b.mem) <= stagePoolMax {
		e.gpu.pool[b.cls] = append(e.gpu.pool[b.cls], b)
		e.gpu.poolBytes += len(b.mem)
		e.gpu.poolMu.Unlock()
		return
	}
	e.gpu.poolMu.Unlock()
	e.freeStage(b)
}

// freeStages frees the pooled staging buffers (at Close).
func (e *Engine) freeStages() {
	e.gpu.poolMu.Lock()
	pool := e.gpu.pool
	e.gpu.pool, e.gpu.poolBytes = map[int][]*stageBuf{}, 0
	e.gpu.poolMu.Unlock()
	for _, bs := range pool {
		for _, b := range bs {
			e.freeStage(b)
		}
	}
}

// dmaBuf exports GPU memory for rdma registration: the dma-buf covers the
// pages around [addr, addr+n) (the driver wants whole pages).
func (e *Engine) dmaBuf(location string, addr, n uint64) (int, uint64, error) {
	dev := gpuOrdinal(location)
	drv, err := e.cuda()
	if err != nil || dev < 0 {
		return -1, 0, fmt.Errorf("dma-buf of %s: %w", location, ErrUnsupported)
	}
	const page = 4096
	base := addr &^ (page - 1)
	end := (addr + n + page - 1) &^ (page - 1)
	fd, err := drv.DmaBuf(dev, base, end-base)
	if err != nil {
		return -1, 0, err
	}
	return fd, addr - base, nil
}
