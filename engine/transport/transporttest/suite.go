// Package transporttest is a conformance suite for transport.Endpoint
// implementations. Run connects fresh initiator endpoints to an owner whose
// memory is a memory.Registry (through Owner, an adaptor like the engine's
// Admit) and checks what every transport promises: data moved byte for byte,
// bad accesses refused without touching memory, unregistration and Abort
// that stop copies when they return, TryCancel that keeps a slice's memory
// untouched, and exactly one Done per slice.
package transporttest

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/transport"
)

// Factory connects a new initiator-side endpoint to owner, whose memory the
// endpoint's slices access. It registers the teardown of whatever it built
// (endpoint, transports, listeners) with t.Cleanup. The suite calls it once
// per subtest.
type Factory func(t *testing.T, owner transport.Owner) transport.Endpoint

// Sizes and timings of the suite.
const (
	// GuardLen bytes of GuardByte surround every buffer the suite registers;
	// no transport may touch them.
	GuardLen  = 4096
	GuardByte = 0xAA

	mib = 1 << 20

	// doneTimeout bounds the wait for slices that should end; a slice
	// still running then is reported as hung.
	doneTimeout = 20 * time.Second
)

// Run runs the suite against the endpoints f builds.
func Run(t *testing.T, f Factory) {
	run(t, f)
}

// allocShared makes the suite's buffers shareable memory (memfd) instead
// of private anonymous memory; set by RunShared only, for its run.
var allocShared atomic.Bool

// RunShared runs the suite with every buffer, the owner's and the
// initiator's, allocated as shareable memory (memory.AllocShared), as an
// engine allocates its buffers: for transports that treat such memory
// differently (shm). It must not run at the same time as another run of the
// suite.
func RunShared(t *testing.T, f Factory) {
	allocShared.Store(true)
	defer allocShared.Store(false)
	run(t, f)
}

func run(t *testing.T, f Factory) {
	before := transport.IllegalTransitions()
	t.Cleanup(func() {
		if n := transport.IllegalTransitions() - before; n > 0 {
			t.Errorf("%d slice state moves the state table refuses", n)
		}
	})
	for _, c := range []struct {
		name string
		run  func(*testing.T, Factory)
	}{
		{"transfers", runTransfers},
		{"refusals", runRefusals},
		{"unregistering owner memory during a large WRITE stops it before Unregister returns", testUnregisterInFlight},
		{"unregistering initiator memory during a large READ stops it before Unregister returns", testUnregisterLocalInFlight},
		{"TryCancel of queued slices keeps them from ending and from touching memory", testTryCancelQueued},
		{"Abort with slices queued and in flight fails each of them exactly once", testAbortQueuedAndInFlight},
		{"slices failed by Abort can be reset and posted again on a fresh endpoint", testRepostAfterAbort},
		{"Abort from several goroutines during a busy stream ends every slice exactly once and stops touching memory", testAbortBusyStream},
		{"Abort returns promptly while the path is busy sending a long Post", testAbortLongPost},
	} {
		t.Run(c.name, func(t *testing.T) { c.run(t, f) })
	}
}

// Environment: registries, buffers with guard bytes, tracked slices.
