// Package topo tells the RDMA transport which NICs should carry a transfer,
// from where the memory lives: it reads each device's NUMA node and PCIe
// path from sysfs and orders the NICs for a memory location, closest first,
// as Mooncake's priority matrix and NCCL's topology search do. It needs no
// RDMA device and no cgo, so it works, and is tested, on any Linux machine.
package topo

import (
	"cmp"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// Placement is where a device sits: NUMANode (-1 unknown), PCIAddress
// ("0000:3b:00.0", "" unknown) and PCIPath, the resolved sysfs device
// directory ("/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0", ""
// unknown). Devices behind the same PCIe switch share a longer PCIPath
// prefix. Unknown fields still let callers rank devices, if less well.
type Placement struct {
	NUMANode   int
	PCIAddress string
	PCIPath    string
}

// pciAddr matches a PCI address as sysfs writes it (domain:bus:device.fn);
// the domain has more than 4 digits on some hosts (Intel VMD).
var pciAddr = regexp.MustCompile(`^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$`)

// rootBus matches the sysfs directory of a PCI root bus ("pci0000:3a"),
// where the PCIe tree of a path starts.
var rootBus = regexp.MustCompile(`^pci[0-9a-f]{4,8}:[0-9a-f]{2}$`)

// ReadPlacement reads a device's placement from its sysfs class directory
// (an ibv_device's ibdev_path, e.g. /sys/class/infiniband/mlx5_0). Missing or
// unreadable files give the unknown values rather than an error, because
// virtual devices (rxe, siw) have no PCI device behind them and must still
// be usable.
func ReadPlacement(dir string) Placement {
	dev := filepath.Join(dir, "device")
	p := Placement{NUMANode: -1}
	if b, err := os.ReadFile(filepath.Join(dev, "numa_node")); err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && n >= 0 {
			p.NUMANode = n
		}
	}
	if resolved, err := filepath.EvalSymlinks(dev); err == nil {
		p.PCIPath = resolved
	}
	if b, err := os.ReadFile(filepath.Join(dev, "uevent")); err == nil {
		for line := range strings.Lines(string(b)) {
			if v, ok := strings.CutPrefix(strings.TrimSpace(line), "PCI_SLOT_NAME="); ok {
				if a := normalizePCIAddress(v); a != "" {
					p.PCIAddress = a
				}
				break
			}
		}
	}
	if p.PCIAddress == "" && p.PCIPath != "" {
		// Old kernels and some drivers leave PCI_SLOT_NAME out of uevent; the
		// device link still ends in the address.
		p.PCIAddress = normalizePCIAddress(filepath.Base(p.PCIPath))
	}
	return p
}

// normalizePCIAddress returns a in sysfs spelling (lower case, a domain of
// at least 4 digits without extra leading zeros), or "" when a is not a PCI
// address. CUDA and NVML spell the same device "0000:3B:00.0" and
// "00000000:3B:00.0".
func normalizePCIAddress(a string) string {
	a = strings.ToLower(strings.TrimSpace(a))
	if dom, rest, ok := strings.Cut(a, ":"); ok && len(dom) > 4 {
		a = strings.TrimLeft(dom[:len(dom)-4], "0") + dom[len(dom)-4:] + ":" + rest
	}
	if !pciAddr.MatchString(a) {
		return ""
	}
	return a
}

// PCIPathOf resolves a PCI address to its PCIe path under sysRoot ("/sys"
// normally), "" when the device is absent or addr is not a PCI address (so
// that no addr can name a path outside bus/pci/devices). The cuda layer uses
// it to place GPUs.
func PCIPathOf(sysRoot, addr string) string {
	a := normalizePCIAddress(addr)
	if a == "" {
		return ""
	}
	resolved, err := filepath.EvalSymlinks(filepath.Join(sysRoot, "bus", "pci", "devices", a))
	if err != nil {
		return ""
	}
	return resolved
}

// NIC is one candidate device port: the verbs device Name ("mlx5_0"), its
// Port (from 1) and its Placement (see ReadPlacement).
type NIC struct {
	Name      string
	Port      int
	Placement Placement
}

// Filter selects devices as KVFERRY_RDMA_DEVICES says, with NCCL_IB_HCA's
// syntax: "" keeps all; "mlx5_0,mlx5_1:1" keeps those (a port after ':' keeps
// only that port); a leading '^' excludes the listed ones instead
// ("^mlx5_2"); a '=' (after any '^') means exact names, otherwise a name
// matches by prefix. The zero Filter keeps all.
type Filter struct {
	exclude bool
	exact   bool
	entries []filterEntry
}

// filterEntry is one listed device; port 0 stands for every port.
type filterEntry struct {
	name string
	port int
}

// deviceName matches the device names a filter may list; verbs names
// ("mlx5_0", "rxe_eth0") need no other characters.
var deviceName = regexp.MustCompile(`^[A-Za-z0-9_.-]+$`)

// maxPort is the largest verbs port number (a u8, and 0 is not a port).
const maxPort = 255

// ParseFilter parses a KVFERRY_RDMA_DEVICES value. Spaces around entries are
// ignored. It fails on empty entries, port numbers outside 1..255 and names
// with characters other than letters, digits, '_', '-' and '.', so that a
// typo is reported rather than silently selecting no device.
func ParseFilter(s string) (Filter, error) {
	var f Filter
	rest := strings.TrimSpace(s)
	if rest == "" {
		return f, nil
	}
	rest, f.exclude = strings.CutPrefix(rest, "^")
	rest, f.exact = strings.CutPrefix(rest, "=")
	for entry := range strings.SplitSeq(rest, ",") {
		e, err := parseEntry(strings.TrimSpace(entry))
		if err != nil {
			return Filter{}, fmt.Errorf("RDMA device filter %q: %w", s, err)
		}
		f.entries = append(f.entries, e)
	}
	return f, nil
}

// parseEntry parses one "name" or "name:port".
func parseEntry(entry string) (filterEntry, error) {
	name, port, hasPort := strings.Cut(entry, ":")
	if name == "" {
		return filterEntry{}, fmt.Errorf("empty device name in entry %q", entry)
	} else if !deviceName.MatchString(name) {
		return filterEntry{}, fmt.Errorf("device name %q has characters other than letters, digits, '_', '-' and '.'", name)
	}
	e := filterEntry{name: name}
	if !hasPort {
		return e, nil
	}
	// Digits only: Atoi alone would also take "+1" and "-0".
	n, err := strconv.Atoi(port)
	if err != nil || strings.Trim(port, "0123456789") != "" || n < 1 || n > maxPort {
		return filterEntry{}, fmt.Errorf("port %q of %q is not a number in 1..%d", port, name, maxPort)
	}
	e.port = n
	return e, nil
}

// Match reports whether the filter keeps port of the device called name.
func (f Filter) Match(name string, port int) bool {
	if len(f.entries) == 0 {
		return true
	}
	listed := slices.ContainsFunc(f.entries, func(e filterEntry) bool {
		nameOK := name == e.name || !f.exact && strings.HasPrefix(name, e.name)
		return nameOK && (e.port == 0 || e.port == port)
	})
	return listed != f.exclude
}

// String returns the filter in the syntax ParseFilter reads; parsing it
// gives an equal filter.
func (f Filter) String() string {
	var b strings.Builder
	if f.exclude {
		b.WriteByte('^')
	}
	if f.exact {
		b.WriteByte('=')
	}
	for i, e := range f.entries {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(e.name)
		if e.port != 0 {
			fmt.Fprintf(&b, ":%d", e.port)
		}
	}
	return b.String()
}

// Preference orders NIC indexes for memory at location, best first, every
// NIC exactly once, so the transport can use the head and retry down the
// list. Equal ranks keep input order.
//
//   - "cpu:N": NICs on NUMA node N, then those of unknown node, then the rest.
//   - "cpu" or "": input order.
//   - "pci:<PCIe path>" (a GPU, from PCIPathOf): NICs sharing the longest
//     PCIe path with it first, counted in whole components from the root bus
//     (same switch beats same root complex beats none), then those on NUMA
//     node numa when numa >= 0, then the rest.
//
// Any other location gives input order: an unplaceable buffer still works.
func Preference(location string, numa int, nics []NIC) []int {
	keys := rankKeys(location, numa, nics)
	order := make([]int, len(nics))
	for i := range nics {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(keys[a], keys[b]) })
	return order
}

// Tiers gives each NIC (by index) its tier for memory at location, as
// Preference ranks them: 0 for the best, and the same tier for NICs that
// are equally good, so that a transport can spread work across those
// rather than always take the first.
func Tiers(location string, numa int, nics []NIC) []int {
	keys := rankKeys(location, numa, nics)
	distinct := slices.Clone(keys)
	slices.Sort(distinct)
	distinct = slices.Compact(distinct)
	tiers := make([]int, len(nics))
	for i, k := range keys {
		tiers[i], _ = slices.BinarySearch(distinct, k)
	}
	return tiers
}

// rankKeys is each NIC's closeness to memory at location, lower better.
func rankKeys(location string, numa int, nics []NIC) []int {
	rank := func(NIC) int { return 0 } // lower is better
	if v, ok := strings.CutPrefix(location, "cpu:"); ok {
		if node, err := strconv.Atoi(v); err == nil && node >= 0 {
			rank = func(n NIC) int {
				switch {
				case n.Placement.NUMANode == node:
					return 0
				case n.Placement.NUMANode < 0:
					return 1
				}
				return 2
			}
		}
	} else if path, ok := strings.CutPrefix(location, "pci:"); ok && path != "" {
		gpu := pcieComponents(path)
		rank = func(n NIC) int {
			nic, shared := pcieComponents(n.Placement.PCIPath), 0
			for shared < len(gpu) && shared < len(nic) && gpu[shared] == nic[shared] {
				shared++
			}
			if numa >= 0 && n.Placement.NUMANode == numa {
				return -2 * shared // a shared component outweighs the NUMA node
			}
			return 1 - 2*shared
		}
	}
	keys := make([]int, len(nics))
	for i, n := range nics {
		keys[i] = rank(n)
	}
	return keys
}

// pcieComponents returns the components of a sysfs device path from its
// root bus ("pci0000:3a") on, or nil when it has none. Starting there keeps
// the "/sys/devices" every path shares from counting as closeness.
func pcieComponents(path string) []string {
	parts := strings.Split(filepath.ToSlash(filepath.Clean(path)), "/")
	for i, p := range parts {
		if rootBus.MatchString(p) {
			return parts[i:]
		}
	}
	return nil
}

// Matrix is the preference list of every location in locations: location ->
// NIC names in order, what a segment publishes (Mooncake's priority matrix).
// A NIC whose Name appears more than once in nics (several ports) is written
// "name:port", as in Filter, so every entry names one port. pci locations
// are ranked without a NUMA node, which the location does not carry.
func Matrix(locations []string, nics []NIC) map[string][]string {
	seen := make(map[string]int, len(nics))
	for _, n := range nics {
		seen[n.Name]++
	}
	m := make(map[string][]string, len(locations))
	for _, loc := range locations {
		names := make([]string, 0, len(nics))
		for _, i := range Preference(loc, -1, nics) {
			name := nics[i].Name
			if seen[name] > 1 {
				name += ":" + strconv.Itoa(nics[i].Port)
			}
			names = append(names, name)
		}
		m[loc] = names
	}
	return m
}
