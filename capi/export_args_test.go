package main

// The exports' first checks, called through reflect (test files cannot
// name C types): the handle before anything else, then the arguments in
// the order each export documents, before the engine is touched. The
// handles here stand for no engine at all, so an export that went past its
// checks would panic and report KVF_ERR_INTERNAL instead.

import (
	"reflect"
	"testing"

	"github.com/kvferry/kvferry/engine"
)

// Argument markers for callExport; an argument left out or nil is the
// parameter's zero value (NULL, 0).
type (
	nonNull struct{} // a pointer to a zeroed value (a struct_size of 0)
	sized   struct{} // a pointer to a zeroed result struct whose struct_size is its size
)

// callExport calls export f on handle h with args for its other
// parameters, and returns the status it returned.
func callExport(f any, h uintptr, args ...any) int {
	fv := reflect.ValueOf(f)
	in := []reflect.Value{reflect.ValueOf(h).Convert(fv.Type().In(0))}
	for i := 1; i < fv.Type().NumIn(); i++ {
		typ := fv.Type().In(i)
		var a any
		if i-1 < len(args) {
			a = args[i-1]
		}
		switch a := a.(type) {
		case nil:
			in = append(in, reflect.Zero(typ))
		case nonNull:
			in = append(in, reflect.New(typ.Elem()))
		case sized:
			p := reflect.New(typ.Elem())
			*(*uint32)(p.UnsafePointer()) = uint32(typ.Elem().Size()) // struct_size comes first (main.go checks)
			in = append(in, p)
		default:
			in = append(in, reflect.ValueOf(a).Convert(typ))
		}
	}
	return int(fv.Call(in)[0].Int())
}

// handleExports are the exports that take a handle, by the kind they want.
var handleExports = map[kind][]any{
	kindEngine: {kvfgo_engine_destroy, kvfgo_engine_name, kvfgo_engine_stats, kvfgo_register_memory,
		kvfgo_unregister_memory, kvfgo_register_memory_batch, kvfgo_unregister_memory_batch, kvfgo_alloc_buffer,
		kvfgo_free_buffer, kvfgo_open_segment, kvfgo_batch_alloc, kvfgo_transfer_sync, kvfgo_abort, kvfgo_grant,
		kvfgo_revoke, kvfgo_poll_events, kvfgo_event_fd, kvfgo_fence_memory},
	kindSegment: {kvfgo_close_segment, kvfgo_segment_buffer_count, kvfgo_segment_buffer, kvfgo_segment_name,
		kvfgo_notify},
	kindBatch: {kvfgo_batch_submit, kvfgo_batch_status, kvfgo_batch_status_all, kvfgo_batch_task_error,
		kvfgo_batch_wait, kvfgo_batch_cancel, kvfgo_batch_free},
}

func TestEveryExportRefusesABadHandleBeforeItsOtherArguments(t *testing.T) {
	live := map[kind]uintptr{
		kindEngine:  newHandle(kindEngine, &engineH{}),
		kindSegment: newHandle(kindSegment, &segmentH{}),
		kindBatch:   newHandle(kindBatch, &batchH{}),
	}
	t.Cleanup(func() {
		for _, h := range live {
			handles.Delete(h)
		}
	})
	for want, exports := range handleExports {
		stale := newHandle(want, nil)
		handles.Delete(stale)
		bad := []uintptr{0, 0x1234, uintptr(handleMagic) << magicShift, stale}
		for k, h := range live {
			if k != want {
				bad = append(bad, h)
			}
		}
		for _, f := range exports {
			for _, h := range bad {
				if st := callExport(f, h); st != int(errHandleCode) {
					t.Errorf("%s(%#x, NULL...) = %d, want KVF_ERR_HANDLE (%d)",
						reflect.ValueOf(f).Type(), h, st, errHandleCode)
				}
			}
		}
	}
}

func TestExportsRefuseBadArgumentsBeforeTheyReachTheEngine(t *testing.T) {
	eh := newHandle(kindEngine, &engineH{})
	sh := newHandle(kindSegment, &segmentH{})
	bh := newHandle(kindBatch, &batchH{})
	t.Cleanup(func() { handles.Delete(eh); handles.Delete(sh); handles.Delete(bh) })
	const implausible = 1<<24 + 1
	invalid, noMemory := int(errInvalid), int(errNoMemory)
	for _, c := range []struct {
		name string
		f    any
		h    uintptr
		args []any
		want int
	}{
		{"abort, out NULL", kvfgo_abort, eh, []any{1, nil, 0, 1000, nil}, invalid},
		{"abort, struct_size 0", kvfgo_abort, eh, []any{1, nil, 0, 1000, nonNull{}}, invalid},
		{"abort, initiators NULL with n 1", kvfgo_abort, eh, []any{1, nil, 1, 1000, sized{}}, invalid},
		{"abort, too many initiators", kvfgo_abort, eh, []any{1, nonNull{}, engine.MaxAbortInitiators + 1, 1000, sized{}}, invalid},
		{"abort, timeout 0", kvfgo_abort, eh, []any{1, nil, 0, 0, sized{}}, invalid},
		{"abort, timeout -2", kvfgo_abort, eh, []any{1, nil, 0, -2, sized{}}, invalid},
		{"fence, out NULL", kvfgo_fence_memory, eh, []any{nonNull{}, nonNull{}, 1, 1000, nil}, invalid},
		{"fence, struct_size 0", kvfgo_fence_memory, eh, []any{nonNull{}, nonNull{}, 1, 1000, nonNull{}}, invalid},
		{"fence, n 0", kvfgo_fence_memory, eh, []any{nonNull{}, nonNull{}, 0, 1000, sized{}}, invalid},
		{"fence, n past the max", kvfgo_fence_memory, eh, []any{nonNull{}, nonNull{}, 524289, 1000, sized{}}, invalid},
		{"fence, addrs NULL", kvfgo_fence_memory, eh, []any{nil, nonNull{}, 1, 1000, sized{}}, invalid},
		{"fence, lengths NULL", kvfgo_fence_memory, eh, []any{nonNull{}, nil, 1, 1000, sized{}}, invalid},
		{"fence, timeout 0", kvfgo_fence_memory, eh, []any{nonNull{}, nonNull{}, 1, 0, sized{}}, invalid},
		{"fence, timeout -2", kvfgo_fence_memory, eh, []any{nonNull{}, nonNull{}, 1, -2, sized{}}, invalid},
		{"revoke, timeout 0", kvfgo_revoke, eh, []any{1, 0}, invalid},
		{"revoke, timeout -2", kvfgo_revoke, eh, []any{1, -2}, invalid},
		{"grant, grant_id NULL", kvfgo_grant, eh, []any{nonNull{}, 1, nonNull{}, 1, nil}, invalid},
		{"grant, initiator NULL", kvfgo_grant, eh, []any{nil, 1, nonNull{}, 1, nonNull{}}, invalid},
		{"grant, no ranges", kvfgo_grant, eh, []any{nonNull{}, 1, nonNull{}, 0, nonNull{}}, invalid},
		{"grant, too many ranges", kvfgo_grant, eh, []any{nonNull{}, 1, nonNull{}, 4097, nonNull{}}, invalid},
		{"poll_events, n_out NULL", kvfgo_poll_events, eh, []any{nonNull{}, 1, nil, 0}, invalid},
		{"poll_events, cap 0", kvfgo_poll_events, eh, []any{nonNull{}, 0, nonNull{}, 0}, invalid},
		{"poll_events, timeout -1", kvfgo_poll_events, eh, []any{nonNull{}, 1, nonNull{}, -1}, invalid},
		{"event_fd, fd NULL", kvfgo_event_fd, eh, nil, invalid},
		{"engine_stats, out NULL", kvfgo_engine_stats, eh, nil, invalid},
		{"engine_stats, struct_size 0", kvfgo_engine_stats, eh, []any{nonNull{}}, invalid},
		{"register_memory, address NULL", kvfgo_register_memory, eh, []any{0, 4096}, invalid},
		{"unregister_memory, address NULL", kvfgo_unregister_memory, eh, nil, invalid},
		{"register_memory_batch, ranges NULL", kvfgo_register_memory_batch, eh, []any{nil, 1}, invalid},
		{"register_memory_batch, n 0", kvfgo_register_memory_batch, eh, []any{nonNull{}, 0}, invalid},
		{"register_memory_batch, n implausible", kvfgo_register_memory_batch, eh, []any{nonNull{}, implausible}, invalid},
		{"unregister_memory_batch, addrs NULL", kvfgo_unregister_memory_batch, eh, []any{nil, 1}, invalid},
		{"unregister_memory_batch, n implausible", kvfgo_unregister_memory_batch, eh, []any{nonNull{}, implausible}, invalid},
		{"alloc_buffer, out NULL", kvfgo_alloc_buffer, eh, []any{4096, nil, nil}, invalid},
		{"alloc_buffer, length 0", kvfgo_alloc_buffer, eh, []any{0, nil, nonNull{}}, invalid},
		{"alloc_buffer, length past 2^46", kvfgo_alloc_buffer, eh, []any{1<<46 + 1, nil, nonNull{}}, noMemory},
		{"free_buffer, address NULL", kvfgo_free_buffer, eh, nil, invalid},
		{"open_segment, out NULL", kvfgo_open_segment, eh, []any{nonNull{}, 1000, nil}, invalid},
		{"open_segment, name NULL", kvfgo_open_segment, eh, []any{nil, 1000, nonNull{}}, invalid},
		{"open_segment, timeout 0", kvfgo_open_segment, eh, []any{nonNull{}, 0, nonNull{}}, invalid},
		{"open_segment, timeout -2", kvfgo_open_segment, eh, []any{nonNull{}, -2, nonNull{}}, invalid},
		{"batch_alloc, out NULL", kvfgo_batch_alloc, eh, []any{4, nil}, invalid},
		{"batch_alloc, capacity 0", kvfgo_batch_alloc, eh, []any{0, nonNull{}}, invalid},
		{"batch_alloc, capacity implausible", kvfgo_batch_alloc, eh, []any{implausible, nonNull{}}, invalid},
		{"transfer_sync, timeout 0", kvfgo_transfer_sync, eh, []any{nonNull{}, 1, 0, nil}, invalid},
		{"transfer_sync, timeout -2", kvfgo_transfer_sync, eh, []any{nonNull{}, 1, -2, nil}, invalid},
		{"notify, data past the max", kvfgo_notify, sh, []any{1, nil, engine.MaxNotifyData + 1}, invalid},
		{"notify, data NULL with a length", kvfgo_notify, sh, []any{1, nil, 1}, invalid},
		{"segment_buffer_count, count NULL", kvfgo_segment_buffer_count, sh, nil, invalid},
		{"batch_status, out NULL", kvfgo_batch_status, bh, nil, invalid},
		{"batch_status_all, out NULL with a cap", kvfgo_batch_status_all, bh, []any{nil, 1}, invalid},
		{"batch_wait, timeout -2", kvfgo_batch_wait, bh, []any{-2}, invalid},
	} {
		if got := callExport(c.f, c.h, c.args...); got != c.want {
			t.Errorf("%s: %d, want %d", c.name, got, c.want)
		}
	}
}
