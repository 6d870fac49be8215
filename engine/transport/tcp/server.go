package tcp

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/kvferry/kvferry/engine/transport"
)

// ownerConn is the owner's side of one connection.
type ownerConn struct {
	t    *Transport
	conn *net.TCPConn
	raw  *rawConn
	// in holds frame headers read ahead: after a READ frame (no payload)
	// the next ones are likely READs too, so several are read at once;
	// after a WRITE only one header is read, in the payload's last syscall.
	// Payload bytes that land here at a switch from READs to a WRITE are
	// copied to their place (at most len(in) bytes).
	in             [16 * HeaderSize]byte
	inStart, inEnd int
	lastWrite      bool

	// Reused by serveReads.
	gatherHdrs   []header
	gatherIov    [][]byte
	gatherParts  []gatherPart
	gatherFrames [2 * maxGatheredReads * HeaderSize]byte
	// answers are WRITE_ACKs not yet written: they go out together when
	// the socket has nothing more to read, or once enough piled up.
	answers      []byte
	answerBytes  uint64 // payload bytes the pending answers acknowledge
	answerFrames int
}

// Answers are held back at most this long, in frames and in payload bytes
// acknowledged, while more requests keep arriving.
const (
	maxHeldAnswers     = 32
	maxHeldAnswerBytes = 1 << 20
)

// serve runs one owner-side connection: handshake, then frames in order until
// the peer closes or breaks the protocol. Owner memory is touched only inside
// Target.Enter/Leave around non-blocking syscalls.
func (t *Transport) serve(conn *net.TCPConn) {
	defer t.wg.Done()
	defer conn.Close()
	rc, err := conn.SyscallConn()
	if err != nil {
		return
	}
	c := &ownerConn{t: t, conn: conn, raw: newRawConn(rc)}
	var h header
	_ = conn.SetReadDeadline(time.Now().Add(t.opts.HandshakeTimeout))
	if err := c.raw.readFull(c.in[:HeaderSize]); err != nil {
		t.protoErr(conn, "handshake", err)
		return
	}
	if err := h.decode(c.in[:HeaderSize]); err != nil || h.typ != frameHello {
		t.protoErr(conn, "handshake", fmt.Errorf("%w: want HELLO, got type %d (%v)", errBadFrame, h.typ, err))
		return
	}
	name := make([]byte, h.length)
	if err := c.raw.readFull(name); err != nil {
		t.protoErr(conn, "handshake", err)
		return
	}
	_ = conn.SetReadDeadline(time.Time{})
	initiator := string(name)
	c.answer(&header{typ: frameHelloAck, seq: h.seq}, 0)
	if err := c.flush(); err != nil {
		return
	}
	var a transport.Access
	for {
		if err := c.readHeader(&h); err != nil {
			t.connEnded(conn, initiator, err)
			return
		}
		a = transport.Access{
			Initiator: initiator, RequestID: h.requestID, Generation: h.generation,
			GrantID: h.grantID, Key: h.key, Addr: h.addr, Length: uint64(h.length),
		}
		switch h.typ {
		case frameWrite:
			a.Op = transport.Write
			err = c.serveWrite(&h, &a)
		case frameRead:
			a.Op = transport.Read
			if c.nextIsRead() {
				err = c.serveReads(&h, initiator)
			} else {
				err = c.serveRead(&h, &a)
			}
		default:
			err = fmt.Errorf("%w: unexpected type %d from an initiator", errBadFrame, h.typ)
		}
		if err != nil {
			t.connEnded(conn, initiator, err)
			return
		}
	}
}

// readHeader completes and decodes the next frame header. Before waiting for
// the socket it writes the answers held back, so an initiator never waits on
// an answer while we wait on it.
func (c *ownerConn) readHeader(h *header) error {
	for c.inEnd-c.inStart < HeaderSize {
		if c.inStart > 0 {
			c.inEnd = copy(c.in[:], c.in[c.inStart:c.inEnd])
			c.inStart = 0
		}
		limit := len(c.in)
		if c.lastWrite {
			limit = HeaderSize
		}
		_, n, _, err := c.raw.readv(nil, c.in[c.inEnd:limit], nil, len(c.answers) == 0)
		if err != nil {
			return err
		}
		if n == 0 {
			if err := c.flush(); err != nil {
				return err
			}
			continue
		}
		c.inEnd += n
	}
	hb := c.in[c.inStart : c.inStart+HeaderSize]
	c.inStart += HeaderSize
	return h.decode(hb)
}

// takeBuffered hands over up to n payload bytes read ahead with headers.
func (c *ownerConn) takeBuffered(n int) []byte {
	k := min(n, c.inEnd-c.inStart)
	b := c.in[c.inStart : c.inStart+k]
	c.inStart += k
	return b
}

// answer queues an answer frame.
func (c *ownerConn) answer(h *header, payload uint64) {
	var hb [HeaderSize]byte
	h.encode(hb[:])
	c.answers = append(c.answers, hb[:]...)
	c.answerFrames++
	c.answerBytes += payload
}

// flush writes the answers held back, bounded by the I/O timeout.
func (c *ownerConn) flush() error {
	if len(c.answers) == 0 {
		return nil
	}
	_ = c.conn.SetWriteDeadline(time.Now().Add(c.t.opts.IOTimeout))
	_, _, err := c.raw.writeGuarded(c.answers, nil, nil)
	c.answers, c.answerFrames, c.answerBytes = c.answers[:0], 0, 0
	return err
}

// flushIfFull writes the held answers once enough piled up.
func (c *ownerConn) flushIfFull() error {
	if c.answerFrames >= maxHeldAnswers || c.answerBytes >= maxHeldAnswerBytes {
		return c.flush()
	}
	return nil
}

// serveWrite applies one WRITE frame, or reads and drops its payload when
// the access is refused, then answers WRITE_ACK with the bytes applied.
func (c *ownerConn) serveWrite(h *header, a *transport.Access) error {
	t := c.t
	ack := header{typ: frameWriteAck, seq: h.seq, requestID: h.requestID, generation: h.generation}
	c.lastWrite = true
	tgt, err := t.owner.Admit(*a)
	if err != nil {
		ack.status = statusOf(err)
		t.stats.refused.Add(1)
		ahead := c.takeBuffered(int(h.length))
		if err := c.raw.discard(int(h.length) - len(ahead)); err != nil {
			return err
		}
		c.answer(&ack, 0)
		return c.flushIfFull()
	}
	if tgt.Stage != nil {
		defer tgt.Stage.Release()
	}
	if t.opts.ApplyDelay > 0 {
		time.Sleep(t.opts.ApplyDelay)
	}
	landed := 0
	var refusal error
	if ahead := c.takeBuffered(len(tgt.Mem)); len(ahead) > 0 {
		if refusal = tgt.Guard.Enter(); refusal == nil {
			landed = copy(tgt.Mem, ahead)
			tgt.Guard.Leave()
		} else if err := c.raw.discard(len(tgt.Mem) - len(ahead)); err != nil {
			return err
		}
	}
	if refusal == nil && landed < len(tgt.Mem) {
		// The read-ahead buffer is empty now: the next header may come in
		// the payload's last syscall.
		var n, tail int
		n, tail, refusal, err = c.raw.readGuarded(tgt.Mem[landed:], tgt.Guard, c.in[:HeaderSize])
		if err != nil {
			return err
		}
		landed += n
		c.inStart, c.inEnd = 0, tail
	}
	if tgt.Stage != nil {
		// The payload is in host staging: it reaches owner (GPU) memory
		// only whole and only inside the guard, so an abort either
		// finds the copy done or stops it before it starts.
		applied := 0
		if refusal == nil && landed == len(tgt.Mem) {
			if refusal = transport.StageCopy(tgt.Guard, tgt.Stage.Flush); refusal == nil {
				applied = landed
			}
		}
		landed = applied
	}
	t.stats.bytesIn.Add(uint64(landed))
	ack.done = uint64(landed)
	if refusal != nil {
		ack.status = statusOf(refusal)
		t.stats.refused.Add(1)
		t.stats.refusedInFlight.Add(1)
	}
	c.answer(&ack, uint64(landed))
	return c.flushIfFull()
}

// nextIsRead reports whether a whole READ header is already read ahead.
func (c *ownerConn) nextIsRead() bool {
	return c.inEnd-c.inStart >= HeaderSize && c.in[c.inStart+3] == frameRead
}

// maxGatheredReads bounds the READ answers written in one writev.
const maxGatheredReads = 16

// serveReads answers h and the READs read ahead behind it in one gathered
// write: per READ, READ_DATA, its payload and READ_DONE, or READ_DONE alone
// for a refusal at admission. Around each syscall the guards of the ranges
// it reads are entered; a refusal that strikes mid-write (memory
// unregistered, request aborted) stops that READ's bytes: zeros stand in
// for the rest of its payload and its READ_DONE says refused, with the
// bytes sent from memory. The frames stay whole, so the connection and the
// other READs on it go on undisturbed.
func (c *ownerConn) serveReads(first *header, initiator string) error {
	t := c.t
	c.lastWrite = false
	hs := c.gatherHdrs[:0]
	hs = append(hs, *first)
	var h header
	total := int(first.length)
	for len(hs) < maxGatheredReads && total < maxGatherBytes && c.nextIsRead() {
		if err := c.readHeader(&h); err != nil {
			return err
		}
		hs = append(hs, h)
		total += int(h.length)
	}
	iov := append(c.gatherIov[:0], c.answers)
	parts := c.gatherParts[:0]
	var stages []transport.Stage
	defer func() {
		for _, st := range stages {
			st.Release()
		}
	}()
	frames := c.gatherFrames[:0] // never grows: 2 headers per READ at most
	for i := range hs {
		h := &hs[i]
		a := transport.Access{Op: transport.Read, Initiator: initiator, RequestID: h.requestID, Generation: h.generation,
			GrantID: h.grantID, Key: h.key, Addr: h.addr, Length: uint64(h.length)}
		done := header{typ: frameReadDone, seq: h.seq, requestID: h.requestID, generation: h.generation}
		tgt, err := t.owner.Admit(a)
		if err == nil {
			if tgt.Stage != nil {
				stages = append(stages, tgt.Stage)
			}
			err = enterAndFill(tgt)
		}
		if err != nil {
			done.status = statusOf(err)
			t.stats.refused.Add(1)
			frames = append(frames, frameBytes(&done)...)
			iov = append(iov, frames[len(frames)-HeaderSize:])
			continue
		}
		data := header{typ: frameReadData, seq: h.seq, requestID: h.requestID, generation: h.generation, length: h.length}
		done.done = uint64(len(tgt.Mem))
		frames = append(frames, frameBytes(&data)...)
		iov = append(iov, frames[len(frames)-HeaderSize:])
		parts = append(parts, gatherPart{g: tgt.Guard, iov: len(iov)})
		iov = append(iov, tgt.Mem)
		frames = append(frames, frameBytes(&done)...)
		iov = append(iov, frames[len(frames)-HeaderSize:])
	}
	c.gatherHdrs = hs[:0]
	_ = c.conn.SetWriteDeadline(time.Now().Add(t.opts.IOTimeout))
	err := c.raw.writevParts(iov, parts, func(p *gatherPart) {
		// The READ_DONE right after the payload has not gone out yet.
		rewriteDone(iov[p.iov+1], statusOf(p.refusal), uint64(p.sent))
		t.stats.refused.Add(1)
		t.stats.refusedInFlight.Add(1)
	})
	c.answers, c.answerFrames, c.answerBytes = c.answers[:0], 0, 0
	sent := 0
	for i := range parts {
		sent += parts[i].sent
	}
	t.stats.bytesOut.Add(uint64(sent))
	clear(parts) // drop the guards
	clear(iov)   // and the views of owner memory
	c.gatherParts, c.gatherIov = parts[:0], iov[:0]
	return err
}

// rewriteDone sets the status and the bytes done of an encoded READ_DONE.
func rewriteDone(b []byte, status uint32, done uint64) {
	binary.LittleEndian.PutUint32(b[4:], status)
	binary.LittleEndian.PutUint64(b[56:], done)
}

// enterAndFill checks a READ target's guard and, for staged (GPU) memory,
// copies it into its staging buffer inside the guard.
func enterAndFill(tgt transport.Target) error {
	if tgt.Stage != nil {
		return transport.StageCopy(tgt.Guard, tgt.Stage.Fill)
	}
	if err := tgt.Guard.Enter(); err != nil {
		return err
	}
	tgt.Guard.Leave()
	return nil
}

// frameBytes encodes h.
func frameBytes(h *header) []byte {
	var b [HeaderSize]byte
	h.encode(b[:])
	return b[:]
}

// serveRead answers one READ frame with READ_DATA and READ_DONE, or with
// READ_DONE alone when the access is refused before any byte is sent. Held
// answers go out in the same write as READ_DATA's header.
func (c *ownerConn) serveRead(h *header, a *transport.Access) error {
	t := c.t
	c.lastWrite = false
	done := header{typ: frameReadDone, seq: h.seq, requestID: h.requestID, generation: h.generation}
	tgt, err := t.owner.Admit(*a)
	if err != nil {
		done.status = statusOf(err)
		t.stats.refused.Add(1)
		c.answer(&done, 0)
		return c.flushIfFull()
	}
	if tgt.Stage != nil {
		defer tgt.Stage.Release()
	}
	// A refusal already in force costs a lone READ_DONE, not a frame of
	// zeros: look before committing READ_DATA (the guard is checked again
	// before each chunk).
	if err := enterAndFill(tgt); err != nil {
		done.status = statusOf(err)
		t.stats.refused.Add(1)
		c.answer(&done, 0)
		return c.flushIfFull()
	}
	c.answer(&header{typ: frameReadData, seq: h.seq, requestID: h.requestID, generation: h.generation, length: h.length}, 0)
	// READ_DONE goes out in the payload's last syscall, so the initiator
	// gets it with the data; after a refusal a READ_DONE saying so replaces
	// it.
	done.done = uint64(len(tgt.Mem))
	var tb [HeaderSize]byte
	done.encode(tb[:])
	_ = c.conn.SetWriteDeadline(time.Now().Add(t.opts.IOTimeout))
	sent, refusal, err := c.raw.writeGuarded(c.answers, tgt.Mem, tgt.Guard, tb[:]...)
	c.answers, c.answerFrames, c.answerBytes = c.answers[:0], 0, 0
	if err != nil {
		return err
	}
	t.stats.bytesOut.Add(uint64(sent))
	if refusal == nil {
		return nil
	}
	done.done = uint64(sent)
	done.status = statusOf(refusal)
	t.stats.refused.Add(1)
	t.stats.refusedInFlight.Add(1)
	c.answer(&done, uint64(sent))
	return c.flushIfFull()
}

// protoErr logs and counts a connection that broke the protocol; the caller
// then closes it, since a stream out of step cannot be resynchronised.
func (t *Transport) protoErr(conn net.Conn, peer string, err error) {
	if t.closing.Load() || isClosed(err) || errors.Is(err, net.ErrClosed) {
		return
	}
	t.stats.protocolErrors.Add(1)
	t.opts.Logger.Warn("tcp: dropping connection", "peer", peer, "remote", conn.RemoteAddr().String(), "err", err)
}

// connEnded reports why an owner-side connection ends: a malformed frame is
// a protocol error (logged and counted); a closed peer, a write deadline (an
// initiator that stopped reading) or a dead socket is not.
func (t *Transport) connEnded(conn net.Conn, peer string, err error) {
	if errors.Is(err, errBadFrame) {
		t.protoErr(conn, peer, err)
		return
	}
	if !isClosed(err) && !t.closing.Load() {
		t.opts.Logger.Debug("tcp: owner connection ended", "peer", peer, "err", err)
	}
}

// connSet tracks live connections so Close can cut them.
type connSet struct {
	mu    sync.Mutex
	conns map[net.Conn]struct{}
}

func (s *connSet) add(c net.Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.conns == nil {
		return false
	}
	s.conns[c] = struct{}{}
	return true
}

func (s *connSet) remove(c net.Conn) {
	s.mu.Lock()
	delete(s.conns, c)
	s.mu.Unlock()
}

// closeAll closes every connection and refuses new ones.
func (s *connSet) closeAll() {
	s.mu.Lock()
	conns := s.conns
	s.conns = nil
	s.mu.Unlock()
	for c := range conns {
		_ = c.Close()
	}
}
