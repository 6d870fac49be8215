package wordpattern

import (
	"testing"
	"unsafe"
)

func TestFillWritesBasePlusStepPerWord(t *testing.T) {
	w := make([]uint64, 4)
	b := unsafe.Slice((*byte)(unsafe.Pointer(&w[0])), 32)
	Fill(b, 10, 3)
	for i, v := range Words(b) {
		if v != 10+3*uint64(i) {
			t.Fatalf("word %d = %d, want %d", i, v, 10+3*i)
		}
	}
}

func TestDiffBytesCountsTheBytesThatDiffer(t *testing.T) {
	for _, c := range []struct {
		a, b uint64
		want uint64
	}{{0, 0, 0}, {0, 1, 1}, {0, 0x0100, 1}, {0, 0xFF00_0000_0000_00FF, 2}, {0, ^uint64(0), 8}, {Mix(1), Mix(1), 0}} {
		if got := DiffBytes(c.a, c.b); got != c.want {
			t.Errorf("DiffBytes(%#x, %#x) = %d, want %d", c.a, c.b, got, c.want)
		}
	}
}

func TestWordsRefusesARangeThatIsNotWholeAlignedWords(t *testing.T) {
	w := make([]uint64, 2)
	b := unsafe.Slice((*byte)(unsafe.Pointer(&w[0])), 16)
	for _, r := range [][]byte{b[1:9], b[:7]} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("Words of %d bytes at offset %d did not panic", len(r), uintptr(unsafe.Pointer(&r[0]))-uintptr(unsafe.Pointer(&b[0])))
				}
			}()
			Words(r)
		}()
	}
}
