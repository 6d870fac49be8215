package main

/*
#include "kvferry.h"
*/
import "C"

import (
	"fmt"
	"unsafe"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/engine/fence"
)

// Fences by memory range.

// KVF_FENCE_RANGES_MAX must be a count that the engine takes, both at its
// door (engine.MaxFenceRanges) and in its fence table (fence.MaxRanges):
// each constant fails to compile (a negative value converted to uint)
// otherwise.
const (
	_ = uint(engine.MaxFenceRanges - C.KVF_FENCE_RANGES_MAX)
	_ = uint(fence.MaxRanges - C.KVF_FENCE_RANGES_MAX)
)

//export kvfgo_fence_memory
func kvfgo_fence_memory(h C.uintptr_t, addrs, lengths *C.uint64_t, n C.size_t, timeoutMs C.int, out *C.kvf_fence_result) C.int {
	return withHandle("kvf_fence_memory", h, func(fn string, eh *engineH) C.int {
		if st := checkResult(fn, "kvf_fence_result", unsafe.Pointer(out), unsafe.Sizeof(*out)); st != statusOK {
			return st
		}
		switch {
		case n == 0:
			return failf(fn, errInvalid, "no ranges (n is 0)")
		case n > C.KVF_FENCE_RANGES_MAX:
			return failf(fn, errInvalid, "%d ranges (at most KVF_FENCE_RANGES_MAX = %d)", n, C.KVF_FENCE_RANGES_MAX)
		case addrs == nil:
			return failf(fn, errInvalid, "addrs is NULL with n = %d", n)
		case lengths == nil:
			return failf(fn, errInvalid, "lengths is NULL with n = %d", n)
		}
		ctx, cancel, ok := boundedCtx(timeoutMs, eh.defTimeout)
		if !ok {
			return badTimeout(fn, timeoutMs)
		}
		defer cancel()
		// One pass over both arrays; the message is built only for a bad range.
		ca, cl := unsafe.Slice(addrs, int(n)), unsafe.Slice(lengths, int(n))
		rs := make([]engine.FenceRange, len(ca))
		for i := range ca {
			a, l := uint64(ca[i]), uint64(cl[i])
			if a < minAddr || l == 0 || a+l < a || l > 1<<62 {
				return fail(fn, checkRange(fmt.Sprintf("range %d", i), uintptr(a), l))
			}
			rs[i] = engine.FenceRange{Addr: a, Len: l}
		}
		res, err := eh.e.Fence(ctx, rs)
		if err != nil {
			return fail(fn, err)
		}
		out.safe = cBool(res.Safe)
		out.epoch = C.uint64_t(res.Epoch)
		out.peers_told = C.uint32_t(len(res.Told))
		out.peers_acked = C.uint32_t(len(res.Acked))
		out.peers_cut = C.uint32_t(len(res.Cut))
		out.reserved = 0
		switch {
		case res.Safe:
			return statusOK
		case res.Reason == nil:
			return failf(fn, errInternal, "fence of %d ranges not safe, without a reason: engine bug", n)
		}
		return fail(fn, res.Reason)
	})
}
