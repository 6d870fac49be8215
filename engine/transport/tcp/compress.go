package tcp

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

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

// zBudgetBytes bounds the bytes held for WRITE_Z blocks, their decoded
// data and the decoder's scratch, every connection together; a frame past
// it waits, holding nothing, up to FrameTimeout for room, then is refused
// (Stats.CompressedRefused). Each frame takes at most 2 x
// MaxCompressedSlice and 256 KiB: 31 frames are decoded at once at the
// worst.
//
// Compressed READ answers take their own room, readZBudgetBytes, never
// waited for: an answer is held until the initiator reads it, which a
// stalled or hostile reader can put off until the write deadline, so that
// room must not be the one compressed WRITEs wait for (a refusal there is
// final for the request), and without room an answer simply goes plain.
const (
	zBudgetBytes     = 256 << 20
	readZBudgetBytes = 64 << 20
	// zCopyChunk is the copy into the target between two guard checks.
	zCopyChunk = 1 << 20
)

// MaxCompressedSlice is the largest slice sent compressed (its decoded
// length): larger ones go plain, and a WRITE_Z declaring more is refused.
const MaxCompressedSlice = 4 << 20

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
// decoded bytes applied. The order bounds what a peer can make us hold: the
// block's 8-byte header first (its decoded length, at most MaxCompressedSlice
// and at least the block's), then admission of that length (a peer with no
// access allocates nothing), then room for the block, the decoded bytes and
// the decoder's scratch, waited for while nothing is held (the
// connection just stops being read), and only then the rest of the block.
func (c *ownerConn) serveWriteZ(h *header, a *transport.Access) error {
	t := c.t
	ack := header{typ: frameWriteAck, seq: h.seq, requestID: h.requestID, generation: h.generation}
	c.lastWrite = true
	c.startFrame(int(h.length)) // the payload's deadline runs from here
	if !c.compress {
		return fmt.Errorf("%w: WRITE_Z on a connection that did not negotiate compression", errBadFrame)
	}
	n := int(h.length)
	var hdr [8]byte
	got := copy(hdr[:], c.takeBuffered(min(n, len(hdr))))
	if got < min(n, len(hdr)) {
		if err := c.raw.readFull(hdr[got:min(n, len(hdr))]); err != nil {
			return c.readErr(err)
		}
	}
	read := min(n, len(hdr))
	// refuse answers the frame, dropping the payload not read yet.
	refuse := func(err error) error {
		ahead := c.takeBuffered(n - read)
		if err := c.raw.discard(n - read - len(ahead)); err != nil {
			return c.readErr(err)
		}
		ack.status = statusOf(err)
		t.stats.refused.Add(1)
		c.answer(&ack, 0)
		return c.flushIfFull()
	}
	raw, err := kvcodec.RawLen(hdr[:read])
	if err == nil && (raw == 0 || raw > MaxCompressedSlice || n > raw) {
		err = fmt.Errorf("block of %d bytes declaring %d (1 to %d, and no fewer than the block)", n, raw, MaxCompressedSlice)
	}
	if err != nil {
		t.stats.compressedMalformed.Add(1)
		return refuse(fmt.Errorf("%w: malformed compressed block: %v", memory.ErrInvalidRange, err))
	}
	a.Length = uint64(raw)
	tgt, err := t.owner.Admit(*a)
	if err != nil {
		return refuse(err)
	}
	if tgt.Stage != nil {
		defer tgt.Stage.Release()
	}
	// The block, the decoded bytes and the decoder's plane scratch.
	need := n + raw + 2*kvcodec.ChunkSize
	if !t.zBudget.take(need, t.opts.FrameTimeout, t.closed) {
		t.stats.compressedRefused.Add(1)
		return refuse(fmt.Errorf("%w: %w", transport.ErrRefused, errCompressedBusy))
	}
	defer t.zBudget.give(need)
	bp := getZBuf(n)
	defer zPool.Put(bp)
	block := *bp
	copy(block, hdr[:read])
	if read < n {
		ahead := copy(block[read:], c.takeBuffered(n-read))
		if read+ahead < n {
			if err := c.raw.readFull(block[read+ahead:]); err != nil {
				return c.readErr(err)
			}
		}
	}
	if t.opts.ApplyDelay > 0 {
		time.Sleep(t.opts.ApplyDelay)
	}
	dp := getZBuf(raw)
	defer zPool.Put(dp)
	dec, err := t.decoder()
	if err != nil {
		ack.status = statusOf(fmt.Errorf("%w: %w", transport.ErrRefused, err))
		t.stats.refused.Add(1)
		c.answer(&ack, 0)
		return c.flushIfFull()
	}
	if err := dec.Decode(*dp, block); err != nil {
		t.stats.compressedMalformed.Add(1)
		ack.status = statusOf(fmt.Errorf("%w: malformed compressed block: %w", memory.ErrInvalidRange, err))
		t.stats.refused.Add(1)
		c.answer(&ack, 0)
		return c.flushIfFull()
	}
	t.stats.compressedIn.Add(uint64(n))
	t.stats.compressedRawIn.Add(uint64(len(*dp)))
	landed, refusal := guardedCopy(tgt.Mem, *dp, tgt.Guard)
	return c.finishWrite(&ack, tgt, landed, refusal)
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

// helloCodecs returns the HELLO feature bits of compression: we take
// READ_DATA_Z answers (every initiator decodes), and we may send WRITE_Z
// when our own compression is on.
func (t *Transport) helloCodecs() uint64 {
	if t.enc == nil {
		return helloReadZ
	}
	return helloReadZ | helloCompress
}

// compressRead says whether a READ of n bytes is answered compressed: on a
// connection that negotiated it, for a slice the encoder takes, always with
// a codec chosen, and with auto as this connection's own sending measures.
func (c *ownerConn) compressRead(n int) bool {
	if c.zPicked {
		// Decided while gathering the READs ahead of it.
		c.zPicked = false
		return true
	}
	t := c.t
	if !c.readZ || n < t.opts.CompressMin || n > MaxCompressedSlice {
		return false
	}
	return !t.opts.CompressAuto || c.auto.pick(time.Now(), c.conn)
}

// nextIsPlainRead reports whether a whole READ header is read ahead that
// is answered plain: a gathered write stops before one answered
// compressed, whose decision is kept for when it is served.
func (c *ownerConn) nextIsPlainRead() bool {
	if !c.nextIsRead() {
		return false
	}
	if !c.readZ {
		return true
	}
	n := int(binary.LittleEndian.Uint32(c.in[c.inStart+28:]))
	if c.compressRead(n) {
		c.zPicked = true
		return false
	}
	return true
}

// serveReadZ answers one READ with READ_DATA_Z and READ_DONE. The target's
// bytes are first copied into a snapshot zCopyChunk at a time, each chunk
// inside the target's guard, so an abort, a fence or an unregistration
// stops the copy at a chunk boundary, and the READ is then refused with no
// data sent; the snapshot is encoded outside the guard, which is never held
// for the encoder's time. A GPU target, a snapshot that does not shrink,
// and want of room in zBudget (not waited for: a plain answer needs none)
// are answered plain.
func (c *ownerConn) serveReadZ(h *header, a *transport.Access) error {
	t := c.t
	c.lastWrite = false
	done := header{typ: frameReadDone, seq: h.seq, requestID: h.requestID, generation: h.generation}
	refuse := func(err error) error {
		done.status = statusOf(err)
		t.stats.refused.Add(1)
		c.answer(&done, 0)
		return c.flushIfFull()
	}
	tgt, err := t.owner.Admit(*a)
	if err != nil {
		return refuse(err)
	}
	if tgt.Stage != nil {
		defer tgt.Stage.Release()
		return c.sendRead(h, tgt)
	}
	if t.opts.ApplyDelay > 0 {
		time.Sleep(t.opts.ApplyDelay)
	}
	raw := len(tgt.Mem)
	// The snapshot and the block, which is sent only when smaller.
	need := 2 * raw
	if !t.readZBudget.take(need, 0, t.closed) {
		return c.sendRead(h, tgt)
	}
	defer t.readZBudget.give(need)
	sp := getZBuf(raw)
	defer zPool.Put(sp)
	copied, refusal := guardedCopy(*sp, tgt.Mem, tgt.Guard)
	if refusal != nil {
		if copied > 0 {
			t.stats.refusedInFlight.Add(1)
		}
		return refuse(refusal)
	}
	bp := getZBuf(raw)
	defer zPool.Put(bp)
	start := time.Now()
	block, err := t.enc.Encode((*bp)[:0], *sp, 2)
	if err == nil {
		c.auto.encoded(raw, len(block), time.Since(start))
	}
	typ, payload := uint8(frameReadData), *sp
	if err == nil && len(block) < raw {
		typ, payload = frameReadDataZ, block
	}
	if cap(block) > cap(*bp) {
		*bp = block // the encoder grew it: keep the room
	}
	c.answer(&header{typ: typ, seq: h.seq, requestID: h.requestID, generation: h.generation, length: uint32(len(payload))}, 0)
	done.done = uint64(raw)
	var tb [HeaderSize]byte
	done.encode(tb[:])
	_ = c.conn.SetWriteDeadline(t.writeDeadline(len(c.answers) + len(payload) + len(tb)))
	// The payload is our snapshot, not registered memory: no guard.
	_, _, err = c.raw.writeGuarded(c.answers, payload, nil, tb[:]...)
	c.answers, c.answerFrames, c.answerBytes = c.answers[:0], 0, 0
	if err != nil {
		return err
	}
	t.stats.bytesOut.Add(uint64(raw))
	if typ == frameReadDataZ {
		t.stats.compressedSlices.Add(1)
		t.stats.compressedRawOut.Add(uint64(raw))
		t.stats.compressedOut.Add(uint64(len(block)))
	}
	return nil
}

// receiveDataZ reads one READ_DATA_Z payload, n bytes, decodes it and
// copies the slice's bytes into its memory zCopyChunk at a time, each chunk
// inside the slice's region guard, or drops it when the slice was
// canceled. The block is at most the slice's length and the slice at most
// MaxCompressedSlice (receive checks both), and decoding yields exactly the
// slice's length or fails: the owner cannot make us hold or write more.
func (ep *endpoint) receiveDataZ(s *transport.Slice, n int) error {
	bp := getZBuf(n)
	defer zPool.Put(bp)
	block := *bp
	got := copy(block, ep.inBuf[ep.inStart:ep.inEnd])
	ep.inStart += got
	if got < n {
		if err := ep.in.readFull(block[got:]); err != nil {
			return err
		}
	}
	ep.t.stats.compressedIn.Add(uint64(n))
	if !startReceiving(s) {
		return nil
	}
	dec, err := ep.t.decoder()
	if err != nil {
		s.Finish(fmt.Errorf("decode a compressed READ answer: %w", err)) // READ_DONE clears it
		return nil
	}
	dp := getZBuf(len(s.Local))
	defer zPool.Put(dp)
	if err := dec.Decode(*dp, block); err != nil {
		ep.t.stats.compressedMalformed.Add(1)
		return fmt.Errorf("%w: malformed compressed READ answer: %w", errBadFrame, err)
	}
	ep.t.stats.compressedRawIn.Add(uint64(len(*dp)))
	if _, refusal := guardedCopy(s.Local, *dp, s.LocalReg); refusal != nil {
		s.Finish(fmt.Errorf("local memory: %w", refusal)) // READ_DONE clears it
	}
	return nil
}

// compress encodes a WRITE slice's bytes into buf when the owner takes
// WRITE_Z, the slice is large enough and host memory, and the block comes
// out smaller. The bytes are read inside the slice's region guard, as a
// plain WRITE's writev reads them: our own unregistration or fence waits
// for it, and a region already gone leaves the slice to the plain path,
// which fails it.
func (ep *endpoint) compress(s *transport.Slice, buf []byte) ([]byte, bool) {
	if ep.enc == nil || s.Op != transport.Write || len(s.Local) < ep.t.opts.CompressMin || len(s.Local) > MaxCompressedSlice || s.LocalReg == nil ||
		strings.HasPrefix(s.LocalReg.Location, "cuda:") {
		return buf, false
	}
	if err := s.LocalReg.Enter(); err != nil {
		return buf, false
	}
	start := time.Now()
	block, err := ep.enc.Encode(buf, s.Local, 2)
	s.LocalReg.Leave()
	if err == nil {
		ep.auto.encoded(len(s.Local), len(block), time.Since(start))
	}
	if err != nil || len(block) >= len(s.Local) {
		return block, false
	}
	ep.t.stats.compressedSlices.Add(1)
	ep.t.stats.compressedRawOut.Add(uint64(len(s.Local)))
	ep.t.stats.compressedOut.Add(uint64(len(block)))
	return block, true
}

// autoCompress decides, on one path, whether compressing WRITEs pays. The
// kernel tells the link's pace: bytes acknowledged over the time the
// connection was busy sending (TCP_INFO's bytes_acked and busy_time, which
// leave out the time it waited for us). Our encoder's pace and ratio come
// from the blocks this path encoded, encoding time included (a starved CPU
// shows there). Sending compressed moves min(link/ratio, encoder) raw bytes
// per second against the link's pace sent plain: compression is on while
// the encoder outpaces the link by autoGain and blocks shrink below
// autoMaxRatio. With compression off, one group in autoProbeEvery is
// encoded anyway, to keep the encoder's figures current. Only the path's
// sender uses it.
type autoCompress struct {
	link      float64   // smoothed wire bytes per busy nanosecond; 0: not measured yet
	enc       float64   // smoothed raw bytes encoded per nanosecond; 0: not measured yet
	ratio     float64   // smoothed encoded/raw bytes
	lastInfo  time.Time // when TCP_INFO was last read
	acked     uint64    // its bytes_acked then
	busy      uint64    // its busy_time (microseconds) then
	lastProbe time.Time // when a group was last encoded
	on        bool      // the last decision
}

const (
	// autoGain is how much faster than the link the encoder must be: below
	// it the owner's decoding and the measurement's noise eat the gain.
	autoGain = 1.25
	// autoMaxRatio: blocks must shrink at least this much.
	autoMaxRatio = 0.85
	// autoProbeEvery is how often a group is encoded with compression off.
	autoProbeEvery = 5 * time.Second
	// autoInfoEvery is how often TCP_INFO is read.
	autoInfoEvery = 50 * time.Millisecond
)

// pick says whether the next group goes compressed.
func (a *autoCompress) pick(now time.Time, conn *net.TCPConn) bool {
	if now.Sub(a.lastInfo) >= autoInfoEvery {
		a.readLink(now, conn)
	}
	switch {
	case now.Sub(a.lastProbe) >= autoProbeEvery:
		// A probe of the encoder (the first decision is one). Not
		// repeated before it is due even when it encoded nothing (the
		// slice went plain, or was GPU memory): every slice would
		// otherwise be a probe.
		a.lastProbe = now
		return true
	case a.link == 0 || a.enc == 0:
		return false
	}
	// Compressed, raw bytes go at min(link/ratio, enc); plain, at link.
	a.on = a.ratio <= autoMaxRatio && a.ratio*autoGain < 1 && a.enc > autoGain*a.link
	return a.on
}

// readLink samples TCP_INFO and updates the link's pace.
func (a *autoCompress) readLink(now time.Time, conn *net.TCPConn) {
	a.lastInfo = now
	rc, err := conn.SyscallConn()
	if err != nil {
		return
	}
	var info *unix.TCPInfo
	_ = rc.Control(func(fd uintptr) { info, _ = unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO) })
	if info == nil {
		return
	}
	dAcked, dBusy := info.Bytes_acked-a.acked, info.Busy_time-a.busy
	fresh := a.acked == 0 && a.busy == 0
	a.acked, a.busy = info.Bytes_acked, info.Busy_time
	// Enough busy time to be a measurement: 20 ms.
	if fresh || info.Bytes_acked < dAcked || dBusy < 20_000 {
		return
	}
	pace := float64(dAcked) / (float64(dBusy) * 1000) // bytes per nanosecond
	a.link = smooth(a.link, pace, 0.3)
}

// encoded takes one encoded slice's figures.
func (a *autoCompress) encoded(raw, out int, d time.Duration) {
	if raw == 0 || d <= 0 {
		return
	}
	a.enc = smooth(a.enc, float64(raw)/float64(d.Nanoseconds()), 0.3)
	a.ratio = smooth(a.ratio, float64(out)/float64(raw), 0.3)
}

func smooth(old, v, w float64) float64 {
	if old == 0 {
		return v
	}
	return (1-w)*old + w*v
}
