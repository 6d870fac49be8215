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
	"github.com/kvferry/kvferry/engine/transport"
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

// getStage returns a staging buffer of at least n bytes, page-locked
// (pinned) through dev's context when the driver allows.
// stageSize is the size of the staging buffer an access of n bytes takes:
// its size class.
func stageSize(n int) int { return 1 << stageClass(n) }

func stageClass(n int) int {
	cls := stageMinClass
	for 1<<cls < n {
		cls++
	}
	return cls
}

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
		return transport.Target{}, fmt.Errorf("%w: GPU memory without the CUDA driver: %w", ErrRefused, err)
	}
	size := stageSize(int(a.Length))
	if !e.reserveOwnerStage(size) {
		e.stats.ownerStageRefused.Add(1)
		return transport.Target{}, fmt.Errorf("%w: GPU staging for peers' accesses is at its bound (%d MiB)", ErrRefused, ownerStageMax>>20)
	}
	buf, err := e.getStage(dev, int(a.Length))
	if err != nil {
		e.releaseOwnerStage(size)
		return transport.Target{}, fmt.Errorf("%w: %w", ErrRefused, err)
	}
	t.Mem = buf.mem[:a.Length:a.Length]
	t.Stage = &ownerStage{e: e, dev: dev, addr: a.Addr, buf: buf, n: int(a.Length)}
	return t, nil
}

// ---- initiator side --------------------------------------------------------

// initStage is a slice of GPU memory staged through host memory on a path
// that cannot reach GPU memory.
type initStage struct {
	dev  int
	gpu  []byte // the slice's own memory
	greg *memory.Region
	buf  *stageBuf
}

// stageChunk is the most a staging copy moves per driver call: a cancel
// waits for at most one chunk of a staging copy under way.
const stageChunk = 4 << 20

// stageSlice prepares a GPU slice for a path without DirectGPU, on the
// stager (see postStaged), which owns the slice while it is Staging: a
// WRITE's bytes are copied into a staging buffer chunk by chunk, each
// chunk only while its task is live and its memory registered; a READ gets
// a buffer to land in and is copied out when it completes (unstage). It
// reports whether the slice is staged, Queued and ready to post; otherwise
// it ended it.
func (e *Engine) stageSlice(s *sliceT) bool {
	if !s.Advance(transport.StateQueued, transport.StateStaging) {
		return false // canceled (or taken) meanwhile
	}
	fail := func(err error) bool {
		s.Finish(fmt.Errorf("GPU staging: %w", err))
		return false
	}
	dev := gpuOrdinal(s.LocalReg.Location)
	if _, err := e.cuda(); err != nil {
		return fail(err)
	}
	buf, err := e.getStage(dev, len(s.Local))
	if err != nil {
		return fail(err)
	}
	st := &initStage{dev: dev, gpu: s.Local, greg: s.LocalReg, buf: buf}
	if s.Op == transport.Write {
		for off := 0; off < len(s.Local); off += stageChunk {
			if f := s.t.final.Load(); f != 0 {
				e.putStage(buf)
				return fail(fmt.Errorf("%w: task ended", transport.ErrCanceled))
			}
			n := min(stageChunk, len(s.Local)-off)
			if err := st.greg.Enter(); err != nil {
				e.putStage(buf)
				return fail(err)
			}
			err := e.gpu.drv.Copy(dev, cuda.DeviceToHost, memory.AddrOf(buf.mem)+uint64(off), memory.AddrOf(s.Local)+uint64(off), uint64(n))
			st.greg.Leave()
			if err != nil {
				e.putStage(buf)
				return fail(err)
			}
		}
	}
	s.stage = st
	s.Local = buf.mem[:len(st.gpu):len(st.gpu)]
	s.LocalReg = buf.reg
	// Queued: from here a cancel takes it (and unstage frees the buffer).
	// A cancel that came during the last chunk left the slice to us: it
	// set the task's final status first, so it is seen here, or it finds
	// the slice Queued and takes it itself.
	if !s.Advance(transport.StateStaging, transport.StateQueued) {
		return false
	}
	if s.t.final.Load() != 0 && s.TryCancel() {
		s.t.sliceEnded(s, transport.ErrCanceled)
		return false
	}
	return true
}

// unstage ends a staged slice's use of its buffer: a READ that succeeded
// is copied into GPU memory first, unless its task ended meanwhile (then
// its memory must not be touched). It returns the slice's error.
func (e *Engine) unstage(s *sliceT, err error) error {
	st := s.stage
	if st == nil {
		return err
	}
	s.stage = nil
	if err == nil && s.Op == transport.Read {
		switch {
		case s.t.final.Load() != 0:
			err = fmt.Errorf("%w: task ended before its READ was copied to GPU memory", transport.ErrCanceled)
		default:
			if err = st.greg.Enter(); err == nil {
				err = e.gpu.drv.Copy(st.dev, cuda.HostToDevice, memory.AddrOf(st.gpu), memory.AddrOf(s.Local), uint64(len(s.Local)))
				st.greg.Leave()
			}
			if err != nil {
				err = fmt.Errorf("GPU staging: %w", err)
			}
		}
	}
	s.Local, s.LocalReg = st.gpu, st.greg
	e.putStage(st.buf)
	return err
}

// postStaged posts slices on a path. Those in GPU memory, where the path
// cannot reach GPU memory, are staged through host memory first, off the
// caller's goroutine (Submit returns at once, and a deadline or cancel is
// never stuck behind a copy): a stager goroutine stages them in order and
// posts each as soon as its copy is done, so the copy of the next one
// overlaps the network transfer of this one.
func (e *Engine) postStaged(ref *pathRef, slices []*transport.Slice) {
	if d, ok := ref.ep.(transport.DirectGPU); ok && d.DirectGPU() {
		ref.ep.Post(slices)
		return
	}
	plain := slices[:0:0]
	var staged []*transport.Slice
	for _, s := range slices {
		// A slice staged before (a retry) is in host memory already.
		if gpuOrdinal(s.LocalReg.Location) < 0 || s.Tag.(*sliceT).stage != nil {
			plain = append(plain, s)
		} else {
			staged = append(staged, s)
		}
	}
	if len(plain) > 0 {
		ref.ep.Post(plain)
	}
	if len(staged) == 0 {
		return
	}
	if !e.startBackground() {
		for _, s := range staged {
			if s.Advance(transport.StateQueued, transport.StateStaging) {
				s.Finish(ErrClosed)
			}
		}
		return
	}
	e.stats.stagers.Add(1)
	go func() {
		defer e.bg.Done()
		defer e.stats.stagers.Add(-1)
		for _, s := range staged {
			if e.stageSlice(s.Tag.(*sliceT)) {
				ref.ep.Post([]*transport.Slice{s})
			}
		}
	}()
}
