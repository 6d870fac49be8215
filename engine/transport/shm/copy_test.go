package shm

import (
	"bytes"
	"testing"
)

// TestCopyOutCopiesEveryByte: the streaming copy moves exactly the bytes
// copy would, whatever the alignment of either side and the length (below
// and above streamMin, with heads and tails around the 64-byte body), and
// touches nothing past the destination's end.
func TestCopyOutCopiesEveryByte(t *testing.T) {
	src := make([]byte, 3*streamMin+256)
	for i := range src {
		src[i] = byte(i*31 + 7)
	}
	for _, n := range []int{0, 1, 63, streamMin - 1, streamMin, streamMin + 1, 2*streamMin + 77, 3 * streamMin} {
		for _, doff := range []int{0, 1, 15, 16, 33} {
			for _, soff := range []int{0, 3, 64} {
				dst := make([]byte, n+doff+64)
				for i := range dst {
					dst[i] = 0xee
				}
				if got := copyOut(dst[doff:doff+n], src[soff:soff+n]); got != n {
					t.Fatalf("n %d: copied %d", n, got)
				}
				if !bytes.Equal(dst[doff:doff+n], src[soff:soff+n]) {
					t.Fatalf("n %d, dst offset %d, src offset %d: bytes differ", n, doff, soff)
				}
				for i, b := range append(dst[:doff:doff], dst[doff+n:]...) {
					if b != 0xee {
						t.Fatalf("n %d, dst offset %d: byte %d outside the destination changed", n, doff, i)
					}
				}
			}
		}
	}
}
