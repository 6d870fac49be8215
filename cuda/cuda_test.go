package cuda_test

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"unsafe"

	"github.com/kvferry/kvferry/cuda"
	"github.com/kvferry/kvferry/internal/fakeverbs"
)

func TestMissingLibraryIsNotAvailable(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "libcuda.so.1")
	_, err := cuda.Open(missing)
	if !errors.Is(err, cuda.ErrNotAvailable) || !strings.Contains(err.Error(), "cuda not available") {
		t.Fatalf("Open(%s) = %v, want ErrNotAvailable", missing, err)
	}
}

// On the fake driver: devices and bus ids, pointer detection (device memory
// with its allocation, host memory refused), copies both ways with data
// checked, and no context created on a device nobody named.
func TestFakeDriver(t *testing.T) {
	d, err := cuda.Open(fakeverbs.CUDAPath(t))
	if err != nil {
		t.Fatal(err)
	}
	devs := d.Devices()
	if len(devs) != 2 || devs[0].PCIBusID != "0000:20:00.0" || devs[1].PCIBusID != "0000:21:00.0" {
		t.Fatalf("devices %+v", devs)
	}
	if m := d.Stat("ctx_dev_mask"); m != 0 {
		t.Fatalf("opening the driver created contexts on devices %#x", m)
	}
	if err := d.Use(1); err != nil {
		t.Fatal(err)
	}
	const n = 1 << 20
	p, err := d.Alloc(1, n)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Free(1, p)
	ord, base, size, err := d.Pointer(p+4096, 4096)
	if err != nil || ord != 1 || base != p || size < n {
		t.Fatalf("Pointer(inside) = %d, %#x, %d, %v; want device 1, base %#x", ord, base, size, err, p)
	}
	if _, _, _, err := d.Pointer(p+n-10, 100); err == nil {
		t.Fatal("a range running past its allocation was accepted")
	}
	host := make([]byte, n)
	haddr := uint64(uintptr(unsafe.Pointer(&host[0])))
	if _, _, _, err := d.Pointer(haddr, 10); !errors.Is(err, cuda.ErrNotDevicePointer) {
		t.Fatalf("Pointer(host) = %v, want ErrNotDevicePointer", err)
	}
	for i := range host {
		host[i] = byte(i * 7)
	}
	if err := d.Copy(1, cuda.HostToDevice, p, haddr, n); err != nil {
		t.Fatal(err)
	}
	back := make([]byte, n)
	if err := d.Copy(1, cuda.DeviceToHost, uint64(uintptr(unsafe.Pointer(&back[0]))), p, n); err != nil {
		t.Fatal(err)
	}
	for i := range back {
		if back[i] != host[i] {
			t.Fatalf("byte %d: %d after the round trip, want %d", i, back[i], host[i])
		}
	}
	if m := d.Stat("ctx_dev_mask"); m != 2 {
		t.Fatalf("contexts created on devices %#x; want only device 1 (0x2)", m)
	}
	// A failing copy is an error naming the call, not a crash.
	if err := d.Control("fail op=cuMemcpyDtoHAsync_v2 after=1"); err != nil {
		t.Fatal(err)
	}
	var ce *cuda.Error
	if err := d.Copy(1, cuda.DeviceToHost, uint64(uintptr(unsafe.Pointer(&back[0]))), p, 16); !errors.As(err, &ce) {
		t.Fatalf("faulted copy: %v", err)
	}
	if err := d.Use(7); !errors.Is(err, cuda.ErrNoDevice) {
		t.Fatalf("Use(7) = %v", err)
	}
}

// TestRealDriver runs on this machine's NVIDIA driver, where there is one,
// and skips saying why where there is none (a skip is not a pass).
func TestRealDriver(t *testing.T) {
	d, err := cuda.Open(cuda.DefaultLibrary)
	if err != nil {
		t.Skipf("no real GPU here: %v", err)
	}
	for _, dev := range d.Devices() {
		t.Logf("cuda:%d %s pci %s, %d MiB", dev.Ordinal, dev.Name, dev.PCIBusID, dev.Memory>>20)
	}
	if err := d.Use(0); err != nil {
		t.Fatal(err)
	}
	p, err := d.Alloc(0, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Free(0, p)
	host := make([]byte, 1<<20)
	for i := range host {
		host[i] = byte(i)
	}
	back := make([]byte, len(host))
	if err := d.Copy(0, cuda.HostToDevice, p, uint64(uintptr(unsafe.Pointer(&host[0]))), uint64(len(host))); err != nil {
		t.Fatal(err)
	}
	if err := d.Copy(0, cuda.DeviceToHost, uint64(uintptr(unsafe.Pointer(&back[0]))), p, uint64(len(back))); err != nil {
		t.Fatal(err)
	}
	for i := range back {
		if back[i] != host[i] {
			t.Fatalf("byte %d differs after the round trip", i)
		}
	}
	if ord, _, _, err := d.Pointer(p, 1<<20); err != nil || ord != 0 {
		t.Fatalf("Pointer = %d, %v", ord, err)
	}
}
