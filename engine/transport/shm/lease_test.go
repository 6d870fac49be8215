package shm_test

import (
	"bytes"
	"context"
	"sync"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/engine/transport/shm"
	"github.com/kvferry/kvferry/engine/transport/transporttest"
)

// TestAStoppedPathIsNotWrittenAfterAbortReturns: the owner copies a READ
// into the initiator's memory itself, so the initiator's Abort (what a
// deadline or a cancel comes down to) must not return while the owner may
// still write there (SAFETY.md promise 3). The owner is paused inside its
// own guard, right before its first chunk, while the initiator aborts the
// path; once Abort returned the owner goes on. With the lease its chunk is
// refused and the initiator's memory keeps what it held when Abort
// returned; with the owner ignoring the lease (the unsafe row), the bytes
// land after Abort returned, which the same check finds.
func TestAStoppedPathIsNotWrittenAfterAbortReturns(t *testing.T) {
	for _, row := range []struct {
		name   string
		unsafe bool
		shared bool
	}{
		{"lease honoured, shared buffer", false, true},
		{"lease honoured, cross-memory attach", false, false},
		{"lease ignored, shared buffer (unsafe)", true, true},
		{"lease ignored, cross-memory attach (unsafe)", true, false},
	} {
		t.Run(row.name, func(t *testing.T) {
			landed := abortDuringOwnerCopy(t, shm.Options{UnsafeIgnoreLease: row.unsafe}, row.shared)
			switch {
			case row.unsafe && !landed:
				t.Fatal("with the lease ignored no byte landed after Abort returned: the protected rows prove nothing")
			case !row.unsafe && landed:
				t.Fatal("the owner wrote into the initiator's memory after Abort returned")
			}
		})
	}
}

// abortDuringOwnerCopy runs the scenario and reports whether the
// initiator's memory changed after Abort returned.
func abortDuringOwnerCopy(t *testing.T, ownerOpts shm.Options, shared bool) bool {
	const n = 1 << 20
	ownerReg, initReg := memory.NewRegistry(), memory.NewRegistry()
	owner := transporttest.NewOwner(ownerReg)
	ownerSide, err := shm.New(ownerOpts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ownerSide.Close() })
	addr, err := ownerSide.Listen(owner)
	if err != nil {
		t.Fatal(err)
	}
	initSide, err := shm.New(shm.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = initSide.Close() })
	initReg.Watch(initSide)

	alloc := func(reg *memory.Registry, fillWith byte) ([]byte, *memory.Region) {
		var mem []byte
		var err error
		if shared {
			mem, err = memory.AllocShared(n)
		} else {
			mem, _, err = memory.Alloc(n)
		}
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = memory.Free(mem) })
		for i := range mem {
			mem[i] = fillWith
		}
		regs, err := reg.Register([]memory.Range{{Mem: mem, Location: "cpu"}})
		if err != nil {
			t.Fatal(err)
		}
		return mem, regs[0]
	}
	src, srcReg := alloc(ownerReg, 0xab)
	dst, dstReg := alloc(initReg, 0)
	_ = src

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ep, err := initSide.Dial(ctx, addr, "initiator")
	if err != nil {
		t.Fatal(err)
	}
	// Pause the owner in its first chunk's guard, before it touches the
	// initiator's memory.
	paused, resume := make(chan struct{}), make(chan struct{})
	var once sync.Once
	owner.OnEnter(func() {
		once.Do(func() {
			close(paused)
			<-resume
		})
	})
	done := make(chan error, 1)
	s := &transport.Slice{Op: transport.Read, Local: dst, LocalReg: dstReg, Key: srcReg.Key, Remote: srcReg.Addr,
		Done: func(_ *transport.Slice, err error) { done <- err }}
	s.Reset()
	ep.Post([]*transport.Slice{s})
	select {
	case <-paused:
	case <-time.After(5 * time.Second):
		t.Fatal("the owner never started copying")
	}
	aborted := make(chan struct{})
	go func() {
		ep.Abort(transport.ErrCanceled)
		close(aborted)
	}()
	select {
	case <-aborted:
	case <-time.After(5 * time.Second):
		close(resume)
		t.Fatal("Abort did not return while the owner was paused before its chunk")
	}
	snapshot := bytes.Clone(dst)
	before := ownerSide.Stats()
	close(resume)
	// The owner's answer to the slice is counted once its copy ended
	// (bytes out, or a refusal).
	if !transporttest.WaitFor(5*time.Second, func() bool {
		st := ownerSide.Stats()
		return st.BytesOut > before.BytesOut || st.Refused > before.Refused
	}) {
		t.Fatal("the owner never finished the slice")
	}
	select {
	case err := <-done:
		if err == nil {
			t.Errorf("the aborted slice ended without an error")
		}
	case <-time.After(5 * time.Second):
		t.Error("the aborted slice never ended")
	}
	return !bytes.Equal(snapshot, dst)
}
