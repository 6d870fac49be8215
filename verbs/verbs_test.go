package verbs_test

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/kvferry/kvferry/internal/fakeverbs"
	"github.com/kvferry/kvferry/verbs"
)

func TestMain(m *testing.M) {
	cleanup := fakeverbs.UseFabric()
	code := m.Run()
	cleanup()
	os.Exit(code)
}

func TestMissingLibraryIsNotAvailable(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "libibverbs.so.1")
	_, err := verbs.Open(missing)
	if !errors.Is(err, verbs.ErrNotAvailable) {
		t.Fatalf("Open(%s) = %v, want ErrNotAvailable", missing, err)
	}
	if !strings.Contains(err.Error(), "rdma not available") || !strings.Contains(err.Error(), missing) {
		t.Errorf("error %q should say rdma is not available and name the file", err)
	}
}

func TestNotALibbverbs(t *testing.T) {
	// libc loads but has no ibv_ symbol: refused cleanly, not a crash.
	_, err := verbs.Open("libc.so.6")
	if !errors.Is(err, verbs.ErrNotAvailable) || !strings.Contains(err.Error(), "ibv_get_device_list") {
		t.Fatalf("Open(libc.so.6) = %v, want ErrNotAvailable naming the missing symbol", err)
	}
}

// openFake opens the first device of the fake provider or, with
// KVFERRY_TEST_RDMA=1, of the system's libibverbs (real devices).
func openFake(t *testing.T) (*verbs.Library, *verbs.Context) {
	t.Helper()
	lib, err := verbs.Open(fakeverbs.Library(t))
	if err != nil {
		t.Fatal(err)
	}
	if lib.DeviceCount() == 0 {
		t.Fatalf("%s lists no device", lib.Path())
	}
	ctx, err := lib.OpenContext(0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ctx.Close() })
	return lib, ctx
}

// Every device has an active port, a max MR size and a sysfs path; a RoCE
// port has a GID, and where sysfs says the GIDs' types (real devices), the
// one chosen is RoCE v2, which routes over IP.
func TestDevicesHaveActivePortsAndRoCEv2GIDs(t *testing.T) {
	lib, _ := openFake(t)
	devs, err := lib.Devices()
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range devs {
		if len(d.Ports) == 0 || !d.Ports[0].Active() || d.Attr.MaxMRSize == 0 || d.Path == "" {
			t.Errorf("device %+v: want an active port, a max MR size and a sysfs path", d)
		}
		p := d.Ports[0]
		if p.Ethernet() && p.GIDIndex < 0 {
			t.Errorf("device %s: RoCE port without a GID", d.Name)
			continue
		}
		typ, err := os.ReadFile(fmt.Sprintf("%s/ports/%d/gid_attrs/types/%d", d.Path, p.Num, p.GIDIndex))
		if p.Ethernet() && err == nil && strings.TrimSpace(string(typ)) != "RoCE v2" {
			t.Errorf("device %s: GID %d is of type %q; want RoCE v2", d.Name, p.GIDIndex, strings.TrimSpace(string(typ)))
		}
		t.Logf("device %s port %d: link %v, active MTU %d, GID index %d (%s)", d.Name, p.Num, p.Ethernet(), p.ActiveMTU, p.GIDIndex, strings.TrimSpace(string(typ)))
	}
	t.Logf("%s: %d devices", lib.Path(), len(devs))
}

// TestBadTransitionMasksAreRefused drives a QP through RESET -> INIT -> RTR
// -> RTS with each required attribute left out in turn: the provider must
// refuse every one (EINVAL), and the correct masks must pass.
func TestBadTransitionMasksAreRefused(t *testing.T) {
	_, ctx := openFake(t)
	pd, err := ctx.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	defer pd.Dealloc()
	cq, err := ctx.CreateCQ(64)
	if err != nil {
		t.Fatal(err)
	}
	defer cq.Destroy()
	a, err := pd.CreateQP(cq, cq, 16, 16, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Destroy()
	b, err := pd.CreateQP(cq, cq, 16, 16, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Destroy()
	port := ctx.Ports[0]
	access := verbs.AccessLocalWrite | verbs.AccessRemoteWrite | verbs.AccessRemoteRead
	steps := []struct {
		name string
		attr verbs.QPAttr
		mask verbs.AttrMask
	}{
		{"RESET->INIT", verbs.QPAttr{State: verbs.StateInit, Port: port.Num, Access: access}, verbs.MaskInit},
		{"INIT->RTR", verbs.QPAttr{
			State: verbs.StateRTR, Port: port.Num, PathMTU: port.ActiveMTU, DestQPN: b.Num, RQPSN: 1,
			DLID: port.LID, Global: port.Ethernet(), DGID: port.GID, SGIDIndex: max(port.GIDIndex, 0),
			HopLimit: 64, MaxDestRdAtomic: 1, MinRNRTimer: 12,
		}, verbs.MaskRTR},
		{"RTR->RTS", verbs.QPAttr{State: verbs.StateRTS, SQPSN: 1, Timeout: 14, RetryCnt: 7, RNRRetry: 7, MaxRdAtomic: 1}, verbs.MaskRTS},
	}
	for _, st := range steps {
		for bit := verbs.AttrMask(1); bit <= verbs.AttrDestQPN; bit <<= 1 {
			if st.mask&bit == 0 || bit == verbs.AttrState {
				continue
			}
			err := a.Modify(&st.attr, st.mask&^bit)
			if !errors.Is(err, syscall.EINVAL) {
				t.Errorf("%s without attribute bit %#x: %v, want EINVAL", st.name, int(bit), err)
			}
		}
		// An attribute the transition does not take.
		extra := verbs.AttrDestQPN
		if st.mask&extra != 0 {
			extra = verbs.AttrPort
		}
		if err := a.Modify(&st.attr, st.mask|extra); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("%s with extra attribute bit %#x: %v, want EINVAL", st.name, int(extra), err)
		}
		if err := a.Modify(&st.attr, st.mask); err != nil {
			t.Fatalf("%s with the right mask: %v", st.name, err)
		}
	}
	if s, err := a.State(); err != nil || s != verbs.StateRTS {
		t.Fatalf("state after the transitions: %d, %v; want RTS", s, err)
	}
	if err := a.ToError(); err != nil {
		t.Fatalf("to error: %v", err)
	}
}
