package main

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"syscall"
	"testing"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/engine/control"
	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
)

func TestCodeOfMapsEveryEngineError(t *testing.T) {
	tests := []struct {
		err  error
		want int
	}{
		{nil, int(statusOK)},
		{engine.ErrInvalidArg, int(errInvalid)},
		{memory.ErrInvalidRange, int(errInvalid)},
		{engine.ErrOverlap, int(errOverlap)},
		{engine.ErrNotRegistered, int(errNotRegistered)},
		{memory.ErrUnregistered, int(errNotRegistered)},
		{engine.ErrRemoteRange, int(errRemoteRange)},
		{engine.ErrStaleKey, int(errStaleKey)},
		{engine.ErrRefused, int(errRefused)},
		{engine.ErrFenced, int(errFenced)},
		{engine.ErrTimeout, int(errTimeout)},
		{context.DeadlineExceeded, int(errTimeout)},
		{engine.ErrCanceled, int(errCanceled)},
		{transport.ErrCanceled, int(errCanceled)},
		{engine.ErrConnection, int(errConnection)},
		{engine.ErrUnreachable, int(errUnreachable)},
		{engine.ErrPeerDead, int(errUnreachable)},
		{engine.ErrSegmentUnknown, int(errUnreachable)},
		{engine.ErrBatchBusy, int(errBusy)},
		{engine.ErrBatchFull, int(errBatchFull)},
		{engine.ErrBatchFreed, int(errHandleCode)},
		{engine.ErrClosed, int(errClosed)},
		{transport.ErrClosed, int(errClosed)},
		{control.ErrClosed, int(errClosed)},
		{engine.ErrUnsupported, int(errUnsupported)},
		{engine.ErrTransferFailed, int(errTransferFailed)},
		{syscall.ENOMEM, int(errNoMemory)},
		{control.ErrMalformed, int(errProtocol)},
		{transport.ErrProtocol, int(errProtocol)},
		{errors.New("something else"), int(errInternal)},
	}
	for _, tt := range tests {
		if got := int(codeOf(tt.err)); got != tt.want {
			t.Errorf("codeOf(%v) = %d, want %d", tt.err, got, tt.want)
		}
	}
}

func TestCodeOfPrefersTheMostSpecificCause(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want int
	}{
		{"refusal of a stale key inside a failed transfer",
			fmt.Errorf("WRITE: %w: %w: %w", engine.ErrTransferFailed, engine.ErrRefused, engine.ErrStaleKey), int(errStaleKey)},
		{"fence refusal inside a failed transfer",
			fmt.Errorf("WRITE: %w: %w: %w: planned at fence epoch 0", engine.ErrTransferFailed, engine.ErrRefused, engine.ErrFenced), int(errFenced)},
		{"refusal without a cause",
			fmt.Errorf("%w: %w", engine.ErrTransferFailed, engine.ErrRefused), int(errRefused)},
		{"a peer that never answered an open",
			fmt.Errorf("%w: control: %w: %w", engine.ErrSegmentUnknown, engine.ErrUnreachable, context.DeadlineExceeded), int(errUnreachable)},
		{"an invalid request inside a submit",
			fmt.Errorf("request 3: %w: length 0", engine.ErrInvalidArg), int(errInvalid)},
		{"a handle error wins over everything",
			fmt.Errorf("request 1: %w: %w", errHandle, engine.ErrInvalidArg), int(errHandleCode)},
	}
	for _, tt := range tests {
		if got := int(codeOf(tt.err)); got != tt.want {
			t.Errorf("%s: codeOf(%v) = %d, want %d", tt.name, tt.err, got, tt.want)
		}
	}
}

func TestTaskCodeOfAFencedTask(t *testing.T) {
	// A transfer planned before its owner's fence ends FAILED (not ABORTED:
	// no request id needs to be involved) with the fence refusal as cause.
	fenced := fmt.Errorf("WRITE of [0x10000, +4096) at 127.0.0.1:1: %w: %w: %w: planned at fence epoch 0",
		engine.ErrTransferFailed, engine.ErrRefused, engine.ErrFenced)
	tests := []struct {
		name string
		r    engine.TaskResult
		want int
	}{
		{"failed by a fence", engine.TaskResult{Status: engine.Failed, Err: fenced}, int(errFenced)},
		{"failed by a grant refusal", engine.TaskResult{Status: engine.Failed,
			Err: fmt.Errorf("%w: %w", engine.ErrTransferFailed, engine.ErrRefused)}, int(errRefused)},
		{"aborted", engine.TaskResult{Status: engine.Aborted, Err: fenced}, int(errAborted)},
	}
	for _, tt := range tests {
		if got := int(taskCode(tt.r)); got != tt.want {
			t.Errorf("%s: taskCode = %d, want %d", tt.name, got, tt.want)
		}
	}
}

func TestBadHandlesAreExplained(t *testing.T) {
	e := &engineH{}
	id := newHandle(kindEngine, e)
	if v, ok := handles.Load(id); !ok || v != e {
		t.Fatalf("handle %#x not in the table", id)
	}
	tests := []struct {
		name string
		h    uintptr
		want string
	}{
		{"NULL", 0, "NULL segment handle"},
		{"small integer", 0x1234, "not a kvferry handle"},
		{"wrong kind", id, "is an engine handle, not a segment handle"},
		{"never issued", id + 1<<20, "not a kvferry handle"},
		{"unknown kind", uintptr(handleMagic)<<magicShift | 9<<kindShift | 1, "not a kvferry handle"},
	}
	for _, tt := range tests {
		err := whyBad(tt.h, kindSegment)
		if !errors.Is(err, errHandle) || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: whyBad(%#x) = %v, want %q", tt.name, tt.h, err, tt.want)
		}
	}
	handles.Delete(id)
	if _, err := lookup[*engineH](id); err == nil || !strings.Contains(err.Error(), "stale") {
		t.Errorf("deleted handle: %v, want stale", err)
	}
}

func TestPanicBecomesInternalError(t *testing.T) {
	// An engine entry without an engine: using it panics inside the export.
	id := newHandle(kindEngine, &engineH{})
	defer handles.Delete(id)
	// Test files cannot name C types: call the export through reflect.
	f := reflect.ValueOf(kvfgo_engine_destroy)
	out := f.Call([]reflect.Value{reflect.ValueOf(id).Convert(f.Type().In(0))})
	if st := out[0].Int(); st != int64(errInternal) {
		t.Fatalf("export that panicked returned %d, want KVF_ERR_INTERNAL (%d)", st, errInternal)
	}
}

// TestCodeOfPicksOneCauseForEveryPairTheEngineWraps pins the order of the
// causes table where an error wraps two of its sentinels: a tcp refusal
// wraps ErrRefused and the owner's reason, a failed task wraps
// ErrTransferFailed and its cause, a deadline wraps the engine's error and
// the context's.
func TestCodeOfPicksOneCauseForEveryPairTheEngineWraps(t *testing.T) {
	tests := []struct {
		outer, inner error
		want         int
	}{
		{engine.ErrRefused, engine.ErrStaleKey, int(errStaleKey)},
		{engine.ErrRefused, engine.ErrFenced, int(errFenced)},
		{engine.ErrRefused, engine.ErrAborted, int(errAborted)},
		{engine.ErrRefused, memory.ErrUnregistered, int(errNotRegistered)},
		{engine.ErrRefused, engine.ErrOutOfBounds, int(errRefused)},
		{engine.ErrRefused, memory.ErrInvalidRange, int(errRefused)},
		{engine.ErrTransferFailed, engine.ErrRefused, int(errRefused)},
		{engine.ErrTransferFailed, engine.ErrConnection, int(errConnection)},
		{engine.ErrTransferFailed, engine.ErrPeerDead, int(errUnreachable)},
		{engine.ErrTransferFailed, control.ErrRemote, int(errTransferFailed)},
		{engine.ErrTimeout, context.DeadlineExceeded, int(errTimeout)},
		{engine.ErrCanceled, context.DeadlineExceeded, int(errTimeout)},
		{engine.ErrCanceled, context.Canceled, int(errCanceled)},
		{engine.ErrConnection, context.DeadlineExceeded, int(errTimeout)},
		{engine.ErrUnreachable, context.DeadlineExceeded, int(errUnreachable)},
		{engine.ErrSegmentUnknown, control.ErrMalformed, int(errProtocol)},
		{engine.ErrSegmentUnknown, control.ErrRemote, int(errUnreachable)},
		{engine.ErrSegmentUnknown, engine.ErrConnection, int(errConnection)},
		{engine.ErrClosed, engine.ErrCanceled, int(errClosed)},
		{engine.ErrClosed, engine.ErrTimeout, int(errClosed)},
		{engine.ErrMemoryInUse, engine.ErrTimeout, int(errInUse)},
		{engine.ErrBatchFreed, engine.ErrClosed, int(errHandleCode)},
		{engine.ErrInvalidArg, syscall.ENOMEM, int(errInvalid)},
		{engine.ErrBusy, engine.ErrBatchFull, int(errBatchFull)},
		{engine.ErrUnsupported, engine.ErrInvalidArg, int(errUnsupported)},
		{transport.ErrProtocol, engine.ErrConnection, int(errProtocol)},
	}
	for _, tt := range tests {
		for _, err := range []error{fmt.Errorf("%w: %w", tt.outer, tt.inner), fmt.Errorf("%w: %w", tt.inner, tt.outer),
			errors.Join(tt.outer, tt.inner)} {
			if got := int(codeOf(err)); got != tt.want {
				t.Errorf("codeOf(%v) = %d, want %d", err, got, tt.want)
			}
		}
	}
}

func TestTaskCodeOfEveryStatus(t *testing.T) {
	other := errors.New("something else")
	tests := []struct {
		status engine.TaskStatus
		err    error
		want   int
	}{
		{engine.Completed, other, int(statusOK)},
		{engine.Waiting, other, int(statusOK)},
		{engine.Pending, other, int(statusOK)},
		{engine.Timeout, engine.ErrRefused, int(errTimeout)},
		{engine.Canceled, context.DeadlineExceeded, int(errCanceled)},
		{engine.Aborted, engine.ErrFenced, int(errAborted)},
		{engine.Failed, other, int(errTransferFailed)},
		{engine.Failed, engine.ErrPeerDead, int(errUnreachable)},
		{engine.Failed, context.DeadlineExceeded, int(errTimeout)},
		{engine.Failed, nil, int(statusOK)}, // as before: a failure without an error has no code of its own
	}
	for _, tt := range tests {
		if got := int(taskCode(engine.TaskResult{Status: tt.status, Err: tt.err})); got != tt.want {
			t.Errorf("taskCode(%v, %v) = %d, want %d", tt.status, tt.err, got, tt.want)
		}
	}
}
