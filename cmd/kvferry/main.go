// Command kvferry is kvferry's admin tool. `kvferry keygen` makes an
// engine's CURVE key pair and `kvferry pubkey` prints a secret key's public
// key (see the README's Authentication section). `kvferry topo` prints the GPUs,
// the RDMA NICs and the NIC preference matrix this machine would publish:
// for each memory location (cpu:N per NUMA node, cuda:N per GPU), the NICs
// in the order slices use them. `kvferry top` is a live view of engines'
// metrics endpoints (see top.go).
//
// GPUs come from NVML (go-nvml) when libnvidia-ml is present, else from the
// CUDA driver (the cuda package, as the library itself uses). go-nvml lives
// only in this command: linked into libkvferry.so it would make the library
// fail to load with RTLD_NOW where libnvidia-ml is absent.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strconv"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/kvferry/kvferry/cuda"
	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport/shm"
	"github.com/kvferry/kvferry/verbs"
	"github.com/kvferry/kvferry/verbs/topo"
)

func main() {
	flag.Usage = func() {
		fmt.Fprintf(os.Stderr, "usage: kvferry keygen --secret FILE [--public FILE]\n"+
			"       kvferry pubkey --secret FILE\n"+
			"       kvferry topo [--sys DIR]\n"+
			"       kvferry top [--interval 1s] [--count N] ENDPOINT...\n\n"+
			"top shows engines' metrics live (ENDPOINT: host:port of KVFERRY_METRICS_ADDR, or a /metrics URL).\n"+
			"keygen writes a new CURVE key pair (the secret key with mode 0600); pubkey\n"+
			"prints a secret key's public key, the line peers add to their allowlists.\n"+
			"Prints GPUs, RDMA NICs and the NIC preference matrix. Environment:\n"+
			"  KVFERRY_IBVERBS_LIBRARY  libibverbs to load (libibverbs.so.1)\n"+
			"  KVFERRY_RDMA_DEVICES     device filter (as NCCL_IB_HCA)\n"+
			"  KVFERRY_CUDA_LIBRARY     libcuda to load (libcuda.so.1) when NVML is absent\n")
	}
	if len(os.Args) >= 2 && (os.Args[1] == "keygen" || os.Args[1] == "pubkey") {
		run := runKeygen
		if os.Args[1] == "pubkey" {
			run = runPubkey
		}
		if err := run(os.Stdout, os.Args[2:]); err != nil {
			fmt.Fprintln(os.Stderr, "kvferry:", err)
			os.Exit(1)
		}
		return
	}
	if len(os.Args) >= 2 && os.Args[1] == "top" {
		if err := runTop(os.Stdout, os.Args[2:]); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				os.Exit(0)
			}
			fmt.Fprintln(os.Stderr, "kvferry:", err)
			os.Exit(1)
		}
		return
	}
	if len(os.Args) < 2 || os.Args[1] != "topo" {
		flag.Usage()
		os.Exit(2)
	}
	fs := flag.NewFlagSet("topo", flag.ExitOnError)
	sys := fs.String("sys", "/sys", "sysfs root (for GPU PCIe paths)")
	_ = fs.Parse(os.Args[2:])
	os.Exit(runTopo(os.Stdout, *sys))
}

// gpu is one GPU as found.
type gpu struct {
	index int
	name  string
	bus   string
	numa  int
}

func runTopo(w io.Writer, sysRoot string) int {
	gpus, how := findGPUs()
	fmt.Fprintf(w, "GPUs (%s):\n", how)
	if len(gpus) == 0 {
		fmt.Fprintln(w, "  none")
	}
	for _, g := range gpus {
		fmt.Fprintf(w, "  cuda:%d  %s  pci %s  numa %s  path %s\n", g.index, g.name, g.bus, numaText(g.numa), orNone(topo.PCIPathOf(sysRoot, g.bus)))
	}

	sameHost(w)

	nics, nicHow := findNICs()
	fmt.Fprintf(w, "RDMA NICs (%s):\n", nicHow)
	if len(nics) == 0 {
		fmt.Fprintln(w, "  none")
	}
	numas := map[int]bool{}
	for _, n := range nics {
		fmt.Fprintf(w, "  %s:%d  pci %s  numa %s\n", n.Name, n.Port, orNone(n.Placement.PCIAddress), numaText(n.Placement.NUMANode))
		if n.Placement.NUMANode >= 0 {
			numas[n.Placement.NUMANode] = true
		}
	}
	if len(nics) == 0 {
		fmt.Fprintln(w, "Preference matrix: none (no RDMA NIC; transfers use tcp)")
		return 0
	}
	fmt.Fprintln(w, "Preference matrix (location: NICs, best first):")
	locs := []string{"cpu"}
	keys := make([]int, 0, len(numas))
	for n := range numas {
		keys = append(keys, n)
	}
	sort.Ints(keys)
	for _, n := range keys {
		locs = append(locs, "cpu:"+strconv.Itoa(n))
	}
	m := topo.Matrix(locs, nics)
	for _, l := range locs {
		fmt.Fprintf(w, "  %-8s %s\n", l, strings.Join(m[l], " "))
	}
	for _, g := range gpus {
		path := topo.PCIPathOf(sysRoot, g.bus)
		var order []int
		if path != "" {
			order = topo.Preference("pci:"+path, g.numa, nics)
		} else {
			order = topo.Preference("cpu:"+strconv.Itoa(g.numa), -1, nics)
		}
		names := make([]string, len(order))
		for i, k := range order {
			names[i] = nicName(nics, k)
		}
		fmt.Fprintf(w, "  %-8s %s\n", "cuda:"+strconv.Itoa(g.index), strings.Join(names, " "))
	}
	return 0
}

// nicName names NIC k as topo.Matrix does: its device name, with the port
// when the device has several.
func nicName(nics []topo.NIC, k int) string {
	for i, n := range nics {
		if i != k && n.Name == nics[k].Name {
			return nics[k].Name + ":" + strconv.Itoa(nics[k].Port)
		}
	}
	return nics[k].Name
}

func numaText(n int) string {
	if n < 0 {
		return "unknown"
	}
	return strconv.Itoa(n)
}

func orNone(s string) string {
	if s == "" {
		return "unknown"
	}
	return s
}

// findGPUs asks NVML, then the CUDA driver, and says which answered (or
// why neither did).
func findGPUs() ([]gpu, string) {
	var why []string
	if gs, err := nvmlGPUs(); err == nil {
		return gs, "NVML"
	} else {
		why = append(why, "nvml: "+err.Error())
	}
	d, err := cuda.Open(os.Getenv("KVFERRY_CUDA_LIBRARY"))
	if err != nil {
		why = append(why, err.Error())
		return nil, strings.Join(why, "; ")
	}
	var out []gpu
	for _, dev := range d.Devices() {
		numa := -1
		if p := topo.PCIPathOf("/sys", dev.PCIBusID); p != "" {
			if b, err := os.ReadFile(p + "/numa_node"); err == nil {
				if v, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && v >= 0 {
					numa = v
				}
			}
		}
		out = append(out, gpu{index: dev.Ordinal, name: dev.Name, bus: dev.PCIBusID, numa: numa})
	}
	return out, "CUDA driver " + d.Path() + "; " + strings.Join(why, "; ")
}

func nvmlGPUs() (gs []gpu, err error) {
	defer func() {
		// go-nvml panics when libnvidia-ml cannot be loaded on some
		// versions; that is "absent", not a crash.
		if r := recover(); r != nil {
			gs, err = nil, fmt.Errorf("%v", r)
		}
	}()
	if ret := nvml.Init(); ret != nvml.SUCCESS {
		return nil, fmt.Errorf("init: %v", nvml.ErrorString(ret))
	}
	defer nvml.Shutdown()
	n, ret := nvml.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("device count: %v", nvml.ErrorString(ret))
	}
	for i := range n {
		dev, ret := nvml.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("device %d: %v", i, nvml.ErrorString(ret))
		}
		g := gpu{index: i, numa: -1}
		g.name, _ = dev.GetName()
		if pci, ret := dev.GetPciInfo(); ret == nvml.SUCCESS {
			g.bus = strings.ToLower(cstr(pci.BusId[:]))
		}
		if nn, ret := dev.GetNumaNodeId(); ret == nvml.SUCCESS {
			g.numa = nn
		}
		gs = append(gs, g)
	}
	return gs, nil
}

func cstr(b []int8) string {
	var s []byte
	for _, c := range b {
		if c == 0 {
			break
		}
		s = append(s, byte(c))
	}
	return string(s)
}

// findNICs lists active RDMA ports the filter keeps.
func findNICs() ([]topo.NIC, string) {
	lib, err := verbs.Open(os.Getenv("KVFERRY_IBVERBS_LIBRARY"))
	if err != nil {
		return nil, err.Error()
	}
	filter, err := topo.ParseFilter(os.Getenv("KVFERRY_RDMA_DEVICES"))
	if err != nil {
		return nil, err.Error()
	}
	devs, err := lib.Devices()
	if err != nil {
		return nil, err.Error()
	}
	var out []topo.NIC
	for _, d := range devs {
		for _, p := range d.Ports {
			if p.Active() && filter.Match(d.Name, p.Num) {
				out = append(out, topo.NIC{Name: d.Name, Port: p.Num, Placement: topo.ReadPlacement(d.Path)})
			}
		}
	}
	how := lib.Path()
	if len(devs) == 0 {
		how += ": no device listed"
	}
	return out, how
}

// sameHost says which ways the same-host transport (shm) has here: engines
// on this host (same boot id, same network namespace) use it, the owner
// copying engine buffers through views of them, other memory by
// cross-memory attach where the kernel allows it, GPU memory through CUDA
// IPC, and tcp for what none of these reaches.
func sameHost(w io.Writer) {
	fmt.Fprintln(w, "Same-host transport (shm):")
	id, err := shm.BootID()
	if err != nil {
		fmt.Fprintf(w, "  unavailable: %v; peers on this host use tcp\n", err)
		return
	}
	fmt.Fprintf(w, "  boot id %s: engines with this boot id and network namespace use shm (KVFERRY_PROTOCOL=auto or shm), others tcp; off with authentication\n", id)
	if mem, err := memory.AllocShared(4096); err != nil {
		fmt.Fprintf(w, "  engine buffers: private memory (shareable memory failed: %v): moved by cross-memory attach or tcp\n", err)
	} else {
		_ = memory.Free(mem)
		fmt.Fprintln(w, "  engine buffers: shareable memory (memfd): the owner copies through a view of them")
	}
	fmt.Fprintf(w, "  other registered memory: %s\n", shm.AttachPolicy())
	switch d, err := cuda.Open(os.Getenv("KVFERRY_CUDA_LIBRARY")); {
	case err != nil:
		fmt.Fprintf(w, "  GPU memory: no CUDA driver (%v): staged through host memory\n", err)
	case !d.HasIPC():
		fmt.Fprintf(w, "  GPU memory: the driver %s has no CUDA IPC: staged through host memory\n", d.Path())
	case len(d.Devices()) == 0:
		fmt.Fprintln(w, "  GPU memory: no GPU")
	default:
		fmt.Fprintf(w, "  GPU memory: CUDA IPC (driver %s, %d GPUs): the owner opens the initiator's allocation and copies device to device\n", d.Path(), len(d.Devices()))
	}
}
