package fakeverbs

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/kvferry/kvferry/verbs"
)

// Real reports whether the rdma tests run on this host's real RDMA devices
// through the system's libibverbs (KVFERRY_TEST_RDMA=1: soft-RoCE in the
// qemu guest of tests/rxe, or a machine with NICs) rather than on the fake.
func Real() bool { return os.Getenv("KVFERRY_TEST_RDMA") == "1" }

// Library is the libibverbs the rdma tests load: the system's when Real,
// else the fake (built on first use).
func Library(t testing.TB) string {
	t.Helper()
	if Real() {
		return verbs.DefaultLibrary
	}
	return Path(t)
}

// Devices is the device filter of the engine that plays role ("owner",
// "initiator", or "" for an engine that may use every device) in an rdma
// test: on real devices KVFERRY_TEST_RDMA_OWNER_DEVICES or
// KVFERRY_TEST_RDMA_INITIATOR_DEVICES when set (so that the two ends use
// different NICs and their traffic crosses a link), else
// KVFERRY_RDMA_DEVICES; on the fake "" (every fake NIC).
func Devices(role string) string {
	if !Real() {
		return ""
	}
	if v := os.Getenv("KVFERRY_TEST_RDMA_" + strings.ToUpper(role) + "_DEVICES"); role != "" && v != "" {
		return v
	}
	return os.Getenv("KVFERRY_RDMA_DEVICES")
}

// NeedFake skips a test that needs the fake provider (fault injection,
// placement it controls, its NUMA layout) when the tests run on real
// devices: a skip, never a pass.
func NeedFake(t testing.TB, why string) {
	t.Helper()
	if Real() {
		t.Skipf("needs the fake libibverbs (%s); KVFERRY_TEST_RDMA=1 runs on real devices", why)
	}
}

// SlowPlacement makes the owner place the initiator's WRITEs slowly, so
// that they are certainly in flight when a test aborts: on the fake a
// delay of us microseconds between the 64 KiB chunks it places (the
// fake's "delay" fault on fake0 and fake1); on real devices a token
// bucket on the links named by KVFERRY_TEST_RDMA_NETDEVS at the same rate
// (64 KiB per us), with a queue deep enough that nothing is dropped. Both
// are undone when the test ends. On real devices without those links the
// test is skipped, saying why.
func SlowPlacement(t testing.TB, us int) {
	t.Helper()
	if !Real() {
		Control(t, fmt.Sprintf("delay dev=fake0 us=%d;delay dev=fake1 us=%d", us, us))
		return
	}
	devs := strings.Fields(os.Getenv("KVFERRY_TEST_RDMA_NETDEVS"))
	if len(devs) == 0 {
		t.Skip("slowing real rdma traffic needs the links it crosses in KVFERRY_TEST_RDMA_NETDEVS (tests/rxe sets them)")
	}
	kbit := max(65536*8*1000/us, 1000) // 64 KiB per us microseconds, in kbit/s
	for _, d := range devs {
		out, err := exec.Command("tc", "qdisc", "replace", "dev", d, "root", "tbf",
			"rate", fmt.Sprintf("%dkbit", kbit), "burst", "64kb", "limit", "64mb").CombinedOutput()
		if err != nil {
			t.Fatalf("shape %s to %d kbit/s: %v: %s", d, kbit, err, out)
		}
		t.Cleanup(func() { _ = exec.Command("tc", "qdisc", "del", "dev", d, "root").Run() })
	}
}
