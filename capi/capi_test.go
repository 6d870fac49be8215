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
