package engine

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/kvferry/kvferry/engine/control"
	"github.com/kvferry/kvferry/engine/memory"
)

// MemoryRange is one range to register.
type MemoryRange struct {
	// Mem is the memory. It must not be moved or freed while registered:
	// use AllocBuffer, mmap or C memory (Go's heap does not move, but
	// memory from it must stay referenced, which registration does).
	Mem []byte
	// Location says where the memory lives: "cpu", "cpu:N" (NUMA node N),
	// "cuda:N" (GPU N, checked through the CUDA driver) or "*" to detect
	// it. GPU memory moves directly over rdma and through host staging
	// buffers over tcp.
	Location string
}

// AddrOf returns the address of b's first byte, as requests name it.
func AddrOf(b []byte) uint64 { return memory.AddrOf(b) }

// RegisterMemory registers one range and returns its buffer key.
func (e *Engine) RegisterMemory(mem []byte, location string) (BufferKey, error) {
	keys, err := e.RegisterMemoryBatch([]MemoryRange{{Mem: mem, Location: location}})
	if err != nil {
		return 0, err
	}
	return keys[0], nil
}

// RegisterMemoryBatch registers all ranges or none. A range overlapping
// another in the call or one already registered is refused with ErrOverlap.
func (e *Engine) RegisterMemoryBatch(ranges []MemoryRange) ([]BufferKey, error) {
	if err := e.checkOpen(); err != nil {
		return nil, err
	}
	if len(ranges) == 0 {
		return nil, fmt.Errorf("register memory: %w: no ranges", ErrInvalidArg)
	}
	rs := make([]memory.Range, len(ranges))
	for i, r := range ranges {
		loc, err := e.location(r.Location, r.Mem)
		if err != nil {
			return nil, fmt.Errorf("register memory: range %d at %#x: %w", i, memory.AddrOf(r.Mem), err)
		}
		rs[i] = memory.Range{Mem: r.Mem, Location: loc}
	}
	regs, err := e.reg.Register(rs)
	if err != nil {
		return nil, fmt.Errorf("register memory: %w", err)
	}
	e.descriptorChanged()
	keys := make([]BufferKey, len(regs))
	for i, r := range regs {
		keys[i] = r.Key
	}
	return keys, nil
}

// location validates a location and turns "*" into what the memory is:
// GPU memory is asked of the CUDA driver (when it loads), then host memory
// of its NUMA node.
func (e *Engine) location(loc string, mem []byte) (string, error) {
	if len(loc) <= control.MaxLocation && (loc == "*" || strings.HasPrefix(loc, "cuda:")) {
		g, err := e.gpuLocation(loc, mem)
		if err != nil || g != "" {
			return g, err
		}
	}
	return resolveLocation(loc, mem)
}

// resolveLocation validates a host location and turns "*" into what the
// memory is.
func resolveLocation(loc string, mem []byte) (string, error) {
	if len(loc) > control.MaxLocation {
		return "", fmt.Errorf("%w: location of %d bytes (at most %d)", ErrInvalidArg, len(loc), control.MaxLocation)
	}
	switch {
	case loc == "" || loc == "cpu":
		return "cpu", nil
	case loc == "*":
		if n := memory.NUMANode(mem); n >= 0 {
			return "cpu:" + strconv.Itoa(n), nil
		}
		return "cpu", nil
	case strings.HasPrefix(loc, "cpu:"):
		if n, err := strconv.Atoi(loc[4:]); err != nil || n < 0 || n > 4095 {
			return "", fmt.Errorf("%w: location %q: want cpu:N with N a NUMA node", ErrInvalidArg, loc)
		}
		return loc, nil
	}
	return "", fmt.Errorf("%w: location %q: want cpu, cpu:N or *", ErrInvalidArg, loc)
}

// UnregisterMemory removes the registration starting at addr. It returns
// once no copy into or out of the range is in progress and none can start:
// the range may be reused at once. Transfers of it still queued fail.
func (e *Engine) UnregisterMemory(addr uint64) error {
	return e.UnregisterMemoryBatch([]uint64{addr})
}

// UnregisterMemoryBatch removes several registrations, all or none.
func (e *Engine) UnregisterMemoryBatch(addrs []uint64) error {
	if len(addrs) == 0 {
		return fmt.Errorf("unregister memory: %w: no addresses", ErrInvalidArg)
	}
	regs, err := e.reg.Unregister(addrs)
	if regs != nil {
		e.descriptorChanged()
	}
	if err != nil {
		// With regions returned, they are gone but a path could not
		// confirm that nothing reaches them (ErrMemoryInUse).
		return fmt.Errorf("unregister memory: %w", err)
	}
	return nil
}

// AllocBuffer maps size bytes of shareable memory (a sealed memfd) outside
// Go's heap and registers them: a peer on this host then copies into and
// out of them through a view of their pages (the shm transport). Free it
// with FreeBuffer.
func (e *Engine) AllocBuffer(size int, location string) ([]byte, error) {
	// Shareable memory (a memfd), so that a peer on this host can copy
	// straight into and out of it (the shm transport); private memory
	// where memfds are not available.
	mem, err := memory.AllocShared(size)
	if err != nil {
		e.log.Debug("kvferry: shareable memory not available; allocating private memory", "err", err)
		if mem, _, err = memory.Alloc(size); err != nil {
			return nil, fmt.Errorf("alloc buffer: %w", err)
		}
	}
	if _, err := e.RegisterMemory(mem, location); err != nil {
		_ = memory.Free(mem)
		return nil, fmt.Errorf("alloc buffer: %w", err)
	}
	e.allocMu.Lock()
	e.allocs[memory.AddrOf(mem)] = mem
	e.allocMu.Unlock()
	return mem, nil
}

// FreeBuffer unregisters and unmaps a buffer from AllocBuffer. It works after
// Close too.
func (e *Engine) FreeBuffer(addr uint64) error {
	e.allocMu.Lock()
	mem, ok := e.allocs[addr]
	delete(e.allocs, addr)
	e.allocMu.Unlock()
	if !ok {
		return fmt.Errorf("free buffer %#x: %w: not from AllocBuffer", addr, ErrInvalidArg)
	}
	// Every registration inside the buffer (the caller may have registered
	// parts of it again) goes first; unregistering waits for copies in
	// progress, so unmapping is safe after it.
	regs, err := e.reg.UnregisterOverlapping(addr, uint64(len(mem)))
	if len(regs) > 0 {
		e.descriptorChanged()
	}
	if err != nil {
		if _, shared, _ := memory.Shared(addr, uint64(len(mem)), false); !shared {
			// A peer may still copy into these pages (cross-memory
			// attach): they stay mapped, never to be reused.
			return fmt.Errorf("free buffer %#x: kept mapped: %w", addr, err)
		}
		// Shareable memory: a peer still copying reaches only its own view
		// of these pages, which no later allocation of ours shares.
		e.log.Warn("kvferry: freeing a buffer a same-host peer may still copy into its own view of", "addr", addr, "err", err)
	}
	return memory.Free(mem)
}
