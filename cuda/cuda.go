// Package cuda is kvferry's thin layer over the CUDA driver API: libcuda is
// opened at run time (dlopen), so libkvferry.so loads with RTLD_NOW on
// machines without the NVIDIA driver and reports ErrNotAvailable there.
//
// It answers what the engine needs of GPU memory: whether an address is
// device memory, of which device, and the allocation around it; each
// device's PCI bus id (for NIC affinity); copies between host and device
// (GPU staging on tcp); and dma-buf handles for RDMA registration. Every
// call that needs a context makes the device's primary context current on
// the calling thread inside the same C call. Primary contexts are retained
// only for devices the caller named or whose memory it handed in: a device
// nobody asked about never gets a context (Mooncake's transfer engine once
// created contexts on such devices, and fixed it).
package cuda

/*
#cgo CFLAGS: -O2 -Wall
#cgo LDFLAGS: -ldl
#include <stdlib.h>
#include "shim.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"sync"
	"unsafe"
)

// DefaultLibrary is the driver's soname.
const DefaultLibrary = "libcuda.so.1"

// Errors, matchable with errors.Is.
var (
	// ErrNotAvailable: libcuda could not be loaded or initialised.
	ErrNotAvailable = errors.New("cuda not available")
	// ErrNoDevice: the driver lists no GPU.
	ErrNoDevice = errors.New("no cuda device")
	// ErrNotDevicePointer: the address is not GPU memory.
	ErrNotDevicePointer = errors.New("not cuda device memory")
)

// Error is a CUresult other than success.
type Error struct {
	Call   string
	Result int
	Text   string
}

func (e *Error) Error() string { return fmt.Sprintf("%s: %s (CUresult %d)", e.Call, e.Text, e.Result) }

// Driver is an opened, initialised libcuda.
type Driver struct {
	c    *C.kvfc_lib
	path string
	mu   sync.Mutex // guards retained contexts
	devs []Device
}

// Device is one GPU.
type Device struct {
	Ordinal  int
	Name     string
	PCIBusID string // "0000:3b:00.0", lower case
	Memory   uint64
}

var (
	openMu sync.Mutex
	opened = map[string]*Driver{}
)

// Open loads and initialises libcuda from path (DefaultLibrary when
// empty), once per process and path.
func Open(path string) (*Driver, error) {
	if path == "" {
		path = DefaultLibrary
	}
	openMu.Lock()
	defer openMu.Unlock()
	if d := opened[path]; d != nil {
		return d, nil
	}
	cp := C.CString(path)
	defer C.free(unsafe.Pointer(cp))
	var errbuf [512]C.char
	var c *C.kvfc_lib
	if C.kvfc_open(cp, &c, &errbuf[0], C.size_t(len(errbuf))) != 0 {
		return nil, fmt.Errorf("%w: load %s: %s", ErrNotAvailable, path, C.GoString(&errbuf[0]))
	}
	d := &Driver{c: c, path: path}
	if err := d.check("cuInit", C.kvfc_init(c)); err != nil {
		if err.(*Error).Result == 100 { // CUDA_ERROR_NO_DEVICE
			return nil, fmt.Errorf("%w: %s: %w", ErrNoDevice, path, err)
		}
		return nil, fmt.Errorf("%w: %s: %w", ErrNotAvailable, path, err)
	}
	var n C.int
	if err := d.check("cuDeviceGetCount", C.kvfc_device_count(c, &n)); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNotAvailable, err)
	}
	for i := range int(n) {
		var name, bus [256]C.char
		var mem C.uint64_t
		if err := d.check("cuDeviceGet*", C.kvfc_device_info(c, C.int(i), &name[0], 256, &bus[0], 64, &mem)); err != nil {
			return nil, fmt.Errorf("%w: device %d: %w", ErrNotAvailable, i, err)
		}
		d.devs = append(d.devs, Device{Ordinal: i, Name: C.GoString(&name[0]), PCIBusID: lower(C.GoString(&bus[0])), Memory: uint64(mem)})
	}
	opened[path] = d
	return d, nil
}

func lower(s string) string {
	b := []byte(s)
	for i, c := range b {
		if 'A' <= c && c <= 'Z' {
			b[i] = c + 'a' - 'A'
		}
	}
	return string(b)
}

func (d *Driver) check(call string, r C.int) error {
	if r == 0 {
		return nil
	}
	return &Error{Call: call, Result: int(r), Text: C.GoString(C.kvfc_error_string(d.c, r))}
}

// Path is the file the driver was loaded from.
func (d *Driver) Path() string { return d.path }

// Devices lists the GPUs (none creates a context).
func (d *Driver) Devices() []Device { return d.devs }

// Use retains device ordinal's primary context for later calls. Calls on a
// device not in use fail; nothing here retains one by itself except
// Pointer, for the device whose memory it was given.
func (d *Driver) Use(ordinal int) error {
	if ordinal < 0 || ordinal >= len(d.devs) {
		return fmt.Errorf("cuda: device %d of %d: %w", ordinal, len(d.devs), ErrNoDevice)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.check("cuDevicePrimaryCtxRetain", C.kvfc_retain(d.c, C.int(ordinal)))
}

// Pointer reports whether [addr, addr+n) is GPU memory, of which device, and
// the allocation holding it. Host memory gives ErrNotDevicePointer. The
// device's primary context is retained (the memory came from it, so it
// exists already).
func (d *Driver) Pointer(addr, n uint64) (ordinal int, base, size uint64, err error) {
	var ord C.int
	var b, s C.uint64_t
	d.mu.Lock()
	defer d.mu.Unlock()
	// The type query needs no context; the range query does.
	r := C.kvfc_pointer(d.c, C.uint64_t(addr), &ord, &b, &s)
	if r == 101 && ord >= 0 { // no context retained yet for that device
		if err := d.check("cuDevicePrimaryCtxRetain", C.kvfc_retain(d.c, ord)); err != nil {
			return -1, 0, 0, err
		}
		r = C.kvfc_pointer(d.c, C.uint64_t(addr), &ord, &b, &s)
	}
	if err := d.check("cuPointerGetAttributes", r); err != nil {
		return -1, 0, 0, err
	}
	if ord < 0 {
		return -1, 0, 0, fmt.Errorf("%#x: %w", addr, ErrNotDevicePointer)
	}
	if addr+n < addr || addr < uint64(b) || addr+n > uint64(b)+uint64(s) {
		return int(ord), uint64(b), uint64(s), fmt.Errorf("cuda: [%#x, +%d) runs past its allocation [%#x, +%d)", addr, n, uint64(b), uint64(s))
	}
	return int(ord), uint64(b), uint64(s), nil
}

// Copy directions.
const (
	HostToDevice   = 1
	DeviceToHost   = 2
	DeviceToDevice = 3
)

// Copy copies n bytes on device ordinal's context (synchronously).
func (d *Driver) Copy(ordinal, kind int, dst, src, n uint64) error {
	return d.check("cuMemcpy", C.kvfc_copy(d.c, C.int(ordinal), C.int(kind), C.uint64_t(dst), C.uint64_t(src), C.uint64_t(n)))
}

// HostRegister page-locks [p, p+n) of host memory for every device's
// copies (pinned staging: copies from it run at the bus's speed and need no
// bounce). The memory must stay mapped until HostUnregister.
func (d *Driver) HostRegister(ordinal int, p []byte) error {
	return d.check("cuMemHostRegister", C.kvfc_host_register(d.c, C.int(ordinal), unsafe.Pointer(unsafe.SliceData(p)), C.uint64_t(len(p))))
}

// HostUnregister undoes HostRegister.
func (d *Driver) HostUnregister(ordinal int, p []byte) error {
	return d.check("cuMemHostUnregister", C.kvfc_host_unregister(d.c, C.int(ordinal), unsafe.Pointer(unsafe.SliceData(p))))
}

// Alloc allocates n bytes of device memory on ordinal (which must be in use).
func (d *Driver) Alloc(ordinal int, n uint64) (uint64, error) {
	var p C.uint64_t
	if err := d.check("cuMemAlloc", C.kvfc_alloc(d.c, C.int(ordinal), C.uint64_t(n), &p)); err != nil {
		return 0, err
	}
	return uint64(p), nil
}

// Free frees device memory from Alloc.
func (d *Driver) Free(ordinal int, p uint64) error {
	return d.check("cuMemFree", C.kvfc_free(d.c, C.int(ordinal), C.uint64_t(p)))
}

// DmaBuf exports [p, p+n) of device memory as a dma-buf file descriptor,
// for ibv_reg_dmabuf_mr. The caller closes it.
func (d *Driver) DmaBuf(ordinal int, p, n uint64) (int, error) {
	var fd C.int
	if err := d.check("cuMemGetHandleForAddressRange", C.kvfc_dmabuf(d.c, C.int(ordinal), C.uint64_t(p), C.uint64_t(n), &fd)); err != nil {
		return -1, err
	}
	return int(fd), nil
}

// IPCHandle is a CUDA IPC memory handle (CUipcMemHandle): it names an
// allocation of device memory to another process of this host.
type IPCHandle [64]byte

// HasIPC reports whether the driver exports CUDA IPC (cuIpcGetMemHandle,
// cuIpcOpenMemHandle, cuIpcCloseMemHandle).
func (d *Driver) HasIPC() bool { return C.kvfc_has_ipc(d.c) != 0 }

// IPCExport returns the IPC handle of the allocation starting at base
// (device ordinal's memory).
func (d *Driver) IPCExport(ordinal int, base uint64) (IPCHandle, error) {
	var h C.kvfc_ipc_handle
	if err := d.check("cuIpcGetMemHandle", C.kvfc_ipc_get(d.c, C.int(ordinal), C.uint64_t(base), &h)); err != nil {
		return IPCHandle{}, err
	}
	return *(*IPCHandle)(unsafe.Pointer(&h.reserved[0])), nil
}

// IPCOpen maps another process's allocation, named by h, on device
// ordinal's context (which must be in use), and returns its address here.
// The driver refuses a handle of this process itself.
func (d *Driver) IPCOpen(ordinal int, h IPCHandle) (uint64, error) {
	var ch C.kvfc_ipc_handle
	*(*IPCHandle)(unsafe.Pointer(&ch.reserved[0])) = h
	var p C.uint64_t
	if err := d.check("cuIpcOpenMemHandle", C.kvfc_ipc_open(d.c, C.int(ordinal), &ch, &p)); err != nil {
		return 0, err
	}
	return uint64(p), nil
}

// IPCClose unmaps an allocation IPCOpen mapped.
func (d *Driver) IPCClose(ordinal int, p uint64) error {
	return d.check("cuIpcCloseMemHandle", C.kvfc_ipc_close(d.c, C.int(ordinal), C.uint64_t(p)))
}

// Stat reads a counter of a fake driver (fakecuda_stats); -1 elsewhere.
func (d *Driver) Stat(what string) int64 {
	s := C.CString("fakecuda_stats")
	defer C.free(unsafe.Pointer(s))
	w := C.CString(what)
	defer C.free(unsafe.Pointer(w))
	return int64(C.kvfc_stat(d.c, s, w))
}

// Control sends a fault command to a fake driver (fakecuda_control).
func (d *Driver) Control(cmd string) error {
	s := C.CString("fakecuda_control")
	defer C.free(unsafe.Pointer(s))
	c := C.CString(cmd)
	defer C.free(unsafe.Pointer(c))
	switch C.kvfc_control(d.c, s, c) {
	case 0:
		return nil
	case -2:
		return fmt.Errorf("%s has no fakecuda_control: not a fake driver", d.path)
	}
	return fmt.Errorf("fakecuda_control(%q) refused", cmd)
}
