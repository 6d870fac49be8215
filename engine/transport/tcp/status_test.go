package tcp

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
)

// The owner's reason crosses the wire as a status and comes back as the
// same sentinel under ErrRefused; a status this version does not know is a
// plain refusal.
func TestStatusOfAndErrOfMapEveryRefusalBothWays(t *testing.T) {
	reasons := map[uint32]error{
		statusStaleKey:     memory.ErrStaleKey,
		statusOutOfBounds:  memory.ErrOutOfBounds,
		statusUnregistered: memory.ErrUnregistered,
		statusBadRequest:   memory.ErrInvalidRange,
		statusAborted:      transport.ErrAborted,
		statusFenced:       transport.ErrFenced,
	}
	if statusOf(nil) != statusOK || errOf(statusOK) != nil {
		t.Errorf("success: statusOf(nil) = %d, errOf(OK) = %v", statusOf(nil), errOf(statusOK))
	}
	for st := uint32(1); st < 300; st++ {
		err := errOf(st)
		reason, known := reasons[st]
		want := transport.ErrRefused.Error()
		if known {
			want += ": " + reason.Error()
		}
		if !errors.Is(err, transport.ErrRefused) || err.Error() != want || (known && !errors.Is(err, reason)) {
			t.Errorf("errOf(%d) = %v, want %q", st, err, want)
		}
		back := uint32(statusRefused)
		if known {
			back = st
		}
		if got := statusOf(fmt.Errorf("admit: %w", err)); got != back {
			t.Errorf("statusOf(errOf(%d)) = %d, want %d", st, got, back)
		}
	}
	if got := statusOf(errors.New("other")); got != statusRefused {
		t.Errorf("statusOf(an unknown error) = %d, want %d", got, statusRefused)
	}
}

// An admission error that wraps two reasons reports the first in this
// order: aborted, fenced, stale key, out of bounds, unregistered, bad
// request.
func TestStatusOfReportsTheFirstReasonOfTwo(t *testing.T) {
	order := []struct {
		st  uint32
		err error
	}{
		{statusAborted, transport.ErrAborted}, {statusFenced, transport.ErrFenced},
		{statusStaleKey, memory.ErrStaleKey}, {statusOutOfBounds, memory.ErrOutOfBounds},
		{statusUnregistered, memory.ErrUnregistered}, {statusBadRequest, memory.ErrInvalidRange},
	}
	for i, first := range order {
		for _, later := range order[i+1:] {
			for _, err := range []error{fmt.Errorf("%w: %w", first.err, later.err), fmt.Errorf("%w: %w", later.err, first.err)} {
				if got := statusOf(err); got != first.st {
					t.Errorf("statusOf(%v) = %d, want %d", err, got, first.st)
				}
			}
		}
	}
}

func TestOptionsFillTakesTheDefaultOfEveryFieldNotPositive(t *testing.T) {
	want := Options{ListenHost: "127.0.0.1", IOTimeout: 30 * time.Second, HandshakeTimeout: 5 * time.Second,
		UserTimeout: 10 * time.Second, MaxConnsPerPeer: DefaultMaxConnsPerPeer, MaxConns: DefaultMaxConns,
		IdleTimeout: DefaultIdleTimeout, FrameTimeout: DefaultFrameTimeout, MinRate: DefaultMinRate}
	for _, o := range []Options{{}, {IOTimeout: -1, HandshakeTimeout: -time.Second, UserTimeout: -1, MaxConnsPerPeer: -1,
		MaxConns: -5, IdleTimeout: -1, FrameTimeout: -1, MinRate: -1}} {
		o.fill()
		o.Logger = nil
		if o != want {
			t.Errorf("filled %+v, want %+v", o, want)
		}
	}
	set := Options{ListenHost: "::1", IOTimeout: 1, HandshakeTimeout: 2, UserTimeout: 3, MaxConnsPerPeer: 4, MaxConns: 5,
		IdleTimeout: 6, FrameTimeout: 7, MinRate: 8, ApplyDelay: -1}
	o := set
	o.fill()
	o.Logger = nil
	if o != set {
		t.Errorf("filled %+v, want it unchanged %+v", o, set)
	}
}
