package engine

// GPU memory between engines of one host: the shm transport moves it
// through CUDA IPC with the engine's driver (shm.GPU), so neither side
// stages it through host memory.

import (
	"errors"
	"fmt"

	"github.com/kvferry/kvferry/cuda"
	"github.com/kvferry/kvferry/engine/transport/shm"
)

// ipcGPU is the engine's CUDA driver as the shm transport uses it.
type ipcGPU struct{ e *Engine }

var _ shm.GPU = ipcGPU{}

// Available loads the driver (once per engine) and reports whether it
// lists a GPU.
func (g ipcGPU) Available() bool {
	drv, err := g.e.cuda()
	return err == nil && len(drv.Devices()) > 0
}

// Export returns the IPC handle of the allocation holding [addr, addr+n).
func (g ipcGPU) Export(addr, n uint64) (h [shm.IPCHandleSize]byte, base, size uint64, bus string, err error) {
	drv, err := g.e.cuda()
	if err != nil {
		return h, 0, 0, "", err
	}
	ord, base, size, err := drv.Pointer(addr, n)
	if err != nil {
		return h, 0, 0, "", err
	}
	ih, err := drv.IPCExport(ord, base)
	if err != nil {
		return h, 0, 0, "", err
	}
	return ih, base, size, drv.Devices()[ord].PCIBusID, nil
}

// errNoGPU: the driver lists no device to open an IPC handle on.
var errNoGPU = errors.New("no GPU to open the handle on")

// Import opens another process's allocation on the device with that PCI
// bus id, or on device 0 (the driver then reaches it as peer memory).
func (g ipcGPU) Import(h [shm.IPCHandleSize]byte, bus string) (int, uint64, uint64, error) {
	drv, err := g.e.cuda()
	if err != nil {
		return -1, 0, 0, err
	}
	devs := drv.Devices()
	if len(devs) == 0 {
		return -1, 0, 0, errNoGPU
	}
	ord := 0
	for _, d := range devs {
		if d.PCIBusID == bus {
			ord = d.Ordinal
		}
	}
	if err := drv.Use(ord); err != nil {
		return -1, 0, 0, err
	}
	p, err := drv.IPCOpen(ord, cuda.IPCHandle(h))
	if err != nil {
		return -1, 0, 0, err
	}
	_, base, size, err := drv.Pointer(p, 1)
	if err != nil || base != p {
		_ = drv.IPCClose(ord, p)
		return -1, 0, 0, fmt.Errorf("the opened allocation at %#x: base %#x: %w", p, base, err)
	}
	return ord, p, size, nil
}

// Close unmaps an allocation Import opened.
func (g ipcGPU) Close(ordinal int, addr uint64) {
	if drv, err := g.e.cuda(); err == nil {
		if err := drv.IPCClose(ordinal, addr); err != nil {
			g.e.log.Warn("kvferry: closing a peer's CUDA IPC mapping failed", "addr", addr, "err", err)
		}
	}
}

// Copy copies on ordinal's context, synchronously.
func (g ipcGPU) Copy(ordinal, kind int, dst, src, n uint64) error {
	drv, err := g.e.cuda()
	if err != nil {
		return err
	}
	return drv.Copy(ordinal, kind, dst, src, n)
}
