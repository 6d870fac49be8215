package tcp

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/kvferry/kvferry/engine/kvcodec"
	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
)

// Compressed WRITEs (WRITE_Z). The owner reads the whole block, admits its
// decoded length as a WRITE of that length, decodes it into a scratch
// buffer and copies the result into the target chunk by chunk, each chunk
// inside the target's guard: an abort, a fence or an unregistration stops
// the copy at a chunk boundary, as it stops a plain WRITE between two
// reads. The memory a peer can make the owner hold for blocks and their
// decoded bytes is bounded by zBudget, shared by every connection.

// zBudgetBytes bounds the bytes held for WRITE_Z blocks and their decoded
// data, every connection together; a frame past it waits up to zBudgetWait
// for room, then is refused (Stats.CompressedRefused).
const (
	zBudgetBytes = 256 << 20
	zBudgetWait  = time.Second
	// zCopyChunk is the copy into the target between two guard checks.
	zCopyChunk = 1 << 20
)

// errCompressedBusy refuses a WRITE_Z for want of decoding room.
var errCompressedBusy = errors.New("compressed-write decoding room is at its bound")

// byteBudget is a bounded count of bytes, waited for with a deadline.
type byteBudget struct {
	mu    sync.Mutex
	used  int
	max   int
	freed chan struct{} // closed and replaced when bytes are given back
}

// take reserves n bytes, waiting up to wait; one taker may always hold the
// whole budget, so a frame larger than it is not refused for ever.
func (b *byteBudget) take(n int, wait time.Duration, stop <-chan struct{}) bool {
	deadline := time.Now().Add(wait)
	for {
		b.mu.Lock()
		if b.used+n <= b.max || b.used == 0 {
			b.used += n
			b.mu.Unlock()
			return true
		}
		if b.freed == nil {
			b.freed = make(chan struct{})
		}
		freed := b.freed
		b.mu.Unlock()
		left := time.Until(deadline)
		if left <= 0 {
			return false
		}
		t := time.NewTimer(left)
		select {
		case <-freed:
			t.Stop()
		case <-t.C:
			return false
		case <-stop:
			t.Stop()
			return false
		}
	}
}

func (b *byteBudget) give(n int) {
	b.mu.Lock()
	b.used -= n
	if b.freed != nil {
		close(b.freed)
		b.freed = nil
	}
	b.mu.Unlock()
}

var zPool = sync.Pool{New: func() any { return new([]byte) }}

func getZBuf(n int) *[]byte {
	p := zPool.Get().(*[]byte)
	if cap(*p) < n {
		*p = make([]byte, n)
	}
	*p = (*p)[:n]
	return p
}

// serveWriteZ applies one WRITE_Z frame and answers WRITE_ACK with the
// decoded bytes applied.
func (c *ownerConn) serveWriteZ(h *header, a *transport.Access) error {
	t := c.t
	ack := header{typ: frameWriteAck, seq: h.seq, requestID: h.requestID, generation: h.generation}
	c.lastWrite = true
	c.startFrame(int(h.length)) // the payload's deadline runs from here
	refuse := func(err error) error {
		ack.status = statusOf(err)
		t.stats.refused.Add(1)
		c.answer(&ack, 0)
		return c.flushIfFull()
	}
	if !c.compress {
		return fmt.Errorf("%w: WRITE_Z on a connection that did not negotiate compression", errBadFrame)
	}
	n := int(h.length)
	if !t.zBudget.take(n, zBudgetWait, t.closed) {
		t.stats.compressedRefused.Add(1)
		ahead := c.takeBuffered(n)
		if err := c.raw.discard(n - len(ahead)); err != nil {
			return c.readErr(err)
		}
		return refuse(fmt.Errorf("%w: %w", transport.ErrRefused, errCompressedBusy))
	}
	defer t.zBudget.give(n)
	bp := getZBuf(n)
	defer zPool.Put(bp)
	block := *bp
	ahead := copy(block, c.takeBuffered(n))
	if ahead < n {
		if err := c.raw.readFull(block[ahead:]); err != nil {
			return c.readErr(err)
		}
	}
	raw, err := kvcodec.RawLen(block)
	if err != nil || raw == 0 || raw > MaxSliceLength {
		t.stats.compressedMalformed.Add(1)
		return refuse(fmt.Errorf("%w: malformed compressed block: %v (declares %d bytes)", memory.ErrInvalidRange, err, raw))
	}
	a.Length = uint64(raw)
	tgt, err := t.owner.Admit(*a)
	if err != nil {
		return refuse(err)
	}
	if tgt.Stage != nil {
		defer tgt.Stage.Release()
	}
	if t.opts.ApplyDelay > 0 {
		time.Sleep(t.opts.ApplyDelay)
	}
	if !t.zBudget.take(raw, zBudgetWait, t.closed) {
		t.stats.compressedRefused.Add(1)
		return refuse(fmt.Errorf("%w: %w", transport.ErrRefused, errCompressedBusy))
	}
	defer t.zBudget.give(raw)
	dp := getZBuf(raw)
	defer zPool.Put(dp)
	dec, err := t.decoder()
	if err != nil {
		return refuse(fmt.Errorf("%w: %w", transport.ErrRefused, err))
	}
	if err := dec.Decode(*dp, block); err != nil {
		t.stats.compressedMalformed.Add(1)
		return refuse(fmt.Errorf("%w: malformed compressed block: %w", memory.ErrInvalidRange, err))
	}
	landed, refusal := guardedCopy(tgt.Mem, *dp, tgt.Guard)
	if tgt.Stage != nil {
		// Staged (GPU) memory takes the bytes only whole and only inside
		// the guard, as for a plain WRITE.
		applied := 0
		if refusal == nil && landed == len(tgt.Mem) {
			if refusal = transport.StageCopy(tgt.Guard, tgt.Stage.Flush); refusal == nil {
				applied = landed
			}
		}
		landed = applied
	}
	t.stats.bytesIn.Add(uint64(landed))
	t.stats.compressedIn.Add(uint64(n))
	ack.done = uint64(landed)
	if refusal != nil {
		ack.status = statusOf(refusal)
		t.stats.refused.Add(1)
		t.stats.refusedInFlight.Add(1)
	}
	c.answer(&ack, uint64(landed))
	return c.flushIfFull()
}

// guardedCopy copies src into dst zCopyChunk at a time, each chunk inside
// the guard, and stops at the first refusal.
func guardedCopy(dst, src []byte, g transport.Guard) (int, error) {
	done := 0
	for done < len(dst) {
		if err := g.Enter(); err != nil {
			return done, err
		}
		done += copy(dst[done:min(done+zCopyChunk, len(dst))], src[done:])
		g.Leave()
	}
	return done, nil
}

// helloCompress returns the HELLO feature bit saying we may send WRITE_Z.
func (t *Transport) helloCompress() uint64 {
	if t.enc == nil {
		return 0
	}
	return helloCompress
}

// compress encodes a WRITE slice's bytes into buf when the owner takes
// WRITE_Z, the slice is large enough and host memory, and the block comes
// out smaller. The bytes are read inside the slice's region guard, as a
// plain WRITE's writev reads them: our own unregistration or fence waits
// for it, and a region already gone leaves the slice to the plain path,
// which fails it.
func (ep *endpoint) compress(s *transport.Slice, buf []byte) ([]byte, bool) {
	if ep.enc == nil || s.Op != transport.Write || len(s.Local) < ep.t.opts.CompressMin || s.LocalReg == nil ||
		strings.HasPrefix(s.LocalReg.Location, "cuda:") {
		return buf, false
	}
	if err := s.LocalReg.Enter(); err != nil {
		return buf, false
	}
	block, err := ep.enc.Encode(buf, s.Local, 2)
	s.LocalReg.Leave()
	if err != nil || len(block) >= len(s.Local) {
		return block, false
	}
	ep.t.stats.compressedSlices.Add(1)
	ep.t.stats.compressedRawOut.Add(uint64(len(s.Local)))
	ep.t.stats.compressedOut.Add(uint64(len(block)))
	return block, true
}
