// Package wordpattern is the arithmetic of the test patterns the
// two-process tests write and check: a range holds, in its word i (bytes
// 8i to 8i+7, little-endian), base + i*Step, for a base each test derives
// from what the range should hold with Mix. Both processes compute the
// patterns, so neither ships data to the other to check it, and a byte
// that landed at the wrong offset, in the wrong range, or from another
// writer (another base) is caught. Two bases' patterns share a word only
// by a 2^-64 accident.
//
// It is test support: only _test.go files import it.
package wordpattern

import (
	"fmt"
	"math/bits"
	"unsafe"
)

// Step is the difference between consecutive words of a pattern (odd, so
// a pattern repeats no word within 2^64 words).
const Step = 0x9E3779B97F4A7C15

// Mix is splitmix64's finalizer of x: seeds and tags that differ in one bit
// give unrelated bases.
func Mix(x uint64) uint64 {
	x += 0x9E3779B97F4A7C15
	x = (x ^ x>>30) * 0xBF58476D1CE4E5B9
	x = (x ^ x>>27) * 0x94D049BB133111EB
	return x ^ x>>31
}

// Words views b (8-byte aligned, a multiple of 8 bytes long: registered
// memory is page-aligned) as words, so that filling and checking cost a
// store or a compare per 8 bytes. It panics on a range that is not whole
// aligned words, which no test means to check.
func Words(b []byte) []uint64 {
	if len(b) == 0 {
		return nil
	}
	if uintptr(unsafe.Pointer(unsafe.SliceData(b)))%8 != 0 || len(b)%8 != 0 {
		panic(fmt.Sprintf("pattern range at %p, %d bytes: not whole aligned words", unsafe.SliceData(b), len(b)))
	}
	return unsafe.Slice((*uint64)(unsafe.Pointer(unsafe.SliceData(b))), len(b)/8)
}

// Fill writes the pattern that starts at base with step into b.
func Fill(b []byte, base, step uint64) {
	w := Words(b)
	for i := range w {
		w[i] = base
		base += step
	}
}

// DiffBytes counts the bytes in which words a and b differ.
func DiffBytes(a, b uint64) uint64 {
	var n uint64
	for x := a ^ b; x != 0; x &^= 0xFF << (bits.TrailingZeros64(x) &^ 7) {
		n++
	}
	return n
}
