package netfault

import (
	"fmt"
	"slices"

	"github.com/kvferry/kvferry/internal/wordpattern"
)

// Patterns (see wordpattern): a range filled with seed s holds, in its
// word i, patternBase(s) + i*patternStep; a byte from another request
// (another seed) is caught.

const patternStep = wordpattern.Step

func patternBase(seed uint64) uint64 { return wordpattern.Mix(seed) }

// fillPattern writes seed's pattern into b.
func fillPattern(b []byte, seed uint64) { wordpattern.Fill(b, patternBase(seed), patternStep) }

// mismatch is what checkPattern found.
type mismatch struct {
	bad      uint64 // bytes that differ from the pattern
	reuse    uint64 // words that equal, whole, the reuse seed's pattern at their place
	at       int    // byte offset of the first bad word; -1 when none
	got, exp uint64 // that word, and what it should be
}

func (m mismatch) String() string {
	if m.bad == 0 {
		return "intact"
	}
	return fmt.Sprintf("%d bad bytes (%d words of the reused range's new pattern), first at byte %d: %#016x, want %#016x",
		m.bad, m.reuse, m.at, m.got, m.exp)
}

// checkPattern compares b with seed's pattern. When reuse is not 0, bad
// words that are reuse's pattern at their place are counted apart: bytes
// written into (or read from) a range after its owner had aborted the
// request and reused the range.
func checkPattern(b []byte, seed, reuse uint64) mismatch {
	m := mismatch{at: -1}
	exp, rexp := patternBase(seed), patternBase(reuse)
	for i, v := range wordpattern.Words(b) {
		if v != exp {
			if m.bad == 0 {
				m.at, m.got, m.exp = 8*i, v, exp
			}
			m.bad += wordpattern.DiffBytes(v, exp)
			if reuse != 0 && v == rexp {
				m.reuse++
			}
		}
		exp += patternStep
		rexp += patternStep
	}
	return m
}

// countPattern counts the words of b that are seed's pattern at their place.
func countPattern(b []byte, seed uint64) uint64 {
	var n uint64
	exp := patternBase(seed)
	for _, v := range wordpattern.Words(b) {
		if v == exp {
			n++
		}
		exp += patternStep
	}
	return n
}

// classify counts, for each seed, the words of b that are its pattern at
// their place; then the words that are none of them whole but whose bytes
// each are one of theirs (a word where one pattern's write stopped and
// another's bytes remain); then the others, which no seed explains.
func classify(b []byte, seeds []uint64) []uint64 {
	out := make([]uint64, len(seeds)+2)
	exp := make([]uint64, len(seeds))
	for k, s := range seeds {
		exp[k] = patternBase(s)
	}
	for _, v := range wordpattern.Words(b) {
		k := slices.Index(exp, v)
		switch {
		case k >= 0:
			out[k]++
		case bytesOfAny(v, exp):
			out[len(seeds)]++
		default:
			out[len(seeds)+1]++
		}
		for k := range exp {
			exp[k] += patternStep
		}
	}
	return out
}

// bytesOfAny reports whether each byte of v is the same byte of one of exp.
func bytesOfAny(v uint64, exp []uint64) bool {
	for sh := 0; sh < 64; sh += 8 {
		ok := false
		for _, e := range exp {
			if byte(v>>sh) == byte(e>>sh) {
				ok = true
				break
			}
		}
		if !ok {
			return false
		}
	}
	return true
}
