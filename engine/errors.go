package engine

import (
	"errors"
	"github.com/kvferry/kvferry/engine/auth"

	"github.com/kvferry/kvferry/engine/control"
	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
)

// Errors of the engine; match them with errors.Is. Errors from lower layers
// are wrapped with context and stay matchable too.
var (
	ErrClosed         = errors.New("engine closed")
	ErrInvalidArg     = memory.ErrInvalidArg
	ErrUnsupported    = errors.New("not supported")
	ErrBatchFull      = errors.New("batch capacity exceeded")
	ErrBatchBusy      = errors.New("batch has transfers in flight")
	ErrBatchFreed     = errors.New("batch was freed")
	ErrPeerDead       = errors.New("peer declared dead (missed heartbeats)")
	ErrSegmentUnknown = errors.New("segment descriptor unavailable")
	ErrRemoteRange    = errors.New("remote range is not registered at the peer")
	ErrTransferFailed = errors.New("transfer failed")
	ErrTimeout        = errors.New("transfer timed out")
	ErrCanceled       = errors.New("transfer canceled")
	ErrBusy           = errors.New("peer busy: its event queue is full")
	// ErrMemoryInUse: the engine could not confirm, within its bound, that
	// it stopped touching a transfer's memory (a NIC neither completed nor
	// flushed its work, a GPU copy did not return): the memory may still
	// be touched, and the tasks concerned stay in flight.
	ErrMemoryInUse = transport.ErrInUse
	// ErrAborted: the owner aborted the transfer's request id (the task
	// ends ABORTED).
	ErrAborted = transport.ErrAborted

	// From the memory registry.
	ErrOverlap       = memory.ErrOverlap
	ErrNotRegistered = memory.ErrNotRegistered
	ErrStaleKey      = memory.ErrStaleKey
	ErrOutOfBounds   = memory.ErrOutOfBounds

	// From the transports and the control plane.
	ErrRefused     = transport.ErrRefused
	ErrConnection  = transport.ErrConnection
	ErrUnreachable = control.ErrUnreachable
	// ErrUnauthenticated: with authentication on, the peer did not prove
	// a key our allowlist holds (or refused ours); nothing was sent to it.
	ErrUnauthenticated = auth.ErrUnauthenticated
)
