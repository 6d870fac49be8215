// Command capi is kvferry's C ABI, built with -buildmode=c-shared into
// libkvferry.so. The public functions (kvf_*) are thin C wrappers in
// kvferry.c, checked by the compiler against the hand-written
// include/kvferry.h; they call the //export functions of this package
// (kvfgo_*), which the version script kvferry.map keeps out of the dynamic
// symbol table.
//
// Handles given to C are ids from a table (magic, kind and a counter that is
// never reused), never Go pointers, so a stale or garbage handle is found in
// the table, not dereferenced. Addresses given by C travel as uintptr_t, so
// no Go variable of pointer type ever holds a value C made up.
package main

/*
#cgo CFLAGS: -I${SRCDIR}/../include -O2 -Wall
#include "kvferry.h"
void kvfi_set_error(const char *msg, size_t len);
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/engine/control"
	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
)

func main() {}

// Status codes, as in kvferry.h.
const (
	statusOK             C.int = C.KVF_OK
	errInvalid           C.int = C.KVF_ERR_INVALID
	errHandleCode        C.int = C.KVF_ERR_HANDLE
	errOverlap           C.int = C.KVF_ERR_OVERLAP
	errNotRegistered     C.int = C.KVF_ERR_NOT_REGISTERED
	errRemoteRange       C.int = C.KVF_ERR_REMOTE_RANGE
	errStaleKey          C.int = C.KVF_ERR_STALE_KEY
	errRefused           C.int = C.KVF_ERR_REFUSED
	errTimeout           C.int = C.KVF_ERR_TIMEOUT
	errCanceled          C.int = C.KVF_ERR_CANCELED
	errConnection        C.int = C.KVF_ERR_CONNECTION
	errUnreachable       C.int = C.KVF_ERR_UNREACHABLE
	errBusy              C.int = C.KVF_ERR_BUSY
	errBatchFull         C.int = C.KVF_ERR_BATCH_FULL
	errClosed            C.int = C.KVF_ERR_CLOSED
	errUnsupported       C.int = C.KVF_ERR_UNSUPPORTED
	errTransferFailed    C.int = C.KVF_ERR_TRANSFER_FAILED
	errNoMemory          C.int = C.KVF_ERR_NO_MEMORY
	errInternal          C.int = C.KVF_ERR_INTERNAL
	errAborted           C.int = C.KVF_ERR_ABORTED
	errProtocol          C.int = C.KVF_ERR_PROTOCOL
	errTruncated         C.int = C.KVF_ERR_TRUNCATED
	errInUse             C.int = C.KVF_ERR_IN_USE
	errFenced            C.int = C.KVF_ERR_FENCED
	errUnauthenticated   C.int = C.KVF_ERR_UNAUTHENTICATED
	defaultTimeoutMillis       = C.KVF_TIMEOUT_DEFAULT
)

// errHandle marks errors about handles.
var errHandle = errors.New("invalid handle")

// causes maps errors to status codes, the most specific cause first: a task
// that failed because the owner refused a stale key reports
// KVF_ERR_STALE_KEY, and one the owner's fence refused KVF_ERR_FENCED, not
// KVF_ERR_REFUSED or KVF_ERR_TRANSFER_FAILED.
var causes = []struct {
	code C.int
	errs []error
}{
	{errHandleCode, []error{errHandle, engine.ErrBatchFreed}},
	{errUnauthenticated, []error{engine.ErrUnauthenticated}},
	{errInUse, []error{engine.ErrMemoryInUse}},
	{errClosed, []error{engine.ErrClosed, transport.ErrClosed, control.ErrClosed}},
	{errUnreachable, []error{engine.ErrUnreachable, engine.ErrPeerDead}},
	{errTimeout, []error{engine.ErrTimeout, context.DeadlineExceeded}},
	{errCanceled, []error{engine.ErrCanceled, transport.ErrCanceled, context.Canceled}},
	{errStaleKey, []error{engine.ErrStaleKey}},
	{errOverlap, []error{engine.ErrOverlap}},
	{errRemoteRange, []error{engine.ErrRemoteRange}},
	{errNotRegistered, []error{engine.ErrNotRegistered, memory.ErrUnregistered}},
	{errAborted, []error{engine.ErrAborted}},
	{errFenced, []error{engine.ErrFenced}},
	{errRefused, []error{engine.ErrRefused}},
	{errRemoteRange, []error{engine.ErrOutOfBounds}},
	{errBatchFull, []error{engine.ErrBatchFull}},
	{errBusy, []error{engine.ErrBatchBusy, engine.ErrBusy}},
	{errUnsupported, []error{engine.ErrUnsupported}},
	{errProtocol, []error{control.ErrMalformed, transport.ErrProtocol}},
	{errConnection, []error{engine.ErrConnection}},
	{errUnreachable, []error{engine.ErrSegmentUnknown}},
	{errInvalid, []error{engine.ErrInvalidArg, memory.ErrInvalidRange}},
	{errNoMemory, []error{syscall.ENOMEM}},
	{errTransferFailed, []error{engine.ErrTransferFailed, control.ErrRemote}},
}

// codeOf maps an error to its status code: KVF_OK for nil, the code of the
// first row of causes with an error that err wraps, else KVF_ERR_INTERNAL.
func codeOf(err error) C.int {
	if err == nil {
		return statusOK
	}
	for _, c := range causes {
		for _, target := range c.errs {
			if errors.Is(err, target) {
				return c.code
			}
		}
	}
	return errInternal
}

// taskCode is the status code of a final task's error.
func taskCode(r engine.TaskResult) C.int {
	switch r.Status {
	case engine.Completed, engine.Waiting, engine.Pending:
		return statusOK
	case engine.Timeout:
		return errTimeout
	case engine.Canceled:
		return errCanceled
	case engine.Aborted:
		return errAborted
	}
	if c := codeOf(r.Err); c != errInternal {
		return c
	}
	return errTransferFailed
}

// setError stores msg as the calling thread's last error. An exported call
// runs on the C caller's thread, so the C side's thread-local buffer is the
// caller's own.
func setError(msg string) {
	C.kvfi_set_error((*C.char)(unsafe.Pointer(unsafe.StringData(msg))), C.size_t(len(msg)))
}

// fail records "fn: err" and returns err's code.
func fail(fn string, err error) C.int {
	setError(fn + ": " + err.Error())
	return codeOf(err)
}

// result is KVF_OK for a nil err, and fail(fn, err) otherwise.
func result(fn string, err error) C.int {
	if err != nil {
		return fail(fn, err)
	}
	return statusOK
}

// failf records "fn: message" and returns code.
func failf(fn string, code C.int, format string, args ...any) C.int {
	setError(fn + ": " + fmt.Sprintf(format, args...))
	return code
}

// guard turns a panic in an exported call into KVF_ERR_INTERNAL; every
// export defers it (withHandle does, for those on a handle).
func guard(fn string, st *C.int) {
	if r := recover(); r != nil {
		*st = errInternal
		setError(fmt.Sprintf("%s: internal error: panic: %v\n%s", fn, r, debug.Stack()))
	}
}

// Handles.

type kind uint8

const (
	kindEngine kind = 1 + iota
	kindSegment
	kindBatch
)

func (k kind) String() string {
	switch k {
	case kindEngine:
		return "engine"
	case kindSegment:
		return "segment"
	case kindBatch:
		return "batch"
	}
	return "unknown"
}

// article returns "an engine", "a segment", "a batch".
func (k kind) article() string {
	if k == kindEngine {
		return "an engine"
	}
	return "a " + k.String()
}

const (
	handleMagic = 0x6b76 // "kv"
	magicShift  = 48
	kindShift   = 40
	seqMask     = 1<<kindShift - 1
)

var (
	handles   sync.Map // uintptr -> *engineH, *segmentH or *batchH
	handleSeq atomic.Uint64
)

func newHandle(k kind, v any) uintptr {
	id := uintptr(handleMagic)<<magicShift | uintptr(k)<<kindShift | uintptr(handleSeq.Add(1)&seqMask)
	handles.Store(id, v)
	return id
}

// whyBad explains why h is not a live handle of kind want.
func whyBad(h uintptr, want kind) error {
	switch {
	case h == 0:
		return fmt.Errorf("%w: NULL %s handle", errHandle, want)
	case h>>magicShift != handleMagic:
		return fmt.Errorf("%w: %#x is not a kvferry handle (garbage or uninitialised?)", errHandle, h)
	}
	k := kind(h >> kindShift & 0xff)
	seq := uint64(h & seqMask)
	switch {
	case k < kindEngine || k > kindBatch || seq == 0 || seq > handleSeq.Load():
		return fmt.Errorf("%w: %#x is not a kvferry handle (garbage?)", errHandle, h)
	case k != want:
		return fmt.Errorf("%w: %#x is %s handle, not %s handle", errHandle, h, k.article(), want.article())
	}
	return fmt.Errorf("%w: %s handle %#x is stale (already destroyed, closed or freed)", errHandle, want, h)
}

// handle is a Go value a C handle stands for; kind says which table entries
// are of its type.
type handle interface {
	*engineH | *segmentH | *batchH
	kind() kind
}

// lookup returns the live handle h of type T, or an error (wrapping
// errHandle) that says why h is not one.
func lookup[T handle](h uintptr) (T, error) {
	if v, ok := handles.Load(h); ok {
		if t, ok := v.(T); ok {
			return t, nil
		}
	}
	var none T
	return none, whyBad(h, none.kind())
}

// withHandle runs an export's body on the live handle h of type T, under
// guard: fn names the C function in the caller's last error. A bad handle
// fails with KVF_ERR_HANDLE and whyBad's message, and the body does not run.
func withHandle[T handle](fn string, h C.uintptr_t, body func(fn string, t T) C.int) (st C.int) {
	defer guard(fn, &st)
	t, err := lookup[T](uintptr(h))
	if err != nil {
		return fail(fn, err)
	}
	return body(fn, t)
}

// engineH is an engine and what the C API tracks for it.
type engineH struct {
	id         uintptr
	e          *engine.Engine
	name       string
	defTimeout time.Duration // the engine's DefaultTimeout

	// segMu orders segment opens (shared) against closes (exclusive), so
	// a close never shuts down a segment an open is handing out.
	segMu sync.RWMutex

	mu       sync.Mutex
	closed   bool
	children map[uintptr]struct{}    // segment and batch handles
	segRefs  map[*engine.Segment]int // open handles per segment
	bufs     map[uint64]struct{}     // buffers from kvf_alloc_buffer
}

// adopt registers a child handle; it fails once the engine is closing.
func (eh *engineH) adopt(k kind, v any) (uintptr, error) {
	eh.mu.Lock()
	defer eh.mu.Unlock()
	if eh.closed {
		return 0, engine.ErrClosed
	}
	id := newHandle(k, v)
	eh.children[id] = struct{}{}
	return id, nil
}

func (eh *engineH) disown(id uintptr) {
	eh.mu.Lock()
	delete(eh.children, id)
	eh.mu.Unlock()
}

// segmentH is an open segment handle; several may share one segment.
type segmentH struct {
	eh *engineH
	s  *engine.Segment
}

// batchH is a batch handle.
type batchH struct {
	eh *engineH
	b  *engine.Batch
}

func (*engineH) kind() kind  { return kindEngine }
func (*segmentH) kind() kind { return kindSegment }
func (*batchH) kind() kind   { return kindBatch }

// timeoutCtx returns a context with the call's deadline: ms > 0, or the
// engine's default for KVF_TIMEOUT_DEFAULT (the engine applies it itself when
// the context has none), or an expired one for 0.
func timeoutCtx(ms C.int) (context.Context, context.CancelFunc) {
	switch {
	case ms == defaultTimeoutMillis:
		return context.Background(), func() {}
	case ms < 0:
		return nil, nil
	}
	return context.WithTimeout(context.Background(), time.Duration(ms)*time.Millisecond)
}

// bounded reports whether ms bounds a call that must end by a deadline: > 0,
// or KVF_TIMEOUT_DEFAULT for the engine's default.
func bounded(ms C.int) bool { return ms > 0 || ms == defaultTimeoutMillis }

// badTimeout fails a call whose timeout is not bounded.
func badTimeout(fn string, ms C.int) C.int {
	return failf(fn, errInvalid, "timeout %d ms: want > 0 or KVF_TIMEOUT_DEFAULT", ms)
}

// boundedCtx is the context of a call that must end by a deadline: ms > 0,
// or the engine's default def for KVF_TIMEOUT_DEFAULT. It reports false when
// ms is not bounded.
func boundedCtx(ms C.int, def time.Duration) (context.Context, context.CancelFunc, bool) {
	if !bounded(ms) {
		return nil, nil, false
	}
	d := def
	if ms != defaultTimeoutMillis {
		d = time.Duration(ms) * time.Millisecond
	}
	ctx, cancel := context.WithTimeout(context.Background(), d)
	return ctx, cancel, true
}

// checkArray checks a *_batch call's array argument param (p, of n entries,
// called what in messages): not NULL, not empty, not implausibly long.
func checkArray(fn, what, param string, p unsafe.Pointer, n C.size_t) C.int {
	switch {
	case p == nil || n == 0:
		return failf(fn, errInvalid, "no %s (%s %p, n %d)", what, param, p, n)
	case n > 1<<24:
		return failf(fn, errInvalid, "n %d is implausible", n)
	}
	return statusOK
}

// checkResult checks the out argument of a call that fills a result struct
// of C type name, whose first field is uint32_t struct_size: not NULL, and
// struct_size at least size, the struct's size in this header.
func checkResult(fn, name string, out unsafe.Pointer, size uintptr) C.int {
	switch {
	case out == nil:
		return failf(fn, errInvalid, "out is NULL")
	case uintptr(*(*C.uint32_t)(out)) < size:
		return failf(fn, errInvalid, "out->struct_size %d: set it to sizeof(%s)", *(*C.uint32_t)(out), name)
	}
	return statusOK
}

// The result structs checkResult reads start with struct_size: each
// constant fails to compile (a negative uintptr) otherwise.
const (
	_ = -unsafe.Offsetof(C.kvf_abort_result{}.struct_size)
	_ = -unsafe.Offsetof(C.kvf_fence_result{}.struct_size)
)

// cBool is a C result's 0/1 flag.
func cBool(b bool) C.uint32_t {
	if b {
		return 1
	}
	return 0
}

// ptrAt turns an address C passed as uintptr_t into a pointer.
func ptrAt(addr uintptr) unsafe.Pointer { return unsafe.Add(unsafe.Pointer(nil), addr) }

// minAddr is the lowest address accepted for memory: the first page is
// never mapped.
const minAddr = 4096

// checkRange validates [addr, addr+n) given by C.
func checkRange(what string, addr uintptr, n uint64) error {
	switch {
	case addr == 0:
		return fmt.Errorf("%w: %s address is NULL", engine.ErrInvalidArg, what)
	case addr < minAddr:
		return fmt.Errorf("%w: %s address %#x is in the first page", engine.ErrInvalidArg, what, addr)
	case n == 0:
		return fmt.Errorf("%w: %s length is 0", engine.ErrInvalidArg, what)
	case uint64(addr)+n < uint64(addr):
		return fmt.Errorf("%w: %s range [%#x, +%d) wraps around the address space", engine.ErrInvalidArg, what, addr, n)
	case n > 1<<62:
		return fmt.Errorf("%w: %s length %d is too large", engine.ErrInvalidArg, what, n)
	}
	return nil
}

// copyString writes s NUL-terminated into buf[0:cap] as the *_name calls do.
func copyString(fn, s string, buf *C.char, capacity C.size_t, lenOut *C.size_t) C.int {
	if lenOut != nil {
		*lenOut = C.size_t(len(s))
	}
	if buf == nil {
		if capacity == 0 {
			return statusOK
		}
		return failf(fn, errInvalid, "buf is NULL but cap is %d", capacity)
	}
	if uint64(capacity) <= uint64(len(s)) {
		return failf(fn, errTruncated, "buffer of %d bytes is too small for %d bytes and the NUL", capacity, len(s))
	}
	dst := unsafe.Slice((*byte)(unsafe.Pointer(buf)), len(s)+1)
	copy(dst, s)
	dst[len(s)] = 0
	return statusOK
}
