package tcp

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvferry/kvferry/engine/auth"
	"github.com/kvferry/kvferry/engine/kvcodec"
	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
)

// endpoint is the initiator's side of one connection. A sender goroutine
// writes frames in posting order; a receiver goroutine reads the owner's
// answers, which come in the same order, and ends the slices.
type endpoint struct {
	t    *Transport
	conn *net.TCPConn
	out  *rawConn // used by the sender only
	in   *rawConn // used by the receiver only
	// enc compresses WRITEs: set when we compress and the owner said in
	// HELLO_ACK that it takes WRITE_Z.
	enc *kvcodec.Encoder
	// auto decides, group by group, whether compressing pays on this path
	// (Compression "auto"); used by the sender only.
	auto autoCompress

	mu      sync.Mutex
	queue   []*transport.Slice
	closed  bool // no more posts; set once the goroutines ended
	wake    chan struct{}
	pending sync.Map     // seq -> *transport.Slice; ends in order, but a map keeps lookups honest
	seq     uint64       // sender only
	reads   atomic.Int32 // READ slices sent and not yet READ_DONE
	// ownerKey is the key the owner proved in the handshake (with
	// Options.Auth).
	ownerKey auth.Key
	guard    [1]transport.Guard // the sender's guard list: one region per gathered write

	// The receiver's buffer of answer headers.
	inBuf          [4096]byte
	inStart, inEnd int
	dataSeq        uint64 // the slice whose READ_DATA came last

	dead       atomic.Bool
	goneAway   bool       // the owner closed the path as idle (GOAWAY): no slice still pending was read; set before fail
	deadlineMu sync.Mutex // orders armWrite against fail
	failOnce   sync.Once
	reason     error
	wg         sync.WaitGroup
	finished   chan struct{}
}

func newEndpoint(t *Transport, conn *net.TCPConn, addr, self string, deadline time.Time) (*endpoint, error) {
	rc, err := conn.SyscallConn()
	if err != nil {
		return nil, err
	}
	ep := &endpoint{
		t: t, conn: conn, out: newRawConn(rc), in: newRawConn(rc),
		wake: make(chan struct{}, 1), finished: make(chan struct{}),
	}
	var hb [HeaderSize]byte
	_ = conn.SetDeadline(deadline)
	if t.opts.Auth != nil {
		if ep.ownerKey, err = ep.initiatorAuth(addr, self); err != nil {
			return nil, err
		}
	} else {
		hello := header{typ: frameHello, length: uint32(len(self)), done: helloGoAway | t.helloCodecs()}
		hello.encode(hb[:])
		if _, _, err := ep.out.writeGuarded(hb[:], []byte(self), nil); err != nil {
			return nil, err
		}
	}
	if err := ep.in.readFull(hb[:]); err != nil {
		return nil, err
	}
	var h header
	if err := h.decode(hb[:]); err != nil {
		return nil, err
	}
	if h.typ == frameHelloAck && h.status == statusUnauthenticated {
		return nil, fmt.Errorf("%w: the owner refused our key", ErrUnauthenticated)
	}
	if h.typ != frameHelloAck || h.status != statusOK {
		return nil, fmt.Errorf("%w: HELLO answered with type %d status %d", errBadFrame, h.typ, h.status)
	}
	if h.done&helloCompress != 0 && t.enc != nil {
		ep.enc = t.enc
	}
	_ = conn.SetDeadline(time.Time{})
	ep.wg.Add(2)
	go ep.send()
	go ep.receive()
	go func() {
		ep.wg.Wait()
		ep.sweep()
	}()
	return ep, nil
}

// Post queues slices; a dead endpoint fails them at once.
func (ep *endpoint) Post(slices []*transport.Slice) {
	ep.mu.Lock()
	if ep.closed {
		ep.mu.Unlock()
		for _, s := range slices {
			s.Finish(ep.failure())
		}
		return
	}
	ep.queue = append(ep.queue, slices...)
	ep.mu.Unlock()
	select {
	case ep.wake <- struct{}{}:
	default:
	}
}

// failure is the error of slices the dead path ends. After a GOAWAY none of
// them was read by the owner, which the error says (transport.ErrUnsent),
// so the engine posts them again without counting a retry.
func (ep *endpoint) failure() error {
	if ep.goneAway {
		return fmt.Errorf("tcp %s: %w: %w: %w", ep.conn.RemoteAddr(), transport.ErrConnection, transport.ErrUnsent, ep.reason)
	}
	return fmt.Errorf("tcp %s: %w: %w", ep.conn.RemoteAddr(), transport.ErrConnection, ep.reason)
}

// Limits of one gathered write: slices whose frames go out in one writev.
const (
	maxGather      = 32
	maxGatherBytes = 4 << 20
)

// send writes queued slices in order, gathering runs of them into one
// writev: frames of READs, and WRITEs whose payloads lie in the same
// registered region (one guard covers the syscall).
func (ep *endpoint) send() {
	defer ep.wg.Done()
	var batch []*transport.Slice
	var hdrs [maxGather][HeaderSize]byte
	iov := make([][]byte, 0, 2*maxGather)
	user := make([]bool, 0, 2*maxGather) // user[i]: iov[i] is a payload in registered memory
	group := make([]*transport.Slice, 0, maxGather)
	var blocks [maxGather][]byte // compressed payloads of the group being written
	for !ep.dead.Load() {
		ep.mu.Lock()
		batch, ep.queue = ep.queue, batch[:0]
		ep.mu.Unlock()
		if len(batch) == 0 {
			<-ep.wake
			continue
		}
		for i := 0; i < len(batch); {
			iov, user, group = iov[:0], user[:0], group[:0]
			var reg *memory.Region
			total := 0
			// Compress this group? Always with a codec chosen; with auto,
			// as the time per byte each way measured so far says.
			useZ := ep.enc != nil && (!ep.t.opts.CompressAuto || ep.auto.pick(time.Now(), ep.conn))
			for ; i < len(batch) && len(group) < maxGather && total < maxGatherBytes; i++ {
				s := batch[i]
				if s.Op == transport.Write && reg != nil && s.LocalReg != reg {
					break
				}
				if !s.Advance(transport.StateQueued, transport.StateActive) {
					continue // canceled while queued
				}
				ep.seq++
				h := header{
					typ: frameRead, seq: ep.seq, requestID: s.RequestID, generation: s.Generation,
					length: uint32(len(s.Local)), key: s.Key, addr: s.Remote, grantID: s.GrantID, done: s.Epoch,
				}
				hb := hdrs[len(group)][:]
				ep.pending.Store(ep.seq, s)
				var block []byte
				z := false
				if useZ {
					block, z = ep.compress(s, blocks[len(group)][:0])
					blocks[len(group)] = block // its room serves the next group too, sent or not
				}
				if z {
					// The block is ours, not registered memory: no guard
					// is needed while it is written.
					h.typ, h.length = frameWriteZ, uint32(len(block))
					h.encode(hb)
					iov, user = append(iov, hb, block), append(user, false, false)
					total += len(block)
				} else if s.Op == transport.Write {
					h.typ = frameWrite
					h.encode(hb)
					reg = s.LocalReg
					iov, user = append(iov, hb, s.Local), append(user, false, true)
					total += len(s.Local)
				} else {
					h.encode(hb)
					ep.reads.Add(1) // before the frame leaves: see nextHeader
					iov, user = append(iov, hb), append(user, false)
				}
				group = append(group, s)
			}
			if len(group) == 0 {
				continue
			}
			if !ep.armWrite(total + len(group)*HeaderSize) {
				ep.mu.Lock()
				ep.queue = append(ep.queue, batch[i:]...)
				ep.mu.Unlock()
				break
			}
			guards := ep.guard[:0]
			if reg != nil {
				guards = append(guards, reg)
			}
			if err := ep.out.writevGuards(iov, user, guards); err != nil {
				// A torn frame cannot be resumed: the path dies, and the
				// slices left go back to the queue for the sweep to fail.
				// (A refusal here means our own memory was unregistered.)
				ep.fail(err)
				ep.mu.Lock()
				ep.queue = append(ep.queue, batch[i:]...)
				ep.mu.Unlock()
				break
			}
			for _, s := range group {
				s.Advance(transport.StateActive, transport.StateSent)
			}
		}
		clear(batch)
	}
}

// receive reads answers and ends slices.
func (ep *endpoint) receive() {
	defer ep.wg.Done()
	var h header
	for {
		hb, err := ep.nextHeader()
		if err != nil {
			ep.fail(err)
			return
		}
		if err := h.decode(hb); err != nil {
			ep.fail(err)
			return
		}
		if h.typ == frameGoAway {
			ep.goAway(h.seq)
			return
		}
		v, ok := ep.pending.Load(h.seq)
		if !ok {
			ep.fail(fmt.Errorf("%w: answer for unknown slice %d", errBadFrame, h.seq))
			return
		}
		s := v.(*transport.Slice)
		if want := s.Op == transport.Write; want != (h.typ == frameWriteAck) {
			ep.fail(fmt.Errorf("%w: answer type %d for a %s slice", errBadFrame, h.typ, s.Op))
			return
		}
		switch h.typ {
		case frameWriteAck:
			ep.pending.Delete(h.seq)
			s.Finish(sliceErr(&h, len(s.Local)))
		case frameReadData:
			if int(h.length) != len(s.Local) {
				ep.fail(fmt.Errorf("%w: READ_DATA of %d bytes for a %d-byte slice", errBadFrame, h.length, len(s.Local)))
				return
			}
			if err := ep.receiveData(s); err != nil {
				ep.fail(err)
				return
			}
			ep.dataSeq = h.seq
		case frameReadDataZ:
			if len(s.Local) > MaxCompressedSlice || int(h.length) > len(s.Local) {
				ep.t.stats.compressedMalformed.Add(1)
				ep.fail(fmt.Errorf("%w: READ_DATA_Z of %d bytes for a %d-byte slice (at most %d)", errBadFrame, h.length, len(s.Local), MaxCompressedSlice))
				return
			}
			if err := ep.receiveDataZ(s, int(h.length)); err != nil {
				ep.fail(err)
				return
			}
			ep.dataSeq = h.seq
		case frameReadDone:
			if h.status == statusOK && ep.dataSeq != h.seq {
				ep.fail(fmt.Errorf("%w: READ_DONE without READ_DATA for slice %d", errBadFrame, h.seq))
				return
			}
			ep.pending.Delete(h.seq)
			ep.reads.Add(-1)
			s.Finish(sliceErr(&h, len(s.Local)))
		default:
			ep.fail(fmt.Errorf("%w: type %d from an owner", errBadFrame, h.typ))
			return
		}
	}
}

// errGoneAway is why a path ends when its owner closed it as idle.
var errGoneAway = errors.New("the owner closed the idle connection (GOAWAY)")

// goAway ends the path on the owner's GOAWAY: it answered every slice up
// to seq and read nothing after, so the slices still pending (sent after
// seq, or not sent) end with transport.ErrUnsent. An owner that names a
// slice it did not answer breaks the protocol instead.
func (ep *endpoint) goAway(seq uint64) {
	unanswered := false
	ep.pending.Range(func(k, _ any) bool {
		unanswered = k.(uint64) <= seq
		return !unanswered
	})
	if unanswered {
		ep.fail(fmt.Errorf("%w: GOAWAY after slice %d, which is not answered", errBadFrame, seq))
		return
	}
	ep.t.stats.goAways.Add(1)
	ep.goneAway = true // read by the sweep and by Post only once fail ended the goroutines
	ep.fail(errGoneAway)
}

// nextHeader returns the next answer header. Answers are small and come in
// runs, so while no READ is outstanding it reads as many as the socket holds
// at once; with READs outstanding it reads one header at a time, so READ
// data goes straight into the slice's memory.
func (ep *endpoint) nextHeader() ([]byte, error) {
	for ep.inEnd-ep.inStart < HeaderSize {
		if ep.inStart > 0 {
			ep.inEnd = copy(ep.inBuf[:], ep.inBuf[ep.inStart:ep.inEnd])
			ep.inStart = 0
		}
		limit := len(ep.inBuf)
		if ep.reads.Load() > 0 {
			limit = HeaderSize
		}
		_, n, _, err := ep.in.readv(nil, ep.inBuf[ep.inEnd:limit], nil, true)
		if err != nil {
			return nil, err
		}
		ep.inEnd += n
	}
	hb := ep.inBuf[ep.inStart : ep.inStart+HeaderSize]
	ep.inStart += HeaderSize
	return hb, nil
}

// receiveData copies one READ_DATA payload into the slice's memory, or
// drops it when the slice was canceled. Payload bytes that a header read
// pulled in (a READ posted while headers were read in bulk) are copied from
// the buffer first.
func (ep *endpoint) receiveData(s *transport.Slice) error {
	buffered := min(ep.inEnd-ep.inStart, len(s.Local))
	if !startReceiving(s) {
		ep.inStart += buffered
		return ep.in.discard(len(s.Local) - buffered)
	}
	if buffered > 0 {
		if err := s.LocalReg.Enter(); err != nil {
			ep.inStart += buffered
			s.Finish(fmt.Errorf("local memory: %w", err)) // READ_DONE clears it
			return ep.in.discard(len(s.Local) - buffered)
		}
		copy(s.Local, ep.inBuf[ep.inStart:ep.inStart+buffered])
		s.LocalReg.Leave()
		ep.inStart += buffered
	}
	if buffered == len(s.Local) {
		return nil
	}
	// The buffer is empty now. READ_DONE follows the payload at once, and
	// often the next READ_DATA header: read them in the payload's last
	// syscall.
	_, tail, refusal, err := ep.in.readGuarded(s.Local[buffered:], s.LocalReg, ep.inBuf[:2*HeaderSize])
	if err != nil {
		return err
	}
	ep.inStart, ep.inEnd = 0, tail
	if refusal != nil {
		s.Finish(fmt.Errorf("local memory: %w", refusal)) // READ_DONE clears it
	}
	return nil
}

// startReceiving claims a READ slice for copying its data in; it fails when
// the slice was canceled. The sender may still be moving it from Active to
// Sent, so both are accepted.
func startReceiving(s *transport.Slice) bool {
	for {
		if s.Advance(transport.StateSent, transport.StateReceiving) || s.Advance(transport.StateActive, transport.StateReceiving) {
			return true
		}
		if st := s.State(); st != transport.StateSent && st != transport.StateActive {
			return false
		}
	}
}

// sliceErr turns an owner's answer into the slice's outcome.
func sliceErr(h *header, want int) error {
	if err := errOf(h.status); err != nil {
		return fmt.Errorf("owner answered: %w (%d of %d bytes moved)", err, h.done, want)
	}
	if h.done != uint64(want) {
		return fmt.Errorf("%w: owner moved %d of %d bytes without a refusal", errBadFrame, h.done, want)
	}
	return nil
}

// armWrite sets the write deadline for the next gathered write, of n bytes,
// unless the path died: fail's past deadline must never be overwritten by a
// later one.
func (ep *endpoint) armWrite(n int) bool {
	ep.deadlineMu.Lock()
	defer ep.deadlineMu.Unlock()
	if ep.dead.Load() {
		return false
	}
	_ = ep.conn.SetWriteDeadline(ep.t.writeDeadline(n))
	return true
}

// fail marks the endpoint dead and cuts the connection, so both goroutines
// return from any syscall wait at once.
func (ep *endpoint) fail(reason error) {
	ep.failOnce.Do(func() {
		ep.deadlineMu.Lock()
		ep.reason = reason
		ep.dead.Store(true)
		_ = ep.conn.SetDeadline(time.Unix(1, 0))
		ep.deadlineMu.Unlock()
		select {
		case ep.wake <- struct{}{}:
		default:
		}
		if !isClosed(reason) && !ep.t.closing.Load() {
			ep.t.opts.Logger.Debug("tcp: path failed", "remote", ep.conn.RemoteAddr().String(), "err", reason)
		}
	})
}

// sweep runs once both goroutines ended: nothing touches slice memory any
// more, so every slice not yet ended fails with a retryable error.
func (ep *endpoint) sweep() {
	_ = ep.conn.Close()
	ep.mu.Lock()
	ep.closed = true
	queued := ep.queue
	ep.queue = nil
	ep.mu.Unlock()
	err := ep.failure()
	ep.pending.Range(func(k, v any) bool {
		ep.pending.Delete(k)
		v.(*transport.Slice).Finish(err)
		return true
	})
	for _, s := range queued {
		s.Finish(err)
	}
	ep.t.forget(ep)
	close(ep.finished)
}

// Abort stops the path and returns once it no longer touches slice memory.
func (ep *endpoint) Abort(reason error) {
	ep.fail(reason)
	<-ep.finished
}

// Dead reports whether the path failed or was aborted.
func (ep *endpoint) Dead() bool { return ep.dead.Load() }

// Close aborts the path with transport.ErrClosed.
func (ep *endpoint) Close() error {
	ep.Abort(transport.ErrClosed)
	return nil
}
