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
