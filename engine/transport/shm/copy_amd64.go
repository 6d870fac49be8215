package shm

import "unsafe"

// copyNT64 copies n bytes, a multiple of 64, to a 16-byte aligned dst with
// non-temporal stores and fences them (copy_amd64.s).
//
//go:noescape
func copyNT64(dst, src unsafe.Pointer, n uintptr)

// copyOut copies src into dst, as copy does. A large one streams its
// stores past the cache: the owner copies each byte once, its destination
// is not read again soon, and an ordinary store of a line not in the cache
// first reads it from memory, a third of the traffic for nothing.
func copyOut(dst, src []byte) int {
	n := min(len(dst), len(src))
	if n < streamMin {
		return copy(dst, src)
	}
	head := int(-uintptr(unsafe.Pointer(unsafe.SliceData(dst))) & 15)
	copy(dst[:head], src[:head])
	body := (n - head) &^ 63
	copyNT64(unsafe.Pointer(&dst[head]), unsafe.Pointer(&src[head]), uintptr(body))
	copy(dst[head+body:n], src[head+body:n])
	return n
}
