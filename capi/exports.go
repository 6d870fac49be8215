package main

/*
#include "kvferry.h"
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/kvferry/kvferry/engine"
)

// Engine.

//export kvfgo_engine_create
func kvfgo_engine_create(copts *C.kvf_engine_options, out *C.uintptr_t) (st C.int) {
	const fn = "kvf_engine_create"
	defer guard(fn, &st)
	if out == nil {
		return failf(fn, errInvalid, "out is NULL")
	}
	opts, procs, err := engineOptions(copts)
	if err != nil {
		return fail(fn, err)
	}
	if procs > 0 {
		setMaxProcs(procs)
	}
	e, err := engine.New(opts)
	if err != nil {
		return fail(fn, err)
	}
	eh := &engineH{
		e: e, name: e.Name(), defTimeout: defaultTimeout(opts), children: map[uintptr]struct{}{},
		segRefs: map[*engine.Segment]int{}, bufs: map[uint64]struct{}{},
	}
	eh.id = newHandle(kindEngine, eh)
	*out = C.uintptr_t(eh.id)
	return statusOK
}

// defaultTimeout is the engine's DefaultTimeout as engine.New settles it:
// the engine does not report its options.
func defaultTimeout(o engine.Options) time.Duration {
	d := o.DefaultTimeout
	if !o.IgnoreEnv {
		if v, err := strconv.Atoi(os.Getenv("KVFERRY_TIMEOUT_MS")); err == nil && v >= 0 {
			d = time.Duration(v) * time.Millisecond
		}
	}
	if d <= 0 {
		d = 30 * time.Second
	}
	return d
}

// engineOptions reads the caller's options, honouring struct_size.
func engineOptions(copts *C.kvf_engine_options) (engine.Options, int, error) {
	var o engine.Options
	if copts == nil {
		return o, 0, nil
	}
	size := uintptr(copts.struct_size)
	const known = unsafe.Sizeof(C.kvf_engine_options{})
	const first = unsafe.Offsetof(C.kvf_engine_options{}.host)
	switch {
	case size < first:
		return o, 0, fmt.Errorf("%w: options struct_size %d is too small (use kvf_engine_options_init)", engine.ErrInvalidArg, size)
	case size > 1<<16:
		return o, 0, fmt.Errorf("%w: options struct_size %d is implausible (use kvf_engine_options_init)", engine.ErrInvalidArg, size)
	case size > known:
		tail := unsafe.Slice((*byte)(unsafe.Add(unsafe.Pointer(copts), known)), size-known)
		for i, b := range tail {
			if b != 0 {
				return o, 0, fmt.Errorf("%w: options byte %d is set, but this library (%s) knows only %d bytes of options",
					engine.ErrUnsupported, int(known)+i, C.KVF_VERSION_STRING, known)
			}
		}
	}
	var c C.kvf_engine_options // fields past the caller's struct_size stay zero
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&c)), known), unsafe.Slice((*byte)(unsafe.Pointer(copts)), min(size, known)))
	if c.flags&^C.KVF_ENGINE_IGNORE_ENV != 0 {
		return o, 0, fmt.Errorf("%w: unknown option flags %#x", engine.ErrUnsupported, uint32(c.flags&^C.KVF_ENGINE_IGNORE_ENV))
	}
	if c.reserved != 0 {
		return o, 0, fmt.Errorf("%w: options field reserved must be 0", engine.ErrInvalidArg)
	}
	o.IgnoreEnv = c.flags&C.KVF_ENGINE_IGNORE_ENV != 0
	if c.host != nil {
		o.Host = C.GoString(c.host)
	}
	if c.protocol != nil {
		o.Protocol = C.GoString(c.protocol)
	}
	for _, f := range []struct {
		src *C.char
		dst *string
	}{
		{c.advertise_host, &o.AdvertiseHost}, {c.secret_key_file, &o.SecretKeyFile},
		{c.allowlist_file, &o.AllowlistFile}, {c.cluster_secret_file, &o.ClusterSecretFile},
		{c.metrics_addr, &o.MetricsAddr}, {c.metadata, &o.Metadata},
	} {
		if f.src != nil {
			*f.dst = C.GoString(f.src)
		}
	}
	o.Port = int(c.port)
	o.PathsPerPeer = int(c.paths_per_peer)
	if c.slice_size > 1<<40 {
		return o, 0, fmt.Errorf("%w: slice size %d", engine.ErrInvalidArg, uint64(c.slice_size))
	}
	o.SliceSize = int(c.slice_size)
	o.MaxRetries = int(c.max_retries)
	for _, d := range []struct {
		name string
		ms   C.int32_t
		dst  *time.Duration
	}{
		{"default_timeout_ms", c.default_timeout_ms, &o.DefaultTimeout},
		{"io_timeout_ms", c.io_timeout_ms, &o.IOTimeout},
		{"heartbeat_ms", c.heartbeat_ms, &o.HeartbeatInterval},
	} {
		if d.ms < 0 {
			return o, 0, fmt.Errorf("%w: %s %d is negative", engine.ErrInvalidArg, d.name, int32(d.ms))
		}
		*d.dst = time.Duration(d.ms) * time.Millisecond
	}
	if c.heartbeat_misses < 0 {
		return o, 0, fmt.Errorf("%w: heartbeat_misses %d is negative", engine.ErrInvalidArg, int32(c.heartbeat_misses))
	}
	o.HeartbeatMisses = int(c.heartbeat_misses)
	switch c.log_level {
	case C.KVF_LOG_DEFAULT:
		// A host process (a serving framework) wants problems in its log,
		// not a line per peer: warn, unless KVFERRY_LOG_LEVEL says more.
		o.LogLevel = slog.LevelWarn
	case C.KVF_LOG_INFO:
		o.LogLevel = slog.LevelInfo
	case C.KVF_LOG_DEBUG:
		o.LogLevel = slog.LevelDebug
	case C.KVF_LOG_WARN:
		o.LogLevel = slog.LevelWarn
	case C.KVF_LOG_ERROR:
		o.LogLevel = slog.LevelError
	case C.KVF_LOG_OFF:
		o.Logger = slog.New(slog.DiscardHandler)
	default:
		return o, 0, fmt.Errorf("%w: log_level %d: want a KVF_LOG_* value", engine.ErrInvalidArg, int32(c.log_level))
	}
	if c.go_max_procs < 0 {
		return o, 0, fmt.Errorf("%w: go_max_procs %d is negative", engine.ErrInvalidArg, int32(c.go_max_procs))
	}
	return o, int(c.go_max_procs), nil
}

// procsSet is the GOMAXPROCS an engine's go_max_procs last set; 0: none.
var procsSet atomic.Int64

// setMaxProcs applies an engine's go_max_procs. The Go runtime is one per
// process, so the value is process-wide: when it changes a value another
// engine set, the application is told, since that engine's threads change
// too.
func setMaxProcs(n int) {
	if prev := procsSet.Swap(int64(n)); prev != 0 && prev != int64(n) {
		slog.Warn("kvferry: go_max_procs is process-wide; this engine changes the value an earlier engine set",
			"previous", prev, "now", n)
	}
	runtime.GOMAXPROCS(n)
}

//export kvfgo_engine_destroy
func kvfgo_engine_destroy(h C.uintptr_t) C.int {
	return withHandle("kvf_engine_destroy", h, func(fn string, eh *engineH) C.int {
		if !handles.CompareAndDelete(uintptr(h), eh) {
			return fail(fn, whyBad(uintptr(h), kindEngine)) // a concurrent destroy won
		}
		eh.mu.Lock()
		eh.closed = true
		children := eh.children
		eh.children = nil
		bufs := eh.bufs
		eh.bufs = nil
		eh.mu.Unlock()
		for id := range children {
			handles.Delete(id)
		}
		errs := []error{eh.e.Close()}
		for addr := range bufs {
			errs = append(errs, eh.e.FreeBuffer(addr))
		}
		return result(fn, errors.Join(errs...))
	})
}

//export kvfgo_engine_name
func kvfgo_engine_name(h C.uintptr_t, buf *C.char, capacity C.size_t, lenOut *C.size_t) C.int {
	return withHandle("kvf_engine_name", h, func(fn string, eh *engineH) C.int {
		return copyString(fn, eh.name, buf, capacity, lenOut)
	})
}

//export kvfgo_metrics_text
func kvfgo_metrics_text(h C.uintptr_t, buf *C.char, capacity C.size_t, lenOut *C.size_t) C.int {
	return withHandle("kvf_metrics_text", h, func(fn string, eh *engineH) C.int {
		text, err := eh.e.MetricsText()
		if err != nil {
			return result(fn, err)
		}
		return copyString(fn, text, buf, capacity, lenOut)
	})
}

//export kvfgo_metrics_addr
func kvfgo_metrics_addr(h C.uintptr_t, buf *C.char, capacity C.size_t, lenOut *C.size_t) C.int {
	return withHandle("kvf_metrics_addr", h, func(fn string, eh *engineH) C.int {
		return copyString(fn, eh.e.MetricsAddr(), buf, capacity, lenOut)
	})
}

//export kvfgo_engine_public_key
func kvfgo_engine_public_key(h C.uintptr_t, buf *C.char, capacity C.size_t, lenOut *C.size_t) C.int {
	return withHandle("kvf_engine_public_key", h, func(fn string, eh *engineH) C.int {
		k, ok := eh.e.PublicKey()
		if !ok {
			return failf(fn, errUnsupported, "authentication is off (no secret key or cluster secret)")
		}
		return copyString(fn, k, buf, capacity, lenOut)
	})
}

//export kvfgo_engine_reload_allowlist
func kvfgo_engine_reload_allowlist(h C.uintptr_t, timeoutMs C.int) C.int {
	return withHandle("kvf_engine_reload_allowlist", h, func(fn string, eh *engineH) C.int {
		ctx, cancel, ok := boundedCtx(timeoutMs, eh.defTimeout)
		if !ok {
			return badTimeout(fn, timeoutMs)
		}
		defer cancel()
		return result(fn, eh.e.ReloadAllowlist(ctx))
	})
}

//export kvfgo_engine_stats
func kvfgo_engine_stats(h C.uintptr_t, out *C.kvf_stats) C.int {
	return withHandle("kvf_engine_stats", h, func(fn string, eh *engineH) C.int {
		if out == nil {
			return failf(fn, errInvalid, "out is NULL")
		}
		size := uintptr(out.struct_size)
		const first = unsafe.Offsetof(C.kvf_stats{}.bytes_written)
		if size < first || size > 1<<16 {
			return failf(fn, errInvalid, "struct_size %d: set it to sizeof(kvf_stats)", size)
		}
		s := eh.e.Stats()
		var c C.kvf_stats
		c.struct_size = out.struct_size
		c.bytes_written = C.uint64_t(s.BytesWritten)
		c.bytes_read = C.uint64_t(s.BytesRead)
		c.tasks_completed = C.uint64_t(s.TasksCompleted)
		c.tasks_failed = C.uint64_t(s.TasksFailed)
		c.tasks_canceled = C.uint64_t(s.TasksCanceled)
		c.tasks_in_flight = C.int64_t(s.TasksInFlight)
		c.retries = C.uint64_t(s.Retries)
		c.owner_bytes_in = C.uint64_t(s.OwnerBytesIn)
		c.owner_bytes_out = C.uint64_t(s.OwnerBytesOut)
		c.owner_refused = C.uint64_t(s.OwnerRefused)
		c.refused_in_flight = C.uint64_t(s.RefusedInFlight)
		c.protocol_errors = C.uint64_t(s.ProtocolErrors)
		c.control_dropped = C.uint64_t(s.ControlDropped)
		c.control_late = C.uint64_t(s.ControlLate)
		c.registrations = C.uint64_t(s.Registrations)
		c.open_segments = C.uint64_t(s.OpenSegments)
		c.aborts_safe = C.uint64_t(s.AbortsSafe)
		c.aborts_not_safe = C.uint64_t(s.AbortsNotSafe)
		c.abort_acks = C.uint64_t(s.AbortAcks)
		c.acks_unmatched = C.uint64_t(s.AcksUnmatched)
		c.aborts_received = C.uint64_t(s.AbortsReceived)
		c.tasks_aborted = C.uint64_t(s.TasksAborted)
		c.tombstones = C.uint64_t(s.Tombstones)
		c.events_dropped = C.uint64_t(s.EventsDropped)
		c.control_conns = C.uint64_t(s.ControlConns)
		c.control_conns_refused = C.uint64_t(s.ControlConnsRefused)
		c.control_conns_cut = C.uint64_t(s.ControlConnsCut)
		c.control_over_budget = C.uint64_t(s.ControlOverBudget)
		c.control_send_fails = C.uint64_t(s.ControlSendFails)
		c.data_conns = C.uint64_t(s.DataConns)
		c.conns_refused = C.uint64_t(s.ConnsRefused)
		c.idle_closed = C.uint64_t(s.IdleClosed)
		c.frame_timeouts = C.uint64_t(s.FrameTimeouts)
		c.accept_errors = C.uint64_t(s.AcceptErrors)
		c.aborts_dropped = C.uint64_t(s.AbortsDropped)
		c.canceled_dropped = C.uint64_t(s.CanceledDropped)
		c.rdma_responder_qps = C.uint64_t(s.RDMAResponderQPs)
		c.rdma_connects_refused = C.uint64_t(s.RDMAConnectsRefused)
		c.fences_safe = C.uint64_t(s.FencesSafe)
		c.fences_not_safe = C.uint64_t(s.FencesNotSafe)
		c.fence_epoch = C.uint64_t(s.FenceEpoch)
		c.fence_refused = C.uint64_t(s.FenceRefused)
		c.fence_acks = C.uint64_t(s.FenceAcks)
		c.fence_acks_unmatched = C.uint64_t(s.FenceAcksUnmatched)
		c.fences_received = C.uint64_t(s.FencesReceived)
		c.auth_refused = C.uint64_t(s.AuthRefused)
		// Fill what the caller's struct has room for; leave any newer tail alone.
		n := min(size, unsafe.Sizeof(c))
		copy(unsafe.Slice((*byte)(unsafe.Pointer(out)), n), unsafe.Slice((*byte)(unsafe.Pointer(&c)), n))
		return statusOK
	})
}

// Memory.

//export kvfgo_register_memory
func kvfgo_register_memory(h C.uintptr_t, addr C.uintptr_t, n C.size_t, location *C.char) C.int {
	return withHandle("kvf_register_memory", h, func(fn string, eh *engineH) C.int {
		if err := checkRange("memory", uintptr(addr), uint64(n)); err != nil {
			return fail(fn, err)
		}
		mem := unsafe.Slice((*byte)(ptrAt(uintptr(addr))), int(n))
		if _, err := eh.e.RegisterMemory(mem, goLocation(location)); err != nil {
			return fail(fn, err)
		}
		return statusOK
	})
}

func goLocation(loc *C.char) string {
	if loc == nil {
		return "cpu"
	}
	return C.GoString(loc)
}

//export kvfgo_unregister_memory
func kvfgo_unregister_memory(h C.uintptr_t, addr C.uintptr_t) C.int {
	return withHandle("kvf_unregister_memory", h, func(fn string, eh *engineH) C.int {
		if addr == 0 {
			return failf(fn, errInvalid, "address is NULL")
		}
		return result(fn, eh.e.UnregisterMemory(uint64(addr)))
	})
}

//export kvfgo_register_memory_batch
func kvfgo_register_memory_batch(h C.uintptr_t, ranges *C.kvf_memory_range, n C.size_t) C.int {
	return withHandle("kvf_register_memory_batch", h, func(fn string, eh *engineH) C.int {
		if st := checkArray(fn, "ranges", "ranges", unsafe.Pointer(ranges), n); st != statusOK {
			return st
		}
		// Addresses are read as integers: the array's void* fields are never
		// held in Go pointer variables before they are checked.
		type cRange struct {
			addr     uintptr
			len      uintptr
			location *C.char
		}
		var _ [unsafe.Sizeof(cRange{}) - C.sizeof_kvf_memory_range]byte
		var _ [C.sizeof_kvf_memory_range - unsafe.Sizeof(cRange{})]byte
		cr := unsafe.Slice((*cRange)(unsafe.Pointer(ranges)), int(n))
		rs := make([]engine.MemoryRange, len(cr))
		for i := range cr {
			if err := checkRange(fmt.Sprintf("range %d", i), cr[i].addr, uint64(cr[i].len)); err != nil {
				return fail(fn, err)
			}
			rs[i] = engine.MemoryRange{Mem: unsafe.Slice((*byte)(ptrAt(cr[i].addr)), int(cr[i].len)), Location: goLocation(cr[i].location)}
		}
		if _, err := eh.e.RegisterMemoryBatch(rs); err != nil {
			return fail(fn, err)
		}
		return statusOK
	})
}

//export kvfgo_unregister_memory_batch
func kvfgo_unregister_memory_batch(h C.uintptr_t, addrs *C.uintptr_t, n C.size_t) C.int {
	return withHandle("kvf_unregister_memory_batch", h, func(fn string, eh *engineH) C.int {
		if st := checkArray(fn, "addresses", "addrs", unsafe.Pointer(addrs), n); st != statusOK {
			return st
		}
		ca := unsafe.Slice(addrs, int(n))
		as := make([]uint64, len(ca))
		for i, a := range ca {
			if a == 0 {
				return failf(fn, errInvalid, "address %d is NULL", i)
			}
			as[i] = uint64(a)
		}
		return result(fn, eh.e.UnregisterMemoryBatch(as))
	})
}

//export kvfgo_alloc_buffer
func kvfgo_alloc_buffer(h C.uintptr_t, n C.size_t, location *C.char, out *C.uintptr_t) C.int {
	return withHandle("kvf_alloc_buffer", h, func(fn string, eh *engineH) C.int {
		switch {
		case out == nil:
			return failf(fn, errInvalid, "out is NULL")
		case n == 0:
			return failf(fn, errInvalid, "length is 0")
		case uint64(n) > 1<<46:
			return failf(fn, errNoMemory, "length %d is more than this engine maps", n)
		}
		mem, err := eh.e.AllocBuffer(int(n), goLocation(location))
		if err != nil {
			return fail(fn, err)
		}
		addr := engine.AddrOf(mem)
		eh.mu.Lock()
		closed := eh.closed
		if !closed {
			eh.bufs[addr] = struct{}{}
		}
		eh.mu.Unlock()
		if closed {
			_ = eh.e.FreeBuffer(addr)
			return fail(fn, engine.ErrClosed)
		}
		*out = C.uintptr_t(addr)
		return statusOK
	})
}

//export kvfgo_free_buffer
func kvfgo_free_buffer(h C.uintptr_t, addr C.uintptr_t) C.int {
	return withHandle("kvf_free_buffer", h, func(fn string, eh *engineH) C.int {
		if addr == 0 {
			return failf(fn, errInvalid, "address is NULL")
		}
		if err := eh.e.FreeBuffer(uint64(addr)); err != nil {
			return fail(fn, err)
		}
		eh.mu.Lock()
		if eh.bufs != nil {
			delete(eh.bufs, uint64(addr))
		}
		eh.mu.Unlock()
		return statusOK
	})
}

// Segments.

//export kvfgo_open_segment
func kvfgo_open_segment(h C.uintptr_t, name *C.char, timeoutMs C.int, out *C.uintptr_t) C.int {
	return withHandle("kvf_open_segment", h, func(fn string, eh *engineH) C.int {
		switch {
		case out == nil:
			return failf(fn, errInvalid, "out is NULL")
		case name == nil:
			return failf(fn, errInvalid, "name is NULL")
		case !bounded(timeoutMs):
			return badTimeout(fn, timeoutMs)
		}
		ctx, cancel := timeoutCtx(timeoutMs)
		defer cancel()
		eh.segMu.RLock()
		defer eh.segMu.RUnlock()
		s, err := eh.e.OpenSegment(ctx, C.GoString(name))
		if err != nil {
			return fail(fn, err)
		}
		sh := &segmentH{eh: eh, s: s}
		eh.mu.Lock()
		if eh.closed {
			eh.mu.Unlock()
			return fail(fn, engine.ErrClosed)
		}
		id := newHandle(kindSegment, sh)
		eh.children[id] = struct{}{}
		eh.segRefs[s]++
		eh.mu.Unlock()
		*out = C.uintptr_t(id)
		return statusOK
	})
}

//export kvfgo_close_segment
func kvfgo_close_segment(h C.uintptr_t) C.int {
	return withHandle("kvf_close_segment", h, func(fn string, sh *segmentH) C.int {
		eh := sh.eh
		eh.segMu.Lock()
		defer eh.segMu.Unlock()
		if _, ok := handles.LoadAndDelete(uintptr(h)); !ok {
			return fail(fn, whyBad(uintptr(h), kindSegment)) // a concurrent close won
		}
		eh.mu.Lock()
		if eh.closed {
			eh.mu.Unlock()
			return statusOK // destroy closes the engine's segments
		}
		delete(eh.children, uintptr(h))
		eh.segRefs[sh.s]--
		last := eh.segRefs[sh.s] == 0
		if last {
			delete(eh.segRefs, sh.s)
		}
		eh.mu.Unlock()
		if last {
			if err := eh.e.CloseSegment(sh.s); err != nil {
				return fail(fn, err)
			}
		}
		return statusOK
	})
}

//export kvfgo_segment_buffer_count
func kvfgo_segment_buffer_count(h C.uintptr_t, count *C.size_t) C.int {
	return withHandle("kvf_segment_buffer_count", h, func(fn string, sh *segmentH) C.int {
		if count == nil {
			return failf(fn, errInvalid, "count is NULL")
		}
		*count = C.size_t(len(sh.s.Descriptor().Buffers))
		return statusOK
	})
}

//export kvfgo_segment_buffer
func kvfgo_segment_buffer(h C.uintptr_t, index C.size_t, addr, n *C.uint64_t) C.int {
	return withHandle("kvf_segment_buffer", h, func(fn string, sh *segmentH) C.int {
		bufs := sh.s.Descriptor().Buffers
		if uint64(index) >= uint64(len(bufs)) {
			return failf(fn, errInvalid, "index %d: segment %s has %d buffers", index, sh.s.Name(), len(bufs))
		}
		b := bufs[index]
		if addr != nil {
			*addr = C.uint64_t(b.Addr)
		}
		if n != nil {
			*n = C.uint64_t(b.Len)
		}
		return statusOK
	})
}

//export kvfgo_segment_name
func kvfgo_segment_name(h C.uintptr_t, buf *C.char, capacity C.size_t, lenOut *C.size_t) C.int {
	return withHandle("kvf_segment_name", h, func(fn string, sh *segmentH) C.int {
		return copyString(fn, sh.s.Name(), buf, capacity, lenOut)
	})
}

// Requests and batches.

// cRequest mirrors kvf_request with integers for the pointer fields, so a
// made-up handle or address is never held in a Go pointer.
type cRequest struct {
	op, flags uint32
	local     uintptr
	segment   uintptr
	remote    uint64
	length    uint64
	requestID uint64
}

// Layout checks, at compile time: each constant overflows (a negative
// value converted to uint) and fails to compile unless both sides agree.
const (
	_ = uint(unsafe.Sizeof(cRequest{})-C.sizeof_kvf_request) | uint(C.sizeof_kvf_request-unsafe.Sizeof(cRequest{}))
	_ = uint(unsafe.Offsetof(cRequest{}.local)-unsafe.Offsetof(C.kvf_request{}.local)) | uint(unsafe.Offsetof(C.kvf_request{}.local)-unsafe.Offsetof(cRequest{}.local))
	_ = uint(unsafe.Offsetof(cRequest{}.segment)-unsafe.Offsetof(C.kvf_request{}.segment)) | uint(unsafe.Offsetof(C.kvf_request{}.segment)-unsafe.Offsetof(cRequest{}.segment))
	_ = uint(unsafe.Offsetof(cRequest{}.requestID)-unsafe.Offsetof(C.kvf_request{}.request_id)) | uint(unsafe.Offsetof(C.kvf_request{}.request_id)-unsafe.Offsetof(cRequest{}.requestID))
)

var reqPool = sync.Pool{New: func() any { return new([]engine.Request) }}

// convert turns the C array into engine requests in one pass. The segment
// handle of the previous request is reused without a lookup, so a batch to
// one peer costs one table lookup.
func convert(eh *engineH, reqs *C.kvf_request, n C.size_t, dst []engine.Request) error {
	cr := unsafe.Slice((*cRequest)(unsafe.Pointer(reqs)), int(n))
	var lastH uintptr
	var lastS *engine.Segment
	for i := range cr {
		r := &cr[i]
		var op engine.Op
		switch r.op {
		case C.KVF_OP_READ:
			op = engine.Read
		case C.KVF_OP_WRITE:
			op = engine.Write
		default:
			return fmt.Errorf("request %d: %w: op %d: want KVF_OP_READ or KVF_OP_WRITE", i, engine.ErrInvalidArg, r.op)
		}
		switch {
		case r.flags != 0:
			return fmt.Errorf("request %d: %w: flags %#x: must be 0", i, engine.ErrInvalidArg, r.flags)
		case r.local == 0:
			return fmt.Errorf("request %d: %w: local address is NULL", i, engine.ErrInvalidArg)
		case r.length == 0:
			return fmt.Errorf("request %d: %w: length is 0", i, engine.ErrInvalidArg)
		case uint64(r.local)+r.length < uint64(r.local):
			return fmt.Errorf("request %d: %w: local range [%#x, +%d) wraps around", i, engine.ErrInvalidArg, r.local, r.length)
		case r.remote+r.length < r.remote:
			return fmt.Errorf("request %d: %w: remote range [%#x, +%d) wraps around", i, engine.ErrInvalidArg, r.remote, r.length)
		}
		if r.segment != lastH || lastS == nil {
			sh, err := lookup[*segmentH](r.segment)
			if err != nil {
				return fmt.Errorf("request %d: %w", i, err)
			}
			if sh.eh != eh {
				return fmt.Errorf("request %d: %w: segment %s was opened by another engine", i, errHandle, sh.s.Name())
			}
			lastH, lastS = r.segment, sh.s
		}
		dst[i] = engine.Request{Op: op, Local: uint64(r.local), Segment: lastS, Remote: r.remote, Length: r.length, RequestID: r.requestID}
	}
	return nil
}

// withRequests converts the C array into a pooled slice and runs f on it.
func withRequests(eh *engineH, reqs *C.kvf_request, n C.size_t, f func([]engine.Request) error) error {
	switch {
	case reqs == nil:
		return fmt.Errorf("%w: reqs is NULL", engine.ErrInvalidArg)
	case n == 0:
		return fmt.Errorf("%w: no requests", engine.ErrInvalidArg)
	case n > 1<<24:
		return fmt.Errorf("%w: %d requests in one call is implausible", engine.ErrInvalidArg, n)
	}
	p := reqPool.Get().(*[]engine.Request)
	if cap(*p) < int(n) {
		*p = make([]engine.Request, n)
	}
	rs := (*p)[:n]
	defer func() {
		clear(rs) // drop segment references
		reqPool.Put(p)
	}()
	if err := convert(eh, reqs, n, rs); err != nil {
		return err
	}
	return f(rs)
}

//export kvfgo_batch_alloc
func kvfgo_batch_alloc(h C.uintptr_t, capacity C.size_t, out *C.uintptr_t) C.int {
	return withHandle("kvf_batch_alloc", h, func(fn string, eh *engineH) C.int {
		switch {
		case out == nil:
			return failf(fn, errInvalid, "out is NULL")
		case capacity == 0:
			return failf(fn, errInvalid, "capacity is 0")
		case capacity > 1<<24:
			return failf(fn, errInvalid, "capacity %d is implausible", capacity)
		}
		b, err := eh.e.AllocateBatch(int(capacity))
		if err != nil {
			return fail(fn, err)
		}
		id, err := eh.adopt(kindBatch, &batchH{eh: eh, b: b})
		if err != nil {
			_ = b.Free()
			return fail(fn, err)
		}
		*out = C.uintptr_t(id)
		return statusOK
	})
}

//export kvfgo_batch_submit
func kvfgo_batch_submit(h C.uintptr_t, reqs *C.kvf_request, n C.size_t) C.int {
	return withHandle("kvf_batch_submit", h, func(fn string, bh *batchH) C.int {
		err := withRequests(bh.eh, reqs, n, func(rs []engine.Request) error {
			// The deadline bounds a descriptor refresh and path dials; the
			// transfers themselves outlive the call.
			ctx, cancel := context.WithTimeout(context.Background(), bh.eh.defTimeout)
			defer cancel()
			return bh.b.Submit(ctx, rs)
		})
		return result(fn, err)
	})
}

func putStatus(out *C.kvf_task_status, r engine.TaskResult) {
	out.state = C.int32_t(r.Status)
	out.error = C.int32_t(taskCode(r))
	out.transferred = C.uint64_t(r.Transferred)
}

//export kvfgo_batch_status
func kvfgo_batch_status(h C.uintptr_t, index C.size_t, out *C.kvf_task_status) C.int {
	return withHandle("kvf_batch_status", h, func(fn string, bh *batchH) C.int {
		if out == nil {
			return failf(fn, errInvalid, "out is NULL")
		}
		if uint64(index) > 1<<31 {
			return failf(fn, errInvalid, "task %d: batch holds %d", index, bh.b.Len())
		}
		r, err := bh.b.Status(int(index))
		if err != nil {
			return fail(fn, err)
		}
		putStatus(out, r)
		return statusOK
	})
}

//export kvfgo_batch_status_all
func kvfgo_batch_status_all(h C.uintptr_t, out *C.kvf_task_status, capacity C.size_t, nOut *C.size_t) C.int {
	return withHandle("kvf_batch_status_all", h, func(fn string, bh *batchH) C.int {
		if out == nil && capacity != 0 {
			return failf(fn, errInvalid, "out is NULL but cap is %d", capacity)
		}
		res := bh.b.Results()
		if nOut != nil {
			*nOut = C.size_t(len(res))
		}
		if out != nil {
			dst := unsafe.Slice(out, min(uint64(capacity), uint64(len(res))))
			for i := range dst {
				putStatus(&dst[i], res[i])
			}
		}
		return statusOK
	})
}

//export kvfgo_batch_task_error
func kvfgo_batch_task_error(h C.uintptr_t, index C.size_t, buf *C.char, capacity C.size_t, lenOut *C.size_t) C.int {
	return withHandle("kvf_batch_task_error", h, func(fn string, bh *batchH) C.int {
		if uint64(index) > 1<<31 {
			return failf(fn, errInvalid, "task %d: batch holds %d", index, bh.b.Len())
		}
		r, err := bh.b.Status(int(index))
		if err != nil {
			return fail(fn, err)
		}
		msg := ""
		if r.Err != nil {
			msg = r.Err.Error()
		}
		return copyString(fn, msg, buf, capacity, lenOut)
	})
}

// firstFailure returns the code and message of the first final task that did
// not complete.
func firstFailure(res []engine.TaskResult) (C.int, string, bool) {
	for i, r := range res {
		if r.Status.Final() && r.Status != engine.Completed {
			msg := r.Status.String()
			if r.Err != nil {
				msg = r.Err.Error()
			}
			return taskCode(r), fmt.Sprintf("task %d: %s", i, msg), true
		}
	}
	return statusOK, "", false
}

//export kvfgo_batch_wait
func kvfgo_batch_wait(h C.uintptr_t, timeoutMs C.int) C.int {
	return withHandle("kvf_batch_wait", h, func(fn string, bh *batchH) C.int {
		ctx, cancel := timeoutCtx(timeoutMs)
		if ctx == nil {
			return failf(fn, errInvalid, "timeout %d ms: want >= 0 or KVF_TIMEOUT_DEFAULT", timeoutMs)
		}
		defer cancel()
		if timeoutMs == defaultTimeoutMillis {
			var c2 context.CancelFunc
			ctx, c2 = context.WithTimeout(ctx, bh.eh.defTimeout)
			defer c2()
		}
		werr := bh.b.Wait(ctx)
		res := bh.b.Results()
		running := 0
		for _, r := range res {
			if !r.Status.Final() {
				running++
			}
		}
		if running > 0 {
			if werr == nil {
				werr = context.DeadlineExceeded
			}
			return failf(fn, errTimeout, "%d of %d tasks still in flight after %d ms (%v); they keep running: wait again or cancel",
				running, len(res), timeoutMs, werr)
		}
		if code, msg, ok := firstFailure(res); ok {
			return failf(fn, code, "%s", msg)
		}
		return statusOK
	})
}

//export kvfgo_batch_cancel
func kvfgo_batch_cancel(h C.uintptr_t) C.int {
	return withHandle("kvf_batch_cancel", h, func(fn string, bh *batchH) C.int {
		return result(fn, bh.b.Cancel())
	})
}

//export kvfgo_batch_free
func kvfgo_batch_free(h C.uintptr_t) C.int {
	return withHandle("kvf_batch_free", h, func(fn string, bh *batchH) C.int {
		if err := bh.b.Free(); err != nil {
			if errors.Is(err, engine.ErrBatchFreed) {
				return fail(fn, whyBad(uintptr(h), kindBatch)) // a concurrent free won
			}
			return fail(fn, err)
		}
		handles.Delete(uintptr(h))
		bh.eh.disown(uintptr(h))
		return statusOK
	})
}

//export kvfgo_transfer_sync
func kvfgo_transfer_sync(h C.uintptr_t, reqs *C.kvf_request, n C.size_t, timeoutMs C.int, out *C.kvf_task_status) C.int {
	return withHandle("kvf_transfer_sync", h, func(fn string, eh *engineH) C.int {
		if !bounded(timeoutMs) {
			return badTimeout(fn, timeoutMs)
		}
		ctx, cancel := timeoutCtx(timeoutMs)
		defer cancel()
		var res []engine.TaskResult
		err := withRequests(eh, reqs, n, func(rs []engine.Request) error {
			var terr error
			res, terr = eh.e.Transfer(ctx, rs)
			return terr
		})
		if out != nil && len(res) > 0 {
			dst := unsafe.Slice(out, len(res))
			for i := range dst {
				putStatus(&dst[i], res[i])
			}
		}
		if err != nil {
			if code, msg, ok := firstFailure(res); ok {
				return failf(fn, code, "%s", msg)
			}
			for i, r := range res {
				if !r.Status.Final() {
					// engine.Transfer promises final tasks; one that is not
					// (a cancel racing Submit once left a task PENDING) is an
					// engine bug, reported as such rather than as a result.
					return failf(fn, errInternal, "task %d is %s after the transfer returned: engine bug (task not final)", i, r.Status)
				}
			}
			return fail(fn, err)
		}
		return statusOK
	})
}
