// Package transport defines what the engine asks of a transport (tcp, local,
// rdma) and the types both sides share: a Slice to move, an Access to
// check at the owner, and the Owner that checks it.
//
// A transport moves one-sided WRITEs and READs between memory the initiator
// registered and a range the owner registered, named by a buffer key. The
// owner decides, chunk by chunk, whether an access may proceed; the initiator
// learns the outcome of each slice through its Done callback. Optional
// abilities (a fence on the owner's side, access ahead of the bytes,
// uncertain work, GPU memory...) are separate small interfaces found by type
// assertion, so Transport and Endpoint stay small; the engine looks for them
// in one place.
package transport

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/kvferry/kvferry/engine/memory"
)

// Op is the direction of a transfer, seen from the initiator.
type Op uint8

// The operations.
const (
	Read  Op = 1 // copy owner memory into initiator memory
	Write Op = 2 // copy initiator memory into owner memory
)

func (o Op) String() string {
	switch o {
	case Read:
		return "READ"
	case Write:
		return "WRITE"
	}
	return fmt.Sprintf("Op(%d)", uint8(o))
}

// Errors a transport reports; match them with errors.Is. Refusals by the
// owner are final for their request (SAFETY.md promise 6); connection errors
// may be retried on another path.
var (
	ErrRefused    = errors.New("refused by the owner")
	ErrConnection = errors.New("connection failed")
	ErrCanceled   = errors.New("slice canceled")
	ErrClosed     = errors.New("transport closed")
	ErrProtocol   = errors.New("protocol violation")
	// ErrAborted marks a refusal because the owner aborted the access's
	// request id (or the access names a generation the owner aborted);
	// it is always wrapped together with ErrRefused.
	ErrAborted = errors.New("request aborted by the owner")
	// ErrUnsent marks a slice that certainly never reached the owner's
	// memory: its path closed before the owner read any of its frame (an
	// owner that closes an idle connection says up to which slice it
	// read). It is always wrapped together with ErrConnection; posting the
	// slice again on another path is safe and is not a retry of a failure.
	ErrUnsent = errors.New("slice not read by the owner")
	// ErrFenced marks a refusal because the owner fenced a range the
	// access touches after the access was planned (its fence epoch is
	// older); it is always wrapped together with ErrRefused.
	ErrFenced = errors.New("range fenced by the owner")
)

// Retryable reports whether a slice that failed with err may be posted again
// on another path: only connection failures may, never a refusal.
func Retryable(err error) bool {
	return errors.Is(err, ErrConnection) && !errors.Is(err, ErrRefused)
}

// Access is one peer access to owner memory, as read from the wire.
type Access struct {
	Op         Op
	Initiator  string // the peer's segment name, from its handshake
	RequestID  uint64
	Generation uint32
	GrantID    uint64
	// Epoch is the owner's fence epoch the access was planned under:
	// ranges fenced at a later epoch refuse it.
	Epoch  uint64
	Key    memory.Key
	Addr   uint64
	Length uint64
	// Direct: the transport reaches the memory itself (rdma), so the
	// owner stages nothing for it.
	Direct bool
}

// Owner checks accesses to this engine's memory. The engine implements it
// with its registry (and, with safe abort, its per-request state).
type Owner interface {
	// Admit checks an access before any byte moves. On success the
	// transport copies into or out of Target.Mem, entering Target.Guard
	// around each chunk.
	Admit(a Access) (Target, error)
}

// Guard is held around each chunk a transport copies into or out of
// memory: Enter fails once the access may no longer proceed (memory
// unregistered, request aborted), and the rest of the access is then
// refused. Enter never blocks, must be paired with Leave, and must not be
// held across a blocking wait. *memory.Region is one.
type Guard interface {
	Enter() error
	Leave()
}

// Target is owner memory admitted for one access: touch Mem only between
// Guard.Enter and Guard.Leave. It is a value, so admitting costs no
// allocation.
type Target struct {
	Guard Guard
	Mem   []byte
	// Stage is set when the owner memory is not host memory (GPU):
	// Mem is then a host staging buffer, and the transport calls
	// Stage.Fill before sending Mem (READ) and Stage.Flush once a WRITE's
	// payload is all in Mem, each inside Guard, and Stage.Release once it
	// no longer uses Mem.
	Stage Stage
}

// Stage moves bytes between a target's staging buffer and owner memory the
// transport cannot touch directly (GPU memory); see Target.
type Stage interface {
	Fill() error  // owner memory -> Mem
	Flush() error // Mem -> owner memory
	Release()
}

// StageCopy runs a Stage's Fill or Flush inside the target's guard, so a
// staging copy into or out of owner memory obeys aborts and unregistration
// like any chunk: it does not start once they struck, and they wait for it.
func StageCopy(g Guard, copy func() error) error {
	if err := g.Enter(); err != nil {
		return err
	}
	defer g.Leave()
	if err := copy(); err != nil {
		return fmt.Errorf("%w: staging copy: %w", ErrRefused, err)
	}
	return nil
}

// DeviceStage is an optional ability of a Target's Stage whose owner memory
// is GPU memory: Device names the device and the access's address in it,
// so that a transport that reaches the initiator's GPU memory too (shm,
// through CUDA IPC) copies device to device, inside the guard, instead of
// through the staging buffer.
type DeviceStage interface {
	Device() (ordinal int, addr uint64)
}

// DirectGPU is an optional ability of endpoints that move GPU memory
// without host staging (rdma with GPUDirect registration): the engine
// stages GPU slices through host memory for the others.
type DirectGPU interface {
	DirectGPU() bool
}

// Slice states. On a path a slice goes Queued -> Active -> Sent -> Done, a
// READ through Receiving (from Sent, or from Active when its data overtakes
// the sender); it may end (Done) from any of these when its path dies, and
// goes to Canceled only from Queued or Sent. A path that posts a slice
// again on its own puts it back from Active to Queued. Before a path has
// it, the engine may take a Queued slice to Staging (copying GPU memory
// through a host buffer) and give it back to Queued, or end it there. Only
// the engine moves a slice back from an end: Reset puts an ended slice in
// Queued again to retry it elsewhere.
//
// Each state has one owner, who alone moves the slice out of it (and may
// touch its memory): a path in Active, Sent (only to Receiving or Done,
// as the owner's answer arrives) and Receiving; the engine's stager in
// Staging; whoever wins the compare-and-swap out of Queued (and a cancel,
// TryCancel, out of Sent). Advance refuses a move the table below does
// not allow, and counts it (IllegalTransitions), so a bug shows in tests
// instead of corrupting a slice.
const (
	StateQueued    int32 = iota // waiting in the path's queue
	StateActive                 // the path is reading or writing our memory for it
	StateSent                   // on the wire, awaiting the owner's answer
	StateReceiving              // READ data is being copied into our memory
	StateDone                   // ended; Done was called
	StateCanceled               // canceled before or after the wire; our memory is not touched again
	StateStaging                // the engine copies its memory through a staging buffer
	numStates
)

// allowed[from] is the set of states a slice may move to from from.
var allowed = [numStates]uint8{
	StateQueued:    1<<StateActive | 1<<StateCanceled | 1<<StateStaging | 1<<StateDone,
	StateActive:    1<<StateSent | 1<<StateReceiving | 1<<StateQueued | 1<<StateDone,
	StateSent:      1<<StateReceiving | 1<<StateCanceled | 1<<StateDone,
	StateReceiving: 1 << StateDone,
	StateDone:      1 << StateQueued,
	StateCanceled:  1 << StateQueued,
	StateStaging:   1<<StateQueued | 1<<StateDone,
}

var illegal atomic.Uint64

// IllegalTransitions counts moves of a slice the state table refused: a
// bug in a transport or the engine; tests assert it stays 0.
func IllegalTransitions() uint64 { return illegal.Load() }

func legal(from, to int32) bool {
	if from < 0 || from >= numStates || to < 0 || to >= numStates || allowed[from]&(1<<to) == 0 {
		illegal.Add(1)
		return false
	}
	return true
}

// Span is a range of owner memory.
type Span struct{ Addr, Len uint64 }

// Contains reports whether [addr, addr+n) lies inside the span (n > 0).
func (s Span) Contains(addr, n uint64) bool {
	return n > 0 && addr >= s.Addr && n <= s.Len && addr-s.Addr <= s.Len-n
}

// Slice is one contiguous piece of a transfer, the unit a path moves.
type Slice struct {
	Op         Op
	Local      []byte         // initiator memory (a view of a registered region)
	LocalReg   *memory.Region // pinned around each copy into or out of Local
	Key        memory.Key     // owner's buffer key the slice was planned against
	Remote     uint64         // owner address
	RequestID  uint64
	Generation uint32
	GrantID    uint64
	// Epoch is the owner's fence epoch the transfer was planned under
	// (see Access.Epoch).
	Epoch uint64
	// Extent is the owner range of the whole transfer the slice belongs
	// to (its slices share Key, RequestID, Generation and GrantID): a
	// transport that is admitted ahead of the bytes (rdma) asks the owner
	// once for all of it.
	Extent Span

	// Done is called exactly once when the slice ends, with nil or the
	// reason it failed. It must not block.
	Done func(s *Slice, err error)
	// Tag is the engine's, untouched by transports.
	Tag any
	// Recheck, when set, is called before a transport posts the slice
	// again on its own (an RDMA endpoint moving it to another NIC path
	// after an error completion): a non-nil error ends the slice with it
	// instead, so a retry never routes around an abort (SAFETY.md
	// promise 6).
	Recheck func(s *Slice) error

	state atomic.Int32
}

// State returns the slice's current state.
func (s *Slice) State() int32 { return s.state.Load() }

// Reset prepares a slice to be posted (again): a new slice, or one that
// ended and is retried on another path.
func (s *Slice) Reset() {
	if st := s.state.Load(); st != StateQueued && !legal(st, StateQueued) {
		return
	}
	s.state.Store(StateQueued)
}

// Advance moves the slice from one state to another; it fails when the slice
// is no longer in from (it was canceled or completed meanwhile), or when the
// state table does not allow the move.
func (s *Slice) Advance(from, to int32) bool {
	return legal(from, to) && s.state.CompareAndSwap(from, to)
}

// Finish ends the slice with err unless it already ended or was canceled,
// and reports whether this call ended it (and so called Done). Only the
// owner of the slice's current state may call it (see the states).
func (s *Slice) Finish(err error) bool {
	for {
		st := s.state.Load()
		if st == StateDone || st == StateCanceled {
			return false
		}
		if s.state.CompareAndSwap(st, StateDone) {
			s.Done(s, err)
			return true
		}
	}
}

// FinishFrom ends the slice with err only if it is in state from (a
// single compare-and-swap: a path taking it meanwhile keeps it), and
// reports whether this call ended it.
func (s *Slice) FinishFrom(from int32, err error) bool {
	if !s.Advance(from, StateDone) {
		return false
	}
	s.Done(s, err)
	return true
}

// TryCancel cancels a slice that is queued or already on the wire, so no
// path touches its memory again, and reports whether it did. It fails while
// a path or the stager is copying (Active, Receiving, Staging) or after the
// slice ended; the caller then stops the path (Endpoint.Abort, or
// SliceCanceler) or waits for the stager, and waits for Done.
func (s *Slice) TryCancel() bool {
	return s.state.CompareAndSwap(StateQueued, StateCanceled) || s.state.CompareAndSwap(StateSent, StateCanceled)
}

// Transport creates endpoints to peers and serves peers' accesses.
type Transport interface {
	// Name is the transport's name in segment descriptors ("tcp").
	Name() string
	// Listen starts serving peers' accesses to owner memory and returns
	// the address peers dial. It is called at most once.
	Listen(owner Owner) (addr string, err error)
	// Dial opens one path to a peer's listening address. self is our
	// segment name, which the owner uses to tell initiators apart.
	Dial(ctx context.Context, addr, self string) (Endpoint, error)
	// Close stops serving and returns once no owner-side copy runs.
	Close() error
}

// Endpoint is one path to a peer (a tcp connection, a set of rdma QPs).
type Endpoint interface {
	// Post queues slices in order. Each ends by exactly one call of its
	// Done, unless it was canceled first by TryCancel.
	Post(slices []*Slice)
	// Abort stops the path now: copies in progress stop, and every slice
	// not yet ended fails with ErrConnection. It returns once the path no
	// longer touches any slice's memory. The endpoint is dead afterwards.
	Abort(reason error)
	// Dead reports whether the path failed or was aborted; the engine
	// then dials a new one.
	Dead() bool
	// Close is Abort with ErrClosed.
	Close() error
}

// SliceCanceler is an optional ability of endpoints that can stop some of
// their slices in flight without failing the others (rdma: a work request
// cannot be recalled, so it waits for its completion, and after a grace
// flushes only the NIC paths that hold it). Cancel returns nil once none
// of slices can touch memory any more; each then ends by its Done (or was
// canceled by TryCancel). It returns an error wrapping ErrInUse when that
// could not be confirmed by ctx's deadline: the memory may then still be
// touched, and the slices stay unfinished until their work completes.
type SliceCanceler interface {
	Cancel(ctx context.Context, slices []*Slice) error
}

// ErrInUse: a path could not confirm that it stopped touching a slice's
// memory (a NIC that neither completed nor flushed its work).
var ErrInUse = errors.New("memory may still be touched")

// OwnerCopier is an optional ability: a transport whose owner-side code
// copies every byte itself (tcp, local) reports true, so the owner's refusal
// of an aborted request, checked by Guard.Enter before each chunk, is a
// fence on its own: Abort needs neither the initiator's ACK nor a Fencer.
// A transport that lacks it (or reports false) is taken to let hardware
// write owner memory (rdma).
type OwnerCopier interface {
	OwnerCopies() bool
}

// Fencer is an optional ability of transports whose owner-side memory is
// written by hardware (RDMA): cut every path from one initiator so that no
// further access of it executes, without the initiator's help (SAFETY.md,
// how rdma keeps promise 1: the owner's own fence moves the responder QPs
// to the error state; the initiator reconnects). It
// returns once nothing the initiator posted before the call can still
// execute.
type Fencer interface {
	Fence(ctx context.Context, initiator string) error
}

// FenceSwitch is an optional ability of transports whose owner-side fence
// can be turned off (rdma with KVFERRY_RDMA_FENCE=0): FenceEnabled reports
// whether Fence works. A transport reporting false is not taken for a
// Fencer: an abort then rests on the initiators' drained ACKs, and a fence
// by memory range is not Safe while one of its initiators is connected.
type FenceSwitch interface {
	FenceEnabled() bool
}

// InitiatorLister is an optional ability of transports that admit an
// initiator ahead of its bytes (rdma): Initiators names every initiator
// connected to us now, each of which may hold access (an rkey of request id
// 0 reaches a whole registration) that a fence by memory range must cut
// with the Fencer.
type InitiatorLister interface {
	Initiators() []string
}

// HandshakeServer is an optional ability of transports that set up paths
// and admit accesses over the control plane (rdma: QP connects, rkey
// requests, releases): Serve answers one such request from peer, the reply
// body or an error the engine sends back as an ERROR reply. It runs on the
// control plane's loop and must not block.
type HandshakeServer interface {
	Serve(from string, body []byte) ([]byte, error)
}

// UncertainTracker is an optional ability of transports whose paths may
// lose work without the owner's answer (rdma: a work request ended by a
// path error may still have executed at the responder): Uncertain reports
// whether work of request rid to peer ended that way lately, so that the
// initiator cannot promise that the request is drained (its ABORT_ACK says
// cut instead).
type UncertainTracker interface {
	Uncertain(peer string, rid uint64) bool
}

// FenceEpocher is an optional ability of owners that fence by memory range:
// FenceEpoch is the epoch of their last fence. A transport that admits an
// access ahead of its bytes (rdma) admits one planned under an older epoch
// for the range it asked only, never for the whole registration.
type FenceEpocher interface {
	FenceEpoch() uint64
}

// AccessTracker is an optional ability of transports that admit an
// initiator ahead of its bytes (rdma hands out rkeys, after which the
// owner's code no longer sees the accesses): Holders names every initiator
// that may still access owner memory for requestID without asking the
// owner again, so that an abort fences each of them, named or not.
type AccessTracker interface {
	Holders(requestID uint64) []string
}

// Drainer is an optional ability of endpoints whose slices may still move
// bytes after the engine saw them end (rdma: a canceled slice's work
// requests may still be on the wire): Drain returns once every work request
// posted on the path for requestID has completed or been flushed, so the
// initiator's ABORT_ACK can mean "drained" (SAFETY.md promise 2).
// Endpoints that end a slice only after the owner answered it, as tcp and
// local do, need no Drainer: the engine waits for the slices.
type Drainer interface {
	Drain(ctx context.Context, requestID uint64) error
}
