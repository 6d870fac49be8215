package topo

import (
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"testing"
)

// sysfs is a fake /sys in a temporary directory, resolved so that expected
// paths compare equal to what EvalSymlinks returns.
func sysfs(t *testing.T) string {
	t.Helper()
	root, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// mk creates path under root with its parents: a symlink to target when
// target is set, else a file holding data.
func mk(t *testing.T, root, path, data, target string) {
	t.Helper()
	p := filepath.Join(root, path)
	err := os.MkdirAll(filepath.Dir(p), 0o755)
	if err == nil && target != "" {
		err = os.Symlink(target, p)
	} else if err == nil {
		err = os.WriteFile(p, []byte(data), 0o644)
	}
	if err != nil {
		t.Fatal(err)
	}
}

func TestReadPlacement(t *testing.T) {
	const pci, virt = "devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0", "devices/virtual/net/eth0"
	tests := []struct {
		name, device, numa, uevent string    // device: the link's target, "" for none
		want                       Placement // PCIPath relative to the fake /sys
	}{
		{"uevent names the PCI address", pci, "1\n", "DRIVER=mlx5_core\nPCI_SLOT_NAME=0000:3b:00.0\n",
			Placement{1, "0000:3b:00.0", pci}},
		{"without uevent the link's base name is the address", pci, "-1\n", "", Placement{-1, "0000:3b:00.0", pci}},
		{"a non-PCI device has a path but no address", virt, "", "INTERFACE=eth0\n", Placement{-1, "", virt}},
		{"missing files give unknown values", "", "", "", Placement{-1, "", ""}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			root := sysfs(t)
			mk(t, root, "class/infiniband/dev0/node_type", "1\n", "")
			if tt.device != "" {
				for file, data := range map[string]string{"numa_node": tt.numa, "uevent": tt.uevent} {
					if data != "" {
						mk(t, root, tt.device+"/"+file, data, "")
					}
				}
				mk(t, root, "class/infiniband/dev0/device", "", "../../../"+tt.device)
			}
			want := tt.want
			if want.PCIPath != "" {
				want.PCIPath = filepath.Join(root, want.PCIPath)
			}
			if got := ReadPlacement(filepath.Join(root, "class/infiniband/dev0")); got != want {
				t.Errorf("ReadPlacement = %+v, want %+v", got, want)
			}
		})
	}
}

func TestPCIPathOf(t *testing.T) {
	root := sysfs(t)
	const gpuDir = "devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0/0000:3c:08.0/0000:3e:00.0"
	mk(t, root, gpuDir+"/uevent", "PCI_SLOT_NAME=0000:3e:00.0\n", "")
	mk(t, root, "bus/pci/devices/0000:3e:00.0", "", "../../../"+gpuDir)
	tests := []struct{ addr, want string }{
		{"0000:3e:00.0", filepath.Join(root, gpuDir)},
		{"0000:3E:00.0", filepath.Join(root, gpuDir)},     // CUDA's spelling
		{"00000000:3e:00.0", filepath.Join(root, gpuDir)}, // NVML's spelling
		{"0000:99:00.0", ""},
		{"../../../devices", ""},
		{"", ""},
	}
	for _, tt := range tests {
		if got := PCIPathOf(root, tt.addr); got != tt.want {
			t.Errorf("PCIPathOf(%q) = %q, want %q", tt.addr, got, tt.want)
		}
	}
}

var goodFilters = []struct{ in, canonical string }{
	{"", ""},
	{"mlx5_0", "mlx5_0"},
	{" mlx5_0 , mlx5_1:1 ", "mlx5_0,mlx5_1:1"},
	{"^mlx5_2", "^mlx5_2"},
	{"^=mlx5_0:02", "^=mlx5_0:2"},
	{"=mlx5.a-b", "=mlx5.a-b"},
}

var badFilters = []string{",", "mlx5_0,", "^", "=", "^=", "mlx5_0:", "mlx5_0:0", "mlx5_0:256",
	"mlx5_0:+1", "mlx5_0:x", "mlx 5", "mlx5/0", ":1", "=^mlx5", "mlx5_0:1:2"}

func TestParseFilter(t *testing.T) {
	for _, tt := range goodFilters {
		f, err := ParseFilter(tt.in)
		if err != nil {
			t.Errorf("ParseFilter(%q): %v", tt.in, err)
		} else if got := f.String(); got != tt.canonical {
			t.Errorf("ParseFilter(%q).String() = %q, want %q", tt.in, got, tt.canonical)
		}
	}
	for _, in := range badFilters {
		if f, err := ParseFilter(in); err == nil {
			t.Errorf("ParseFilter(%q) = %q, want an error", in, f)
		}
	}
}

func TestFilterMatch(t *testing.T) {
	tests := []struct {
		filter, name string
		port         int
		want         bool
	}{
		{"", "anything", 1, true},
		{"mlx5", "mlx5_0", 1, true},
		{"mlx5_0", "mlx5_1", 1, false},
		{"=mlx5", "mlx5_0", 1, false},
		{"=mlx5_0", "mlx5_0", 2, true},
		{"mlx5_0,mlx5_1:1", "mlx5_1", 1, true},
		{"mlx5_0,mlx5_1:1", "mlx5_1", 2, false},
		{"^mlx5_2", "mlx5_2", 1, false},
		{"^mlx5_2", "mlx5_0", 1, true},
		{"^mlx5_2:2", "mlx5_2", 1, true},
		{"^=mlx5", "mlx5_0", 1, true},
		{"^=mlx5", "mlx5", 1, false},
	}
	for _, tt := range tests {
		f, err := ParseFilter(tt.filter)
		if err != nil {
			t.Fatal(err)
		}
		if got := f.Match(tt.name, tt.port); got != tt.want {
			t.Errorf("%q.Match(%q, %d) = %v, want %v", tt.filter, tt.name, tt.port, got, tt.want)
		}
	}
}

func FuzzParseFilter(f *testing.F) {
	for _, tt := range goodFilters {
		f.Add(tt.in)
	}
	for _, in := range badFilters {
		f.Add(in)
	}
	f.Fuzz(func(t *testing.T, s string) {
		parsed, err := ParseFilter(s)
		if err != nil {
			return
		}
		again, err := ParseFilter(parsed.String())
		if err != nil || !reflect.DeepEqual(again, parsed) {
			t.Fatalf("ParseFilter(%q) = %#v; its String %q parses to %#v, %v", s, parsed, parsed.String(), again, err)
		}
	})
}

func nic(name string, numa int, path string) NIC {
	return NIC{Name: name, Port: 1, Placement: Placement{NUMANode: numa, PCIPath: path}}
}

func TestPreference(t *testing.T) {
	mixed := []NIC{nic("a", 1, ""), nic("b", -1, ""), nic("c", 0, ""), nic("d", 1, ""), nic("e", 0, "")}
	const gpu = "/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0/0000:3c:08.0/0000:3e:00.0"
	pcie := []NIC{
		nic("unknown", 0, ""),
		nic("far1", 1, "/sys/devices/pci0000:d7/0000:d7:00.0/0000:d8:00.0"),
		nic("far0", 0, "/sys/devices/pci0000:d7/0000:d7:02.0/0000:d9:00.0"),
		nic("rootcomplex", -1, "/sys/devices/pci0000:3a/0000:3a:02.0/0000:40:00.0"),
		nic("switch", 1, "/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0/0000:3c:10.0/0000:3f:00.0"),
	}
	tests := []struct {
		name     string
		location string
		numa     int
		nics     []NIC
		want     []int
	}{
		{"cpu:1 puts node 1, then unknown, then the rest", "cpu:1", -1, mixed, []int{0, 3, 1, 2, 4}},
		{"cpu:0 keeps input order among equals", "cpu:0", -1, mixed, []int{2, 4, 1, 0, 3}},
		{"cpu without a node keeps input order", "cpu", -1, mixed, []int{0, 1, 2, 3, 4}},
		{"an empty location keeps input order", "", 0, mixed, []int{0, 1, 2, 3, 4}},
		{"a bad node keeps input order", "cpu:-1", -1, mixed, []int{0, 1, 2, 3, 4}},
		{"an unknown form keeps input order", "gpu:0", 1, mixed, []int{0, 1, 2, 3, 4}},
		{"same switch beats same root complex beats none", "pci:" + gpu, -1, pcie, []int{4, 3, 0, 1, 2}},
		{"the NUMA node breaks ties among the far ones", "pci:" + gpu, 0, pcie, []int{4, 3, 0, 2, 1}},
		{"the NUMA node never beats the PCIe tree", "pci:" + gpu, 1, pcie, []int{4, 3, 1, 0, 2}},
		{"an empty pci path keeps input order", "pci:", 1, pcie, []int{0, 1, 2, 3, 4}},
		{"no NICs give an empty list", "cpu:0", 0, nil, []int{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Preference(tt.location, tt.numa, tt.nics); !slices.Equal(got, tt.want) {
				t.Errorf("Preference(%q, %d) = %v, want %v", tt.location, tt.numa, got, tt.want)
			}
		})
	}
}

// Tiers give equally good NICs the same tier, so that a transport spreads
// work across them instead of always taking the first in the order.
func TestTiers(t *testing.T) {
	mixed := []NIC{nic("a", 1, ""), nic("b", -1, ""), nic("c", 0, ""), nic("d", 1, ""), nic("e", 0, "")}
	tests := []struct {
		location string
		want     []int
	}{
		{"cpu", []int{0, 0, 0, 0, 0}},
		{"cpu:1", []int{0, 1, 2, 0, 2}},
		{"cpu:0", []int{2, 1, 0, 2, 0}},
		{"gpu:0", []int{0, 0, 0, 0, 0}},
	}
	for _, tt := range tests {
		got := Tiers(tt.location, -1, mixed)
		if !slices.Equal(got, tt.want) {
			t.Errorf("Tiers(%q) = %v, want %v", tt.location, got, tt.want)
		}
		// The tiers agree with the order Preference gives.
		pref := Preference(tt.location, -1, mixed)
		for i := 1; i < len(pref); i++ {
			if got[pref[i]] < got[pref[i-1]] {
				t.Errorf("%q: Preference %v puts NIC %d (tier %d) after NIC %d (tier %d)", tt.location, pref, pref[i], got[pref[i]], pref[i-1], got[pref[i-1]])
			}
		}
	}
}

func TestMatrix(t *testing.T) {
	nics := []NIC{
		{Name: "mlx5_0", Port: 1, Placement: Placement{NUMANode: 0}},
		{Name: "mlx5_1", Port: 1, Placement: Placement{NUMANode: 1}},
		{Name: "mlx5_1", Port: 2, Placement: Placement{NUMANode: 1}},
	}
	got := Matrix([]string{"cpu:1", "cpu:0", "cpu"}, nics)
	want := map[string][]string{
		"cpu:1": {"mlx5_1:1", "mlx5_1:2", "mlx5_0"},
		"cpu:0": {"mlx5_0", "mlx5_1:1", "mlx5_1:2"},
		"cpu":   {"mlx5_0", "mlx5_1:1", "mlx5_1:2"},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Matrix = %v, want %v", got, want)
	}
	if got := Matrix(nil, nics); got == nil || len(got) != 0 {
		t.Errorf("Matrix(nil) = %#v, want an empty map", got)
	}
}
