package pd

import (
	"fmt"
	"sync"

	"github.com/kvferry/kvferry/internal/wordpattern"
)

// holder names what a KV slot must hold: the pattern of a prefill request
// (tag = its request id), decode's own pattern written after an abort
// (reuseTag), or zeros (tag 0, never written). pos is the page's position
// in the holder's request, so a page written to the wrong slot of the same
// request is caught too.
type holder struct {
	tag uint64
	pos int
}

// reuseBit marks decode's own patterns; request ids stay below it.
const reuseBit = 1 << 63

// reuseTag is the tag of the pattern decode writes into the slots of an
// aborted request when it reuses them.
func reuseTag(rid uint64) uint64 { return rid | reuseBit }

// isRequestTag reports whether tag is a prefill request's (not zeros, not
// decode's own reuse pattern).
func isRequestTag(tag uint64) bool { return tag != 0 && tag&reuseBit == 0 }

// patternOf returns the first word of h's pattern in a slot of layer and
// the step between words: word i is base + i*step. Both processes compute
// it, so neither ships patterns to the other. Two holders' patterns share
// a word only by a 2^-64 accident.
func patternOf(h holder, layer int) (base, step uint64) {
	if h.tag == 0 {
		return 0, 0
	}
	return wordpattern.Mix(h.tag ^ wordpattern.Mix(uint64(layer)<<32|uint64(h.pos))), wordpattern.Step
}

// fillSlot writes h's pattern for layer into b.
func fillSlot(b []byte, h holder, layer int) {
	base, step := patternOf(h, layer)
	wordpattern.Fill(b, base, step)
}

// damage is what checkSlot found.
type damage struct {
	bad uint64 // bytes that differ from the holder's pattern
	old uint64 // of those, bytes in words that equal, whole, an earlier request holder's pattern
	at  int    // byte offset of the first bad word; -1 when none
	got uint64 // that word
	exp uint64 // and what it should be
}

func (d *damage) add(o damage) {
	if d.bad == 0 && o.bad > 0 {
		d.at, d.got, d.exp = o.at, o.got, o.exp
	}
	d.bad += o.bad
	d.old += o.old
}

// checkSlot compares b with h's pattern for layer. A bad word that equals,
// whole, the pattern of one of the earlier request holders in hist counts
// as theirs: a write of an aborted request that landed after the slot was
// reused.
func checkSlot(b []byte, h holder, layer int, hist []holder) damage {
	d := damage{at: -1}
	base, step := patternOf(h, layer)
	exp := base
	for i, v := range wordpattern.Words(b) {
		if v != exp {
			if d.bad == 0 {
				d.at, d.got, d.exp = i*8, v, exp
			}
			n := wordpattern.DiffBytes(v, exp)
			d.bad += n
			for _, o := range hist {
				if !isRequestTag(o.tag) {
					continue
				}
				ob, os := patternOf(o, layer)
				if v == ob+uint64(i)*os {
					d.old += n
					break
				}
			}
		}
		exp += step
	}
	return d
}

// pageState is one page index of the pool (a slot in every layer): its
// current holder and the holders before it, most recent first.
type pageState struct {
	cur  holder
	hist [4]holder
}

// slotPool is decode's KV pool: layers regions of pages slots of pageSize
// bytes, in one registered buffer, like SGLang's per-layer KV buffers. A
// request takes page indices (the same in every layer). Free pages wait in
// a FIFO, so a page reused after an abort stays free for a while before its
// next holder takes it, and a late write has time to show.
type slotPool struct {
	mem                     []byte
	layers, pages, pageSize int

	mu    sync.Mutex
	free  []int
	state []pageState // a page's entry belongs to whoever took the page
}

func newSlotPool(mem []byte, layers, pages, pageSize int) *slotPool {
	if len(mem) < layers*pages*pageSize {
		panic(fmt.Sprintf("slot pool of %d bytes for %d x %d x %d", len(mem), layers, pages, pageSize))
	}
	p := &slotPool{mem: mem, layers: layers, pages: pages, pageSize: pageSize, state: make([]pageState, pages)}
	for i := range pages {
		p.free = append(p.free, i)
	}
	return p
}

// slot returns the memory of page pg in layer.
func (p *slotPool) slot(layer, pg int) []byte {
	off := (layer*p.pages + pg) * p.pageSize
	return p.mem[off : off+p.pageSize : off+p.pageSize]
}

// take pops n pages, oldest freed first.
func (p *slotPool) take(n int) []int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.free) < n {
		panic(fmt.Sprintf("slot pool: %d pages free, want %d (pool too small for the lanes)", len(p.free), n))
	}
	out := append([]int(nil), p.free[:n]...)
	p.free = p.free[n:]
	return out
}

// put returns pages to the back of the FIFO.
func (p *slotPool) put(pgs []int) {
	p.mu.Lock()
	p.free = append(p.free, pgs...)
	p.mu.Unlock()
}

// assign makes h page pg's holder; the old holder moves into the history.
func (p *slotPool) assign(pg int, h holder) {
	s := &p.state[pg]
	copy(s.hist[1:], s.hist[:len(s.hist)-1])
	s.hist[0] = s.cur
	s.cur = h
}

// check compares every layer's slot of page pg with its holder's pattern.
func (p *slotPool) check(pg int) damage {
	s := &p.state[pg]
	d := damage{at: -1}
	for l := range p.layers {
		d.add(checkSlot(p.slot(l, pg), s.cur, l, s.hist[:]))
	}
	return d
}

// fill writes the holder's pattern into every layer's slot of page pg.
func (p *slotPool) fill(pg int) {
	for l := range p.layers {
		fillSlot(p.slot(l, pg), p.state[pg].cur, l)
	}
}
