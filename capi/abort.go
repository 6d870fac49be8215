package main

/*
#include "kvferry.h"
*/
import "C"

import (
	"context"
	"time"
	"unsafe"

	"github.com/kvferry/kvferry/engine"
)

// Safe abort, grants, notifications and events.

// maxCName bounds a segment name read from C, so a missing NUL cannot make
// us read far.
const maxCName = 1024

// goName reads a NUL-terminated name of at most maxCName bytes.
func goName(p *C.char) (string, bool) {
	b := unsafe.Slice((*byte)(unsafe.Pointer(p)), maxCName+1)
	for i, c := range b {
		if c == 0 {
			return string(b[:i]), true
		}
	}
	return "", false
}

//export kvfgo_abort
func kvfgo_abort(h C.uintptr_t, rid C.uint64_t, initiators **C.char, n C.size_t, timeoutMs C.int, out *C.kvf_abort_result) C.int {
	return withHandle("kvf_abort", h, func(fn string, eh *engineH) C.int {
		if st := checkResult(fn, "kvf_abort_result", unsafe.Pointer(out), unsafe.Sizeof(*out)); st != statusOK {
			return st
		}
		switch {
		case n > 0 && initiators == nil:
			return failf(fn, errInvalid, "initiators is NULL with n = %d", n)
		case n > engine.MaxAbortInitiators:
			return failf(fn, errInvalid, "%d initiators (at most %d)", n, engine.MaxAbortInitiators)
		}
		ctx, cancel, ok := boundedCtx(timeoutMs, eh.defTimeout)
		if !ok {
			return badTimeout(fn, timeoutMs)
		}
		defer cancel()
		names := make([]string, int(n))
		if n > 0 {
			for i, p := range unsafe.Slice(initiators, int(n)) {
				if p == nil {
					return failf(fn, errInvalid, "initiators[%d] is NULL", i)
				}
				s, ok := goName(p)
				if !ok {
					return failf(fn, errInvalid, "initiators[%d] is longer than %d bytes", i, maxCName)
				}
				names[i] = s
			}
		}
		res, err := eh.e.Abort(ctx, uint64(rid), names)
		if err != nil {
			return fail(fn, err)
		}
		out.safe = cBool(res.Safe)
		out.generation = C.uint64_t(res.Generation)
		out.bytes_confirmed = C.uint64_t(res.BytesConfirmed)
		if !res.Safe {
			return fail(fn, res.Reason)
		}
		return statusOK
	})
}

//export kvfgo_grant
func kvfgo_grant(h C.uintptr_t, initiator *C.char, rid C.uint64_t, ranges *C.kvf_grant_range, n C.size_t, grantID *C.uint64_t) C.int {
	return withHandle("kvf_grant", h, func(fn string, eh *engineH) C.int {
		switch {
		case grantID == nil:
			return failf(fn, errInvalid, "grant_id is NULL")
		case initiator == nil:
			return failf(fn, errInvalid, "initiator is NULL")
		case ranges == nil || n == 0:
			return failf(fn, errInvalid, "no ranges")
		case n > 4096:
			return failf(fn, errInvalid, "%d ranges (at most 4096)", n)
		}
		name, ok := goName(initiator)
		if !ok {
			return failf(fn, errInvalid, "initiator is longer than %d bytes", maxCName)
		}
		cr := unsafe.Slice(ranges, int(n))
		rs := make([]engine.GrantRange, len(cr))
		for i, r := range cr {
			rs[i] = engine.GrantRange{Addr: uint64(r.addr), Len: uint64(r.len)}
		}
		g, err := eh.e.Grant(name, uint64(rid), rs)
		if err != nil {
			return fail(fn, err)
		}
		*grantID = C.uint64_t(g.ID)
		return statusOK
	})
}

//export kvfgo_revoke
func kvfgo_revoke(h C.uintptr_t, grantID C.uint64_t, timeoutMs C.int) C.int {
	return withHandle("kvf_revoke", h, func(fn string, eh *engineH) C.int {
		ctx, cancel, ok := boundedCtx(timeoutMs, eh.defTimeout)
		if !ok {
			return badTimeout(fn, timeoutMs)
		}
		defer cancel()
		return result(fn, eh.e.Revoke(ctx, uint64(grantID)))
	})
}

//export kvfgo_notify
func kvfgo_notify(h C.uintptr_t, rid C.uint64_t, data unsafe.Pointer, n C.size_t) C.int {
	return withHandle("kvf_notify", h, func(fn string, sh *segmentH) C.int {
		switch {
		case n > engine.MaxNotifyData:
			return failf(fn, errInvalid, "%d bytes of data (at most KVF_EVENT_DATA_MAX = %d)", n, engine.MaxNotifyData)
		case n > 0 && data == nil:
			return failf(fn, errInvalid, "data is NULL with len %d", n)
		}
		var buf []byte
		if n > 0 {
			buf = append([]byte(nil), unsafe.Slice((*byte)(data), int(n))...)
		}
		ctx, cancel := context.WithTimeout(context.Background(), sh.eh.defTimeout)
		defer cancel()
		return result(fn, sh.eh.e.Notify(ctx, sh.s, uint64(rid), buf))
	})
}

//export kvfgo_poll_events
func kvfgo_poll_events(h C.uintptr_t, out *C.kvf_event, capacity C.size_t, nOut *C.size_t, timeoutMs C.int) C.int {
	return withHandle("kvf_poll_events", h, func(fn string, eh *engineH) C.int {
		switch {
		case nOut == nil:
			return failf(fn, errInvalid, "n_out is NULL")
		case out == nil || capacity == 0:
			return failf(fn, errInvalid, "no room for events (out NULL or cap 0)")
		case capacity > 1<<20:
			return failf(fn, errInvalid, "cap %d is implausible", capacity)
		case timeoutMs < 0:
			return failf(fn, errInvalid, "timeout %d ms: want >= 0", timeoutMs)
		}
		*nOut = 0
		ctx, cancel := context.WithTimeout(context.Background(), time.Duration(timeoutMs)*time.Millisecond)
		defer cancel()
		evs := make([]engine.Event, int(capacity))
		k, err := eh.e.TakeEvents(ctx, evs)
		dst := unsafe.Slice(out, int(capacity))
		for i := range k {
			putEvent(&dst[i], &evs[i])
		}
		*nOut = C.size_t(k)
		if err != nil && k == 0 {
			return fail(fn, err)
		}
		return statusOK
	})
}

// eventTypes are the kvf_event_type values of the engine's event kinds.
var eventTypes = map[engine.EventKind]C.uint32_t{
	engine.EventAborted:  C.KVF_EVENT_ABORTED,
	engine.EventNotify:   C.KVF_EVENT_NOTIFY,
	engine.EventCanceled: C.KVF_EVENT_CANCELED,
}

// putEvent fills a C event. Peer names and data fit: segment names are
// shorter than KVF_EVENT_PEER_MAX for every host kvferry binds (checked
// here all the same), and data is capped at KVF_EVENT_DATA_MAX on the wire.
func putEvent(c *C.kvf_event, ev *engine.Event) {
	*c = C.kvf_event{}
	c._type = eventTypes[ev.Kind] // 0 for a kind C does not know
	c.request_id = C.uint64_t(ev.RequestID)
	c.generation = C.uint64_t(ev.Generation)
	peer := unsafe.Slice((*byte)(unsafe.Pointer(&c.peer[0])), C.KVF_EVENT_PEER_MAX)
	copy(peer[:C.KVF_EVENT_PEER_MAX-1], ev.Peer)
	data := unsafe.Slice((*byte)(unsafe.Pointer(&c.data[0])), C.KVF_EVENT_DATA_MAX)
	c.data_len = C.uint32_t(copy(data, ev.Data))
}

//export kvfgo_event_fd
func kvfgo_event_fd(h C.uintptr_t, fd *C.int) C.int {
	return withHandle("kvf_event_fd", h, func(fn string, eh *engineH) C.int {
		if fd == nil {
			return failf(fn, errInvalid, "fd is NULL")
		}
		f, err := eh.e.EventFD()
		if err != nil {
			return fail(fn, err)
		}
		*fd = C.int(f)
		return statusOK
	})
}
