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

// newQPs opens the first fake device and creates n QPs in RESET on one
// protection domain, sharing one CQ; all are destroyed when the test ends.
func newQPs(t *testing.T, n int) (*verbs.Context, []*verbs.QP) {
	t.Helper()
	_, ctx := openFake(t)
	pd, err := ctx.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pd.Dealloc() })
	cq, err := ctx.CreateCQ(64)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cq.Destroy() })
	qps := make([]*verbs.QP, n)
	for i := range qps {
		if qps[i], err = pd.CreateQP(cq, cq, 16, 16, 0); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = qps[i].Destroy() })
	}
	return ctx, qps
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
	ctx, qps := newQPs(t, 2)
	a, b := qps[0], qps[1]
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

// Posting nothing succeeds at once, even on a destroyed QP; a provider's
// refusal names how many work requests or receives, and the QP; a
// destroyed QP refuses with ErrClosed and posts nothing.
func TestPostsOfNothingOfARefusedListAndOnADestroyedQP(t *testing.T) {
	_, qps := newQPs(t, 1)
	q := qps[0]
	sends, recvs := make([]verbs.WR, 2), make([]verbs.RecvWR, 3)
	check := func(what string, n int, err error, want error, text string) {
		t.Helper()
		if n != 0 || !errors.Is(err, want) || (text != "" && fmt.Sprint(err) != text) {
			t.Errorf("%s: %d posted, %v; want 0, %v %q", what, n, err, want, text)
		}
	}
	// A QP in RESET takes no work request and no receive.
	n, err := q.PostSend(sends)
	check("PostSend in RESET", n, err, syscall.EINVAL, fmt.Sprintf("post 2 work requests on qp %#x: invalid argument", q.Num))
	n, err = q.PostRecv(recvs)
	check("PostRecv in RESET", n, err, syscall.EINVAL, fmt.Sprintf("post 3 receives on qp %#x: invalid argument", q.Num))
	if err := q.Destroy(); err != nil {
		t.Fatal(err)
	}
	n, err = q.PostSend(nil)
	check("PostSend of nothing after Destroy", n, err, nil, "")
	n, err = q.PostRecv(nil)
	check("PostRecv of nothing after Destroy", n, err, nil, "")
	n, err = q.PostSend(sends)
	check("PostSend after Destroy", n, err, verbs.ErrClosed, verbs.ErrClosed.Error())
	n, err = q.PostRecv(recvs)
	check("PostRecv after Destroy", n, err, verbs.ErrClosed, verbs.ErrClosed.Error())
}
