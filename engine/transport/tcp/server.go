package tcp

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
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

	remote   string // the peer's address, for logs
	ip       string // its IP address: the key of its rate-limited warnings
	goAwayOK bool   // the initiator's HELLO said it understands GOAWAY
	compress bool   // the initiator's HELLO said it may send WRITE_Z (and we said we take them)
	readZ    bool   // we compress READ answers and the initiator's HELLO said it takes READ_DATA_Z
	// auto decides, READ by READ, whether compressing the answer pays on
	// this connection (Compression "auto"); its pace is ours sending.
	auto    autoCompress
	zPicked bool   // the READ read ahead next was picked to be answered compressed
	lastSeq uint64 // seq of the last request header read

	// Read deadlines, armed by armRead only when a read is about to wait.
	frameLen   int       // payload bytes of the frame being read; 0 while reading a header
	frameStart time.Time // when the frame being read was first waited for; zero if not yet
	idle       bool      // the deadline armed last is the idle one
	deadline   time.Time // the read deadline armed last; zero if none
}

// Errors that end an owner connection for its reads' deadlines.
var (
	errIdle      = errors.New("no request within the idle timeout")
	errSlowFrame = fmt.Errorf("%w: frame too slow", transport.ErrConnection)
)

// testHookGoAway, set by tests only, runs when an owner has found a
// connection idle, before it sends GOAWAY and closes it: a test posts a
// request then, as an initiator might at that very moment.
var testHookGoAway atomic.Pointer[func()]

// goAwayLinger bounds how long an owner reads and drops an initiator's
// bytes after its GOAWAY, waiting for the initiator to close its side.
const goAwayLinger = 2 * time.Second

// frameTime is how long a frame of length payload bytes may take to arrive.
func (t *Transport) frameTime(length int) time.Duration {
	return t.opts.FrameTimeout + time.Duration(int64(HeaderSize+length)*int64(time.Second)/int64(t.opts.MinRate))
}

// armRead sets the read deadline before a read waits for the socket: the
// idle timeout when no byte of the next request came yet, otherwise the
// frame's own deadline, counted from the first wait inside the frame. It is
// set here rather than per frame, so a connection whose bytes are always
// there already makes no call for it.
func (c *ownerConn) armRead() {
	now := time.Now()
	if c.frameLen == 0 && c.inEnd == c.inStart {
		c.idle, c.deadline = true, now.Add(c.t.opts.IdleTimeout)
	} else {
		if c.frameStart.IsZero() {
			c.frameStart = now
		}
		c.idle, c.deadline = false, c.frameStart.Add(c.t.frameTime(c.frameLen))
	}
	_ = c.conn.SetReadDeadline(c.deadline)
}

// startFrame begins the wait for a frame of length payload bytes (0: a
// header). A deadline armed for an earlier wait is cleared: Go checks it
// before every read, even one that need not wait, so it could strike after
// the owner took long to admit or apply a request; and the idle one must
// never strike while a request is in progress, since GOAWAY says every
// request read was answered.
func (c *ownerConn) startFrame(length int) {
	c.frameLen, c.frameStart, c.idle = length, time.Time{}, false
	if !c.deadline.IsZero() {
		c.deadline = time.Time{}
		_ = c.conn.SetReadDeadline(c.deadline)
	}
}

// readErr names a read's deadline error after the deadline that fired.
func (c *ownerConn) readErr(err error) error {
	if err == nil || !errors.Is(err, os.ErrDeadlineExceeded) {
		return err
	}
	if c.idle {
		return fmt.Errorf("%w: %w", errIdle, err)
	}
	return fmt.Errorf("%w: a frame of %d payload bytes not whole within %v: %w", errSlowFrame, c.frameLen, c.t.frameTime(c.frameLen), err)
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
func (t *Transport) serve(conn *net.TCPConn, peer netip.Addr) {
	defer t.wg.Done()
	defer conn.Close()
	rc, err := conn.SyscallConn()
	if err != nil {
		return
	}
	c := &ownerConn{t: t, conn: conn, raw: newRawConn(rc), remote: conn.RemoteAddr().String(), ip: peer.String()}
	var h header
	_ = conn.SetReadDeadline(time.Now().Add(t.opts.HandshakeTimeout))
	if err := c.raw.readFull(c.in[:HeaderSize]); err != nil {
		t.handshakeErr(c, err)
		return
	}
	if err := h.decode(c.in[:HeaderSize]); err != nil || h.typ != frameHello {
		t.protoErr(c, "handshake", fmt.Errorf("%w: want HELLO, got type %d (%v)", errBadFrame, h.typ, err))
		return
	}
	var initiator string
	if t.opts.Auth != nil {
		name, ac, err := t.ownerAuth(c, &h)
		if err != nil {
			return
		}
		defer t.releaseAuthed(ac)
		initiator = name
	} else {
		name := make([]byte, h.length)
		if err := c.raw.readFull(name); err != nil {
			t.handshakeErr(c, err)
			return
		}
		initiator = string(name)
	}
	_ = conn.SetReadDeadline(time.Time{})
	c.goAwayOK = h.done&helloGoAway != 0
	c.compress = h.done&helloCompress != 0
	c.readZ = h.done&helloReadZ != 0 && t.enc != nil
	ackHello := header{typ: frameHelloAck, seq: h.seq}
	if c.compress {
		ackHello.done |= helloCompress
	}
	if c.readZ {
		ackHello.done |= helloReadZ
	}
	c.answer(&ackHello, 0)
	if err := c.flush(); err != nil {
		return
	}
	c.raw.beforeWait = c.armRead
	var a transport.Access
	for {
		c.startFrame(0)
		if err := c.readHeader(&h); err != nil {
			t.connEnded(c, initiator, err)
			return
		}
		a = transport.Access{
			Initiator: initiator, RequestID: h.requestID, Generation: h.generation,
			GrantID: h.grantID, Epoch: h.done, Key: h.key, Addr: h.addr, Length: uint64(h.length),
		}
		switch h.typ {
		case frameWrite:
			a.Op = transport.Write
			err = c.serveWrite(&h, &a)
		case frameWriteZ:
			a.Op = transport.Write
			err = c.serveWriteZ(&h, &a)
		case frameRead:
			a.Op = transport.Read
			if c.compressRead(int(h.length)) {
				err = c.serveReadZ(&h, &a)
			} else if c.nextIsPlainRead() {
				err = c.serveReads(&h, initiator)
			} else {
				err = c.serveRead(&h, &a)
			}
		default:
			err = fmt.Errorf("%w: unexpected type %d from an initiator", errBadFrame, h.typ)
		}
		if err != nil {
			t.connEnded(c, initiator, err)
			return
		}
	}
}

// goAway closes an idle connection: it tells an initiator that understands
// it which requests were read (all of them answered), so the initiator
// posts the rest again on a new connection instead of failing them, and
// then reads and drops whatever the initiator sent meanwhile until it
// closes its side. Closing with unread bytes would reset the connection,
// and a reset can destroy the GOAWAY before the initiator reads it.
func (c *ownerConn) goAway() {
	c.t.stats.idleClosed.Add(1)
	if hook := testHookGoAway.Load(); hook != nil {
		(*hook)()
	}
	if !c.goAwayOK {
		return
	}
	c.answer(&header{typ: frameGoAway, seq: c.lastSeq}, 0)
	if err := c.flush(); err != nil {
		return
	}
	_ = c.conn.CloseWrite()
	c.raw.beforeWait = nil
	_ = c.conn.SetReadDeadline(time.Now().Add(goAwayLinger))
	for c.raw.discard(scratchLen) == nil {
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
			return c.readErr(err)
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
	if err := h.decode(hb); err != nil {
		return err
	}
	c.lastSeq = h.seq
	return nil
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
	_ = c.conn.SetWriteDeadline(c.t.writeDeadline(len(c.answers)))
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
		c.startFrame(int(h.length)) // the payload's deadline runs from here
		ack.status = statusOf(err)
		t.stats.refused.Add(1)
		ahead := c.takeBuffered(int(h.length))
		if err := c.raw.discard(int(h.length) - len(ahead)); err != nil {
			return c.readErr(err)
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
	c.startFrame(int(h.length)) // the payload's deadline runs from here
	landed := 0
	var refusal error
	if ahead := c.takeBuffered(len(tgt.Mem)); len(ahead) > 0 {
		if refusal = tgt.Guard.Enter(); refusal == nil {
			landed = copy(tgt.Mem, ahead)
			tgt.Guard.Leave()
		} else if err := c.raw.discard(len(tgt.Mem) - len(ahead)); err != nil {
			return c.readErr(err)
		}
	}
	if refusal == nil && landed < len(tgt.Mem) {
		// The read-ahead buffer is empty now: the next header may come in
		// the payload's last syscall.
		var n, tail int
		n, tail, refusal, err = c.raw.readGuarded(tgt.Mem[landed:], tgt.Guard, c.in[:HeaderSize])
		if err != nil {
			return c.readErr(err)
		}
		landed += n
		c.inStart, c.inEnd = 0, tail
	}
	return c.finishWrite(&ack, tgt, landed, refusal)
}

// finishWrite completes a WRITE whose payload reached the target (landed
// bytes of it, up to a refusal): staged (GPU) memory takes it only whole
// and only inside the guard, so an abort either finds the copy done or
// stops it before it starts. It answers WRITE_ACK with the bytes applied.
func (c *ownerConn) finishWrite(ack *header, tgt transport.Target, landed int, refusal error) error {
	t := c.t
	if tgt.Stage != nil {
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
	c.answer(ack, uint64(landed))
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
	for len(hs) < maxGatheredReads && total < maxGatherBytes && c.nextIsPlainRead() {
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
			GrantID: h.grantID, Epoch: h.done, Key: h.key, Addr: h.addr, Length: uint64(h.length)}
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
	n := 0
	for _, v := range iov {
		n += len(v)
	}
	_ = c.conn.SetWriteDeadline(t.writeDeadline(n))
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
	return c.sendRead(h, tgt)
}

// sendRead answers an admitted READ from its target's memory.
func (c *ownerConn) sendRead(h *header, tgt transport.Target) error {
	t := c.t
	done := header{typ: frameReadDone, seq: h.seq, requestID: h.requestID, generation: h.generation}
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
	_ = c.conn.SetWriteDeadline(t.writeDeadline(len(c.answers) + len(tgt.Mem) + len(tb)))
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
// then closes it, since a stream out of step cannot be resynchronised. The
// warning is the peer's doing, so it is rate-limited per address.
func (t *Transport) protoErr(c *ownerConn, peer string, err error) {
	if t.closing.Load() || isClosed(err) || errors.Is(err, net.ErrClosed) {
		return
	}
	t.stats.protocolErrors.Add(1)
	t.warn.Warn("protocol "+c.ip, "tcp: dropping connection", "peer", peer, "remote", c.remote, "err", err)
}

// handshakeErr reports a HELLO that did not arrive whole: in time (a frame
// timeout) or at all.
func (t *Transport) handshakeErr(c *ownerConn, err error) {
	if errors.Is(err, os.ErrDeadlineExceeded) && !t.closing.Load() {
		t.stats.frameTimeouts.Add(1)
		t.warn.Warn("slow "+c.ip, "tcp: dropping a connection whose HELLO did not arrive in time",
			"remote", c.remote, "timeout", t.opts.HandshakeTimeout)
		return
	}
	t.protoErr(c, "handshake", err)
}

// connEnded reports why an owner-side connection ends: a malformed frame is
// a protocol error (logged and counted); a frame too slow is counted and
// logged; an idle connection is told so (GOAWAY) and counted; a closed
// peer, a write deadline (an initiator that stopped reading) or a dead
// socket is none of these.
func (t *Transport) connEnded(c *ownerConn, peer string, err error) {
	switch {
	case errors.Is(err, errBadFrame):
		t.protoErr(c, peer, err)
	case t.closing.Load():
	case errors.Is(err, errIdle):
		c.goAway()
		t.opts.Logger.Debug("tcp: closed an idle connection", "peer", peer, "remote", c.remote, "goaway", c.goAwayOK)
	case errors.Is(err, errSlowFrame):
		t.stats.frameTimeouts.Add(1)
		t.warn.Warn("slow "+c.ip, "tcp: dropping a connection whose frame came too slowly",
			"peer", peer, "remote", c.remote, "err", err)
	case !isClosed(err):
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
