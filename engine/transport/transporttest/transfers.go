package transporttest

// Data moved byte for byte: READs and WRITEs of many sizes, alone and mixed.

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/kvferry/kvferry/engine/transport"
)

func runTransfers(t *testing.T, f Factory) {
	ops := []transport.Op{transport.Write, transport.Read}
	for _, op := range ops {
		for _, n := range []int{1, 4096, mib + 1, 16 * mib} {
			t.Run(fmt.Sprintf("a %v of %s arrives byte for byte", op, sizeName(n)), func(t *testing.T) {
				e := newEnv(t, f)
				size := n + 64<<10
				owner, local := e.alloc(e.ownerReg, size, 1), e.alloc(e.initReg, size, 2)
				// Odd offsets, so no transport gets by on alignment.
				e.transfer(t, owner, local, []spec{{op: op, ownerOff: 4097 + 3, localOff: 12345, n: n}}, 1, 1)
			})
		}
	}
	for _, op := range ops {
		t.Run(fmt.Sprintf("%v slices at the very start and the very end of a registered range move intact", op), func(t *testing.T) {
			e := newEnv(t, f)
			const regionLen = 3 * mib
			owner, local := e.alloc(e.ownerReg, regionLen, 3), e.alloc(e.initReg, regionLen, 4)
			for _, n := range []int{1, 4096, mib + 1} {
				e.transfer(t, owner, local, []spec{
					{op: op, ownerOff: 0, localOff: regionLen - n, n: n},
					{op: op, ownerOff: regionLen - n, localOff: 0, n: n},
				}, 1, 2)
				fill(owner.data, uint64(n))
				fill(local.data, uint64(n)+1)
				e.checkpoint(nil) // the test changed both buffers itself
			}
		})
	}
	t.Run("many slices of mixed sizes and directions posted in one Post all arrive intact", func(t *testing.T) {
		e := newEnv(t, f)
		owner, local := e.alloc(e.ownerReg, 16*mib, 5), e.alloc(e.initReg, 16*mib, 6)
		e.transfer(t, owner, local, mixedSpecs(1000, 7, 16*mib), 1, 1000)
	})
	t.Run("concurrent Posts from several goroutines all arrive intact", func(t *testing.T) {
		e := newEnv(t, f)
		owner, local := e.alloc(e.ownerReg, 16*mib, 8), e.alloc(e.initReg, 16*mib, 9)
		e.transfer(t, owner, local, mixedSpecs(1000, 10, 16*mib), 8, 5)
	})
}

// mixedSpecs lays out count slices of random sizes (mostly small, some up
// to 256 KiB) and random directions, at random gaps, within limit bytes on
// each side; the initiator side is laid out in a shuffled order so slices
// do not pair up offset for offset.
func mixedSpecs(count int, seed uint64, limit int) []spec {
	r := rand.New(rand.NewPCG(seed, 42))
	sizes := make([]int, count)
	total := 0
	for i := range sizes {
		switch r.IntN(16) {
		case 0:
			sizes[i] = 1 + r.IntN(256<<10)
		case 1, 2, 3, 4:
			sizes[i] = 1 + r.IntN(16)
		default:
			sizes[i] = 1 + r.IntN(8<<10)
		}
		total += sizes[i]
	}
	if total > limit {
		panic(fmt.Sprintf("transporttest: %d slices of %d bytes in all do not fit in %d", count, total, limit))
	}
	gap := max(0, (limit-total)/count-1)
	specs := make([]spec, count)
	off := 0
	for i := range specs {
		off += r.IntN(gap + 1)
		specs[i] = spec{op: transport.Write, ownerOff: off, n: sizes[i]}
		if r.IntN(2) == 0 {
			specs[i].op = transport.Read
		}
		off += sizes[i]
	}
	off = 0
	for _, i := range r.Perm(count) {
		off += r.IntN(gap + 1)
		specs[i].localOff = off
		off += sizes[i]
	}
	return specs
}

// Refusals.
