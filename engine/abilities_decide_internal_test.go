package engine

import (
	"context"
	"testing"

	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/engine/transport/local"
	"github.com/kvferry/kvferry/engine/transport/rdma"
	"github.com/kvferry/kvferry/engine/transport/tcp"
)

// nicLike has rdma's abilities (the NIC moves the bytes, an owner-side
// fence that can be switched off, rkey holders, connected initiators),
// with its switch set by the test.
type nicLike struct{ fenceOn bool }

func (nicLike) Name() string                                                     { return "nic" }
func (nicLike) Listen(transport.Owner) (string, error)                           { return "", nil }
func (nicLike) Dial(context.Context, string, string) (transport.Endpoint, error) { return nil, nil }
func (nicLike) Close() error                                                     { return nil }
func (nicLike) OwnerCopies() bool                                                { return false }
func (nicLike) Fence(context.Context, string) error                              { return nil }
func (n nicLike) FenceEnabled() bool                                             { return n.fenceOn }
func (nicLike) Holders(uint64) []string                                          { return nil }
func (nicLike) Initiators() []string                                             { return nil }

// unswitched has a fence and no switch: its fence is always on.
type unswitched struct{ nicLike }

func (unswitched) FenceEnabled() {} // not a FenceSwitch: wrong signature on purpose

// Abort, needDrainedAcks, Revoke and Fence each decide which fence serves
// a transport: refusal where the owner's code copies the bytes (tcp,
// local), the transport's owner-side fence when it has one switched on,
// else the initiators' drained ACKs. These are the decisions the engine
// made by asking each transport for FenceEnabled through an anonymous
// interface at every call; abilitiesOf finds them once, and must decide
// the same for tcp, local and rdma with its fence on and off.
func TestTransportAbilitiesDecideWhichFenceAppliesAsBefore(t *testing.T) {
	for _, c := range []struct {
		name string
		t    transport.Transport
		// refusal: the owner's code refuses chunk by chunk; fence: its
		// owner-side fence is used; acks: drained ACKs are needed.
		refusal, fence, acks bool
	}{
		{"tcp", tcp.New(tcp.Options{}), true, false, false},
		{"local", local.New(nil, "self"), true, false, false},
		{"rdma, fence off (its zero options)", &rdma.Transport{}, false, false, true},
		{"rdma-like, fence on", nicLike{fenceOn: true}, false, true, false},
		{"rdma-like, fence off", nicLike{fenceOn: false}, false, false, true},
		{"a fence without a switch", unswitched{}, false, true, false},
	} {
		a := abilitiesOf(c.t)
		if a.ownerCopies != c.refusal {
			t.Errorf("%s: owner copies %v, want %v", c.name, a.ownerCopies, c.refusal)
		}
		if got := a.fence() != nil; got != c.fence {
			t.Errorf("%s: owner-side fence used %v, want %v", c.name, got, c.fence)
		}
		e := &Engine{transports: []abilities{a}}
		if got := e.needDrainedAcks(); got != c.acks {
			t.Errorf("%s: needDrainedAcks %v, want %v", c.name, got, c.acks)
		}
		// A transport that lists rkey holders but cannot fence them is
		// what Revoke refuses to call safe; one without holders is skipped.
		if a.tracker != nil && a.fencer != nil && (a.fence() == nil) != c.acks {
			t.Errorf("%s: Revoke would decide the fence is off: %v, want %v", c.name, a.fence() == nil, c.acks)
		}
	}
}
