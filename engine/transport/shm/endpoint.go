package shm

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
)

// endpoint is the initiator's side of one connection. A sender goroutine
// writes one frame per slice, in posting order; a receiver goroutine reads
// the owner's answers and ends the slices.
//
// A slice the owner may copy is never canceled on its own (it stays
// Receiving, which TryCancel does not take): the owner reads or writes our
// memory itself, so only stopping the whole path, which revokes the lease
// and waits for the owner's chunk in progress, makes sure it no longer
// does.
type endpoint struct {
	t        *Transport
	conn     *net.UnixConn
	owner    peerProc
	lease    *lease
	attach   bool
	gpu      bool // the owner opens our GPU memory by IPC handles
	fallback FallbackDialer

	mu       sync.Mutex
	queue    []*transport.Slice
	unshares []uint64
	closed   bool
	pending  map[uint64]*transport.Slice // by seq; sent and not answered
	regions  map[*memory.Region]int      // our regions of the slices pending
	inBytes  int                         // bytes of the slices pending
	fb       transport.Endpoint          // the tcp path, dialed on first need
	ctx      context.Context             // canceled when the path fails: a fallback dial gives up
	cancel   context.CancelFunc
	wake     chan struct{}

	// sendMu is held by whoever sends: Post in its caller's goroutine when
	// no one else does, else the sender goroutine.
	sendMu sync.Mutex
	seq    uint64          // under sendMu
	shared map[uint64]bool // under sendMu: share ids the owner holds
	batch  []*transport.Slice
	out    []byte

	dead     atomic.Bool
	failOnce sync.Once
	reason   error // set before dead
	wg       sync.WaitGroup
	// stopped closes once the owner certainly left our memory and every
	// slice ended (confirmed set first), or once StopBound passed without
	// the owner leaving: Abort returns then. finished closes once every
	// slice ended, which is only after the owner left.
	stopped   chan struct{}
	confirmed atomic.Bool
	finished  chan struct{}
}

func newEndpoint(t *Transport, conn *net.UnixConn, self string, deadline time.Time, fallback FallbackDialer) (*endpoint, error) {
	ep := &endpoint{
		t: t, conn: conn, fallback: fallback,
		pending: map[uint64]*transport.Slice{}, regions: map[*memory.Region]int{},
		shared: map[uint64]bool{}, wake: make(chan struct{}, 1), stopped: make(chan struct{}), finished: make(chan struct{}),
	}
	ep.ctx, ep.cancel = context.WithCancel(context.Background())
	var err error
	if ep.owner, err = peerOf(conn); err != nil {
		return nil, err
	}
	fail := func(err error) (*endpoint, error) {
		ep.cancel()
		ep.owner.close()
		if ep.lease != nil {
			ep.lease.unmap()
		}
		return nil, err
	}
	if ep.owner.uid != uint32(unix.Geteuid()) {
		return fail(fmt.Errorf("the owner runs as uid %d, not ours (%d)", ep.owner.uid, unix.Geteuid()))
	}
	if ep.owner.pidfd < 0 {
		// Without it an owner that died inside a chunk of our memory
		// could not be told from one merely stopped there: the path's
		// slices would never end. The engine takes tcp instead.
		return fail(errors.New("no pidfd of the owner process (kernel before 6.5 with the owner in another pid namespace, or pidfd_open denied)"))
	}
	l, leaseFD, err := newLease()
	if err != nil {
		return fail(err)
	}
	ep.lease = l
	defer unix.Close(leaseFD)
	// The probe: a word the owner must read by cross-memory attach to
	// prove it can reach our memory (and that we are the process the
	// kernel says).
	probe := new(uint64)
	if !t.opts.NoAttach {
		var r [8]byte
		_, _ = rand.Read(r[:])
		*probe = binary.LittleEndian.Uint64(r[:]) | 1
	}
	hello := header{typ: frameHello, length: uint32(len(self)), offset: *probe}
	if *probe != 0 {
		hello.local = uint64(uintptr(unsafe.Pointer(probe)))
	}
	b := make([]byte, FrameSize+len(self))
	hello.encode(b)
	copy(b[FrameSize:], self)
	_ = conn.SetDeadline(deadline)
	if _, _, err := conn.WriteMsgUnix(b, unix.UnixRights(leaseFD), nil); err != nil {
		return fail(err)
	}
	var ab [FrameSize]byte
	if err := readFull(conn, ab[:]); err != nil {
		return fail(err)
	}
	runtime.KeepAlive(probe)
	var ack header
	if err := ack.decode(ab[:]); err != nil {
		return fail(err)
	}
	if ack.typ != frameHelloAck || ack.status != statusOK {
		return fail(fmt.Errorf("%w: HELLO answered with type %d status %d", transport.ErrRefused, ack.typ, ack.status))
	}
	ep.attach = ack.epoch&helloAttach != 0 && *probe != 0
	// The driver opens no IPC handle of the calling process itself: an
	// owner in our own process gets our GPU memory staged.
	ep.gpu = ack.epoch&helloGPU != 0 && t.opts.GPU != nil && ep.owner.pid != os.Getpid()
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

func readFull(c net.Conn, b []byte) error {
	for n := 0; n < len(b); {
		k, err := c.Read(b[n:])
		n += k
		if err != nil && n < len(b) {
			return err
		}
	}
	return nil
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
	// Frames are small and the socket has room for a window of them, so
	// the caller sends them itself when no one else is sending: one
	// goroutine hand-off less on the way to the owner.
	if ep.sendMu.TryLock() {
		err := ep.sendQueued(true)
		ep.sendMu.Unlock()
		if err != nil {
			ep.fail(err)
		}
		return
	}
	ep.poke()
}

func (ep *endpoint) poke() {
	select {
	case ep.wake <- struct{}{}:
	default:
	}
}

func (ep *endpoint) failure() error {
	return fmt.Errorf("shm path: %w: %w", transport.ErrConnection, ep.reason)
}

// unshare has the owner unmap a buffer we freed.
func (ep *endpoint) unshare(id uint64) {
	ep.mu.Lock()
	if !ep.closed {
		ep.unshares = append(ep.unshares, id)
	}
	ep.mu.Unlock()
	ep.poke()
}

// touches reports whether a slice of ours in one of regs may be copied by
// the owner now.
func (ep *endpoint) touches(regs []*memory.Region) bool {
	ep.mu.Lock()
	defer ep.mu.Unlock()
	for _, r := range regs {
		if ep.regions[r] > 0 {
			return true
		}
	}
	return false
}

// maxInFlight bounds the bytes of slices sent to the owner and not yet
// answered: enough that the owner always has the next slice at hand, few
// enough that most of a large transfer stays queued, cancelable one slice
// at a time.
const maxInFlight = 16 << 20

// send is the sender goroutine: it sends what Post left queued (a window
// that was full, slices for the tcp path, buffers to unshare).
func (ep *endpoint) send() {
	defer ep.wg.Done()
	for !ep.dead.Load() {
		<-ep.wake
		ep.sendMu.Lock()
		err := ep.sendQueued(false)
		ep.sendMu.Unlock()
		if err != nil {
			ep.fail(err)
			return
		}
	}
}

// sendQueued writes a frame per queued slice, in order, within the window.
// inline is set when Post runs it in its caller's goroutine, which must not
// wait for a dial: it then leaves the slices for the tcp path, and those
// after them, to the sender goroutine. The caller holds sendMu.
func (ep *endpoint) sendQueued(inline bool) error {
	for !ep.dead.Load() {
		ep.mu.Lock()
		// Only a window of bytes goes to the owner at once; the rest stays
		// queued, where TryCancel still takes it without stopping the path.
		k, room := 0, maxInFlight-ep.inBytes
		for k < len(ep.queue) && (room >= len(ep.queue[k].Local) || (k == 0 && ep.inBytes == 0)) {
			room -= len(ep.queue[k].Local)
			k++
		}
		batch := append(ep.batch[:0], ep.queue[:k]...)
		ep.queue = append(ep.queue[:0], ep.queue[k:]...)
		unshares := ep.unshares
		ep.unshares = nil
		ep.mu.Unlock()
		if len(batch) == 0 && len(unshares) == 0 {
			return nil
		}
		out := ep.out[:0]
		for _, id := range unshares {
			if ep.shared[id] {
				delete(ep.shared, id)
				out = appendFrame(out, &header{typ: frameUnshare, local: id})
			}
		}
		var fbs []*transport.Slice
		var err error
		handOver := false
		for i, s := range batch {
			if !s.Advance(transport.StateQueued, transport.StateActive) {
				continue // canceled while queued
			}
			var h header
			if out, h, err = ep.reach(s, out); errors.Is(err, errGPUUnreachable) {
				s.Finish(err)
				err = nil
				continue
			} else if err != nil {
				s.Advance(transport.StateActive, transport.StateQueued)
				ep.requeue(batch[i:])
				break
			}
			if h.status == 0 {
				s.Advance(transport.StateActive, transport.StateQueued)
				if inline {
					ep.requeue(batch[i:])
					handOver = true
					break
				}
				fbs = append(fbs, s)
				continue
			}
			ep.seq++
			if !ep.track(s, ep.seq) {
				continue
			}
			h.typ, h.seq, h.requestID, h.generation = frameRead, ep.seq, s.RequestID, s.Generation
			if s.Op == transport.Write {
				h.typ = frameWrite
			}
			h.length, h.key, h.addr, h.grantID, h.epoch = uint32(len(s.Local)), s.Key, s.Remote, s.GrantID, s.Epoch
			out = appendFrame(out, &h)
		}
		if err == nil {
			err = ep.write(out, nil)
		}
		ep.out = out[:0]
		clear(batch)
		ep.batch = batch[:0]
		if len(fbs) > 0 {
			ep.toFallback(fbs)
		}
		if err != nil {
			return err
		}
		if handOver {
			ep.poke()
			return nil
		}
	}
	return nil
}

// requeue puts slices back at the head of the queue for the sweep.
func (ep *endpoint) requeue(ss []*transport.Slice) {
	ep.mu.Lock()
	ep.queue = append(append([]*transport.Slice(nil), ss...), ep.queue...)
	ep.mu.Unlock()
}

// track counts a slice as in flight in its region and pending under seq
// before its frame leaves (one lock for both), so an Unregister of the
// region from now on stops this path; a region already gone fails the
// slice here. From here the slice ends only by the owner's answer or the
// path's stop.
func (ep *endpoint) track(s *transport.Slice, seq uint64) bool {
	ep.mu.Lock()
	ep.regions[s.LocalReg]++
	ep.inBytes += len(s.Local)
	ep.pending[seq] = s
	ep.mu.Unlock()
	if err := s.LocalReg.Enter(); err != nil {
		ep.mu.Lock()
		delete(ep.pending, seq)
		ep.mu.Unlock()
		ep.untrack(s)
		s.Finish(fmt.Errorf("local memory: %w", err))
		return false
	}
	s.LocalReg.Leave()
	s.Advance(transport.StateActive, transport.StateReceiving)
	return true
}

func (ep *endpoint) untrack(s *transport.Slice) {
	ep.mu.Lock()
	ep.inBytes -= len(s.Local)
	if n := ep.regions[s.LocalReg] - 1; n > 0 {
		ep.regions[s.LocalReg] = n
	} else {
		delete(ep.regions, s.LocalReg)
	}
	ep.mu.Unlock()
}

// reach says how the owner can reach the slice's memory (h.status, with
// h.local and h.offset), sharing its buffer first when needed (the frames
// in out go before the SHARE); status 0 means neither way does.
func (ep *endpoint) reach(s *transport.Slice, out []byte) ([]byte, header, error) {
	var h header
	if s.LocalReg == nil || len(s.Local) == 0 {
		return out, h, nil
	}
	addr, n := memory.AddrOf(s.Local), uint64(len(s.Local))
	if isGPU(s.LocalReg) {
		return ep.reachGPU(s.LocalReg, addr, n, out)
	}
	f, ok, _ := memory.Shared(addr, n, false)
	if ok && !ep.shared[f.ID] {
		var err error
		f, ok, err = memory.Shared(addr, n, true)
		if err != nil {
			ep.t.opts.Logger.Debug("shm: a shareable buffer could not be shared", "err", err)
			ok = false
		} else if ok {
			err = ep.write(appendFrame(out, &header{typ: frameShare, local: f.ID, offset: f.Size}), unix.UnixRights(f.FD))
			_ = unix.Close(f.FD)
			out = out[:0]
			if err != nil {
				return out, h, err
			}
			ep.shared[f.ID] = true
		}
	}
	switch {
	case ok:
		h.status, h.local, h.offset = reachShared, f.ID, f.Offset
		ep.t.stats.shared.Add(1)
	case ep.attach:
		h.status, h.local = reachAttach, addr
		ep.t.stats.attach.Add(1)
	}
	return out, h, nil
}

// isGPU reports whether a region is GPU memory (location "cuda:N").
func isGPU(r *memory.Region) bool { return strings.HasPrefix(r.Location, "cuda:") }

// errGPUUnreachable ends a slice of GPU memory the owner cannot be given
// (the engine stages GPU memory for paths without DirectGPU, so only a
// failed export gets here).
var errGPUUnreachable = errors.New("shm: GPU memory the owner cannot open")

// reachGPU shares the allocation of GPU memory holding the slice (its IPC
// handle, once per connection) and names it.
func (ep *endpoint) reachGPU(reg *memory.Region, addr, n uint64, out []byte) ([]byte, header, error) {
	var h header
	if !ep.gpu {
		return out, h, errGPUUnreachable
	}
	// The export is looked up or made while the region is pinned: its
	// unregistration, which forgets the exports it covers, then comes
	// after, and no export of an allocation freed meanwhile is kept.
	if err := reg.Enter(); err != nil {
		return out, h, fmt.Errorf("%w: local memory: %w", errGPUUnreachable, err)
	}
	g, err := ep.t.gpuShare(addr, n)
	reg.Leave()
	if err != nil {
		return out, h, fmt.Errorf("%w: %w", errGPUUnreachable, err)
	}
	if !ep.shared[g.id] {
		fr := header{typ: frameShareGPU, local: g.id, offset: g.size, length: uint32(IPCHandleSize + len(g.bus))}
		out = appendFrame(out, &fr)
		out = append(out, g.handle[:]...)
		out = append(out, g.bus...)
		ep.shared[g.id] = true
	}
	h.status, h.local, h.offset = reachGPU, g.id, addr-g.base
	ep.t.stats.gpu.Add(1)
	return out, h, nil
}

func appendFrame(b []byte, h *header) []byte {
	var f [FrameSize]byte
	h.encode(f[:])
	return append(b, f[:]...)
}

// write sends frames (with descriptors in oob), bounded by the I/O timeout.
func (ep *endpoint) write(b, oob []byte) error {
	if len(b) == 0 {
		return nil
	}
	_ = ep.conn.SetWriteDeadline(time.Now().Add(ep.t.opts.IOTimeout))
	if ep.dead.Load() {
		return ep.reason
	}
	if oob == nil {
		_, err := ep.conn.Write(b)
		return err
	}
	n, _, err := ep.conn.WriteMsgUnix(b, oob, nil)
	if err == nil && n < len(b) {
		_, err = ep.conn.Write(b[n:])
	}
	return err
}

// toFallback posts slices the owner cannot reach on the tcp path, dialing
// it first when needed.
func (ep *endpoint) toFallback(ss []*transport.Slice) {
	ep.t.stats.fallback.Add(uint64(len(ss)))
	ep.mu.Lock()
	fb := ep.fb
	ep.mu.Unlock()
	if fb == nil || fb.Dead() {
		var err error
		fb, err = ep.dialFallback()
		if err != nil {
			for _, s := range ss {
				s.Finish(fmt.Errorf("shm: %w: memory the owner cannot reach, and no tcp path: %w", transport.ErrConnection, err))
			}
			return
		}
	}
	fb.Post(ss)
}

func (ep *endpoint) dialFallback() (transport.Endpoint, error) {
	if ep.fallback == nil {
		return nil, fmt.Errorf("no tcp path given")
	}
	ctx, cancel := context.WithTimeout(ep.ctx, ep.t.opts.HandshakeTimeout)
	defer cancel()
	fb, err := ep.fallback(ctx)
	if err != nil {
		return nil, err
	}
	ep.mu.Lock()
	if ep.closed || ep.dead.Load() {
		ep.mu.Unlock()
		fb.Abort(transport.ErrClosed)
		return nil, ep.reason
	}
	old := ep.fb
	ep.fb = fb
	ep.mu.Unlock()
	if old != nil {
		go old.Abort(transport.ErrClosed)
	}
	return fb, nil
}

// receive reads answers and ends slices.
func (ep *endpoint) receive() {
	defer ep.wg.Done()
	var buf [64 * FrameSize]byte
	start, end := 0, 0
	var h header
	for {
		for end-start < FrameSize {
			if start > 0 {
				end = copy(buf[:], buf[start:end])
				start = 0
			}
			n, err := ep.conn.Read(buf[end:])
			end += n
			if err != nil && end-start < FrameSize {
				ep.fail(err)
				return
			}
		}
		if err := h.decode(buf[start : start+FrameSize]); err != nil {
			ep.fail(err)
			return
		}
		start += FrameSize
		if h.typ != frameAnswer {
			ep.fail(fmt.Errorf("%w: type %d from an owner", errBadFrame, h.typ))
			return
		}
		ep.mu.Lock()
		s, ok := ep.pending[h.seq]
		delete(ep.pending, h.seq)
		ep.mu.Unlock()
		if !ok {
			ep.fail(fmt.Errorf("%w: answer for unknown slice %d", errBadFrame, h.seq))
			return
		}
		ep.untrack(s)
		if h.status == statusUnreachable && ep.dead.Load() {
			// The owner lost our memory because we revoked its lease
			// (the path is stopping): the path failed, not the access,
			// and the slice may go again elsewhere.
			s.Finish(ep.failure())
		} else {
			s.Finish(sliceErr(&h, len(s.Local)))
		}
		ep.poke()
	}
}

// sliceErr turns an owner's answer into the slice's outcome.
func sliceErr(h *header, want int) error {
	if err := errOf(h.status); err != nil {
		return fmt.Errorf("owner answered: %w (%d of %d bytes moved)", err, h.epoch, want)
	}
	if h.epoch != uint64(want) {
		return fmt.Errorf("%w: owner moved %d of %d bytes without a refusal", errBadFrame, h.epoch, want)
	}
	return nil
}

// fail marks the endpoint dead, revokes the lease (no chunk of the owner
// starts in our memory from now on) and cuts the connection.
func (ep *endpoint) fail(reason error) {
	ep.failOnce.Do(func() {
		ep.reason = reason
		ep.dead.Store(true)
		ep.cancel()
		ep.lease.revoke()
		_ = ep.conn.SetDeadline(time.Unix(1, 0))
		ep.poke()
	})
}

// sweep runs once both goroutines ended: it waits for the owner's chunk in
// progress in our memory, then fails every slice not yet ended. An owner
// that does not leave within StopBound (stopped in the middle of a chunk)
// lets Abort return, reporting it unconfirmed, but the slices end only
// once it left (or exited): until then their memory may still be touched,
// which a cancel reports as transport.ErrInUse.
func (ep *endpoint) sweep() {
	// An inline sender in Post finishes its round first: slices it
	// tracks are then in pending for us to end.
	ep.sendMu.Lock()
	ep.sendMu.Unlock()
	confirmed := ep.lease.drain(ep.t.opts.StopBound, ep.owner.gone)
	if !confirmed {
		ep.t.stats.unconfirmed.Add(1)
		ep.t.opts.Logger.Error("kvferry: shm owner did not leave our memory within the bound after the path was stopped (owner process stopped mid-copy?); its slices end once it does",
			"owner_pid", ep.owner.pid, "bound", ep.t.opts.StopBound)
		// The tcp path does not depend on the lease: it stops now.
		ep.mu.Lock()
		fb := ep.fb
		ep.fb = nil
		ep.mu.Unlock()
		if fb != nil {
			fb.Abort(ep.reason)
		}
		close(ep.stopped)
		for !ep.lease.drain(time.Minute, ep.owner.gone) {
		}
		ep.t.opts.Logger.Warn("kvferry: shm owner left our memory; the stopped path's slices end now", "owner_pid", ep.owner.pid)
	}
	_ = ep.conn.Close()
	ep.mu.Lock()
	ep.closed = true
	queued := ep.queue
	ep.queue = nil
	pending := ep.pending
	ep.pending = map[uint64]*transport.Slice{}
	ep.regions = map[*memory.Region]int{}
	fb := ep.fb
	ep.fb = nil
	ep.mu.Unlock()
	err := ep.failure()
	for _, s := range pending {
		s.Finish(err)
	}
	for _, s := range queued {
		s.Finish(err)
	}
	if fb != nil {
		fb.Abort(ep.reason)
	}
	ep.owner.close()
	ep.lease.unmap()
	ep.t.forget(ep)
	if confirmed {
		// Abort returns once every slice ended and the tcp path stopped.
		ep.confirmed.Store(true)
		close(ep.stopped)
	}
	close(ep.finished)
}

// Abort stops the path and returns once the owner no longer touches our
// memory for it, or once StopBound passed without the owner confirming it
// (logged and counted; the slices then end only once it left).
func (ep *endpoint) Abort(reason error) { ep.stop(reason) }

// stop is Abort, reporting whether the owner certainly left our memory.
func (ep *endpoint) stop(reason error) bool {
	ep.fail(reason)
	<-ep.stopped
	return ep.confirmed.Load()
}

// Cancel stops the path for slices a cancel cut (transport.SliceCanceler):
// a slice on the wire cannot be taken back alone, since the owner copies
// it. It returns nil once the owner left our memory and every slice of the
// path ended, or an error wrapping transport.ErrInUse when that was not
// confirmed by ctx's deadline.
func (ep *endpoint) Cancel(ctx context.Context, _ []*transport.Slice) error {
	ep.fail(transport.ErrCanceled)
	select {
	case <-ep.finished:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("shm path: %w: the same-host owner did not leave the memory by the deadline (stopped mid-copy?)", transport.ErrInUse)
	}
}

// DirectGPU reports whether the owner copies our GPU memory itself, through
// CUDA IPC (transport.DirectGPU); otherwise the engine stages it.
func (ep *endpoint) DirectGPU() bool { return ep.gpu }

// Dead reports whether the path failed or was aborted.
func (ep *endpoint) Dead() bool { return ep.dead.Load() }

// Close aborts the path with transport.ErrClosed.
func (ep *endpoint) Close() error {
	ep.Abort(transport.ErrClosed)
	return nil
}
