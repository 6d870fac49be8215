package rdma

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvferry/kvferry/internal/fakeverbs"
)

// TestResponderQPsAreCappedInTotal: initiators under made-up names, each
// connecting, make the owner spend QPs only up to MaxResponderQPs; past it
// connects are refused and counted, and QPs given back (a dropped
// connection, a fence) make room again. Without the cap any peer could take
// every QP of the NIC, under as many names as it likes.
func TestResponderQPsAreCappedInTotal(t *testing.T) {
	lib := fakeverbs.Library(t)
	devices := fakeverbs.Devices("")
	owner, err := New(Options{Library: lib, Devices: devices, Fence: true, MaxResponderQPs: 8,
		Exchange: func(context.Context, string, []byte) ([]byte, error) {
			return nil, errors.New("the owner dials nobody")
		}})
	if err != nil {
		t.Fatalf("owner transport: %v", err)
	}
	t.Cleanup(func() { _ = owner.Close() })
	var name atomic.Value
	init, err := New(Options{Library: lib, Devices: devices,
		Exchange: func(ctx context.Context, _ string, body []byte) ([]byte, error) {
			return owner.Serve(name.Load().(string), body)
		}})
	if err != nil {
		t.Fatalf("initiator transport: %v", err)
	}
	t.Cleanup(func() { _ = init.Close() })
	dial := func(n string) error {
		name.Store(n)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		ep, err := init.Dial(ctx, "owner:1", n)
		if err == nil {
			t.Cleanup(func() { _ = ep.Close() })
		}
		return err
	}
	if err := dial("10.0.0.0:1"); err != nil {
		t.Fatalf("first connect: %v", err)
	}
	per := owner.Stats().ResponderQPs
	if per == 0 || per > 8 {
		t.Fatalf("one connect made %d responder QPs", per)
	}
	refused := 0
	for i := 1; i < 40; i++ {
		err := dial(fmt.Sprintf("10.0.0.%d:1", i))
		if err != nil {
			if !strings.Contains(err.Error(), "responder QPs in use") {
				t.Fatalf("connect %d failed for another reason: %v", i, err)
			}
			// A refusal of a sound request: the engine must not count
			// the peer's message as malformed.
			if errors.Is(err, ErrMalformed) {
				t.Fatalf("connect %d: a refusal reads as malformed input: %v", i, err)
			}
			refused++
		}
		if got := owner.Stats().ResponderQPs; got > 8 {
			t.Fatalf("%d responder QPs after %d connects of %d QPs, cap 8", got, i+1, per)
		}
	}
	s := owner.Stats()
	t.Logf("%d QPs a connect; %d of 40 connects refused; stats: %d QPs, %d refused", per, refused, s.ResponderQPs, s.ConnectsRefused)
	if refused < 40-8/per || s.ConnectsRefused != uint64(refused) {
		t.Fatalf("%d connects refused (counted %d), want at least %d", refused, s.ConnectsRefused, 40-8/per)
	}
	if err := owner.cut(context.Background(), "10.0.0.0:1"); err != nil {
		t.Fatalf("fence: %v", err)
	}
	if got := owner.Stats().ResponderQPs; got != s.ResponderQPs-per {
		t.Fatalf("%d responder QPs after a fence of %d, want %d", got, per, s.ResponderQPs-per)
	}
	if err := dial("10.0.0.99:1"); err != nil {
		t.Fatalf("connect after a fence made room: %v", err)
	}
}

// Handshake messages that do not decode, or name a NIC the owner does not
// have, are ErrMalformed (the peer's fault, which the engine counts as
// such); nothing else Serve returns is.
func TestServeMarksMalformedHandshakes(t *testing.T) {
	owner, err := New(Options{Library: fakeverbs.Library(t), Devices: fakeverbs.Devices(""),
		Exchange: func(context.Context, string, []byte) ([]byte, error) {
			return nil, errors.New("the owner dials nobody")
		}})
	if err != nil {
		t.Fatalf("owner transport: %v", err)
	}
	t.Cleanup(func() { _ = owner.Close() })
	badNIC := (&connectReq{Conn: 1, Pairs: []pairReq{{Remote: 200, Ethernet: true, MTU: 3, QP: qpInfo{QPN: 1, PSN: 1}}}}).encode()
	for name, body := range map[string][]byte{
		"empty":           nil,
		"unknown kind":    {99, wireVersion},
		"short info":      {kindInfo},
		"truncated":       {kindConnect, wireVersion, 1},
		"NIC past ours":   badNIC,
		"long disconnect": append([]byte{kindDisconnect, wireVersion}, make([]byte, 20)...),
	} {
		if _, err := owner.Serve("10.0.0.1:1", body); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: Serve returned %v, want ErrMalformed", name, err)
		}
	}
	// Sound, but its GID names no device the fake can reach: the QP
	// cannot be connected here, as a real NIC's cannot when the peer's
	// address has no route. A failure, not malformed input.
	unreachable := pairReq{Remote: 0, Ethernet: true, MTU: 3, QP: qpInfo{QPN: 1, PSN: 1}}
	for i := range unreachable.GID {
		unreachable.GID[i] = 0xaa
	}
	_, err = owner.Serve("10.0.0.1:1", (&connectReq{Conn: 1, Pairs: []pairReq{unreachable}}).encode())
	if err == nil || errors.Is(err, ErrMalformed) {
		t.Fatalf("a connect to an unreachable GID: Serve returned %v, want a failure that is not ErrMalformed", err)
	}
	if got := owner.Stats().ResponderQPs; got != 0 {
		t.Fatalf("%d responder QPs kept after a failed connect", got)
	}
}
