package shm

import (
	"errors"
	"fmt"
	"net"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvferry/kvferry/engine/transport"
)

// ownerConn is the owner's side of one connection: it reads the initiator's
// frames in order and copies each slice itself, chunk by chunk, under its
// own guard and the initiator's lease.
type ownerConn struct {
	t      *Transport
	conn   *net.UnixConn
	peer   peerProc
	lease  *lease
	attach bool // cross-memory attach reaches the peer (its probe was read)
	name   string

	// Frames read and not yet handled: buf[start:end]. fds are the
	// descriptors that came with them (SCM_RIGHTS), in order.
	buf        [64 * FrameSize]byte
	start, end int
	fds        []int
	oob        []byte

	shares     map[uint64][]byte // the initiator's buffers, mapped, by share id
	shareBytes uint64            // bytes of shares mapped
	gpu        bool              // we open CUDA IPC handles (opts.GPU is available)
	gpus       map[uint64]gpuShare
	answers    []byte // ANSWERs not yet written
}

// gpuShare is an allocation of the initiator's GPU memory, opened here by
// its IPC handle.
type gpuShare struct {
	ordinal    int
	addr, size uint64
}

// Bounds on what one initiator can make the owner hold.
const (
	// Views of initiators' buffers take address space (not memory: they
	// are the initiator's pages): 1 TiB per buffer, 4 TiB per
	// connection, and maxShareTotal for the transport, well inside the
	// 128 TiB a process has.
	maxShareBytes     = 1 << 40
	maxConnShareBytes = 4 << 40
	maxShares         = 4096 // buffers mapped per connection
	maxPendingFDs     = 16   // descriptors received and not yet claimed by a frame
	maxHeldAnswer     = 32   // ANSWERs held back while more frames are buffered
)

// ChunkSize is how many bytes the owner copies under one guard and one
// lease: an abort, a fence, an unregistration or the initiator's stop waits
// for at most one chunk (tens of microseconds).
const ChunkSize = 512 << 10

// serve runs one accepted connection until the peer closes or breaks the
// protocol.
func (t *Transport) serve(conn *net.UnixConn) {
	c := &ownerConn{t: t, conn: conn, shares: map[uint64][]byte{}, gpus: map[uint64]gpuShare{}, oob: make([]byte, unix.CmsgSpace(4*maxPendingFDs))}
	defer c.close()
	var err error
	if c.peer, err = peerOf(conn); err != nil {
		t.protoErr(c, fmt.Errorf("peer credentials: %w", err))
		return
	}
	if err := c.handshake(); err != nil {
		t.protoErr(c, fmt.Errorf("handshake: %w", err))
		return
	}
	var h header
	for {
		if err := c.next(&h, true); err != nil {
			t.connEnded(c, err)
			return
		}
		switch h.typ {
		case frameShare:
			err = c.share(&h)
		case frameShareGPU:
			err = c.shareGPU(&h)
		case frameUnshare:
			c.unmapShare(h.local)
			if g, ok := c.gpus[h.local]; ok {
				t.opts.GPU.Close(g.ordinal, g.addr)
				delete(c.gpus, h.local)
			}
		case frameWrite, frameRead:
			c.serveSlice(&h)
			if len(c.answers) >= maxHeldAnswer*FrameSize {
				err = c.flush()
			}
		default:
			err = fmt.Errorf("%w: type %d from an initiator", errBadFrame, h.typ)
		}
		if err != nil {
			t.connEnded(c, err)
			return
		}
	}
}

// handshake reads HELLO (with the lease's memfd), checks who the peer is,
// probes cross-memory attach, and answers HELLO_ACK.
func (c *ownerConn) handshake() error {
	t := c.t
	_ = c.conn.SetReadDeadline(time.Now().Add(t.opts.HandshakeTimeout))
	var h header
	if err := c.next(&h, false); err != nil {
		return err
	}
	if h.typ != frameHello {
		return fmt.Errorf("%w: want HELLO, got type %d", errBadFrame, h.typ)
	}
	for c.end-c.start < int(h.length) {
		if err := c.fill(); err != nil {
			return err
		}
	}
	c.name = string(c.buf[c.start : c.start+int(h.length)])
	c.start += int(h.length)
	fd, err := c.takeFD()
	if err != nil {
		return err
	}
	c.lease, err = mapLease(fd)
	_ = unix.Close(fd)
	if err != nil {
		return err
	}
	ack := header{typ: frameHelloAck}
	if c.peer.uid != uint32(unix.Geteuid()) {
		// Another user's process may not have us copy its memory, nor
		// ours into it: the kernel would refuse cross-memory attach
		// anyway, and shared buffers from it are refused too.
		ack.status = statusRefused
		c.answer(&ack)
		_ = c.flush()
		t.stats.refusedPeers.Add(1)
		return fmt.Errorf("peer uid %d is not ours (%d)", c.peer.uid, unix.Geteuid())
	}
	if t.opts.GPU != nil && t.opts.GPU.Available() {
		c.gpu = true
		ack.epoch |= helloGPU
	}
	if err := c.peer.probeAttach(h.local, h.offset); err == nil {
		c.attach = true
		ack.epoch |= helloAttach
	} else {
		t.opts.Logger.Debug("shm: cross-memory attach does not reach the peer; its other memory goes over tcp", "peer", c.name, "err", err)
	}
	_ = c.conn.SetReadDeadline(time.Time{})
	c.answer(&ack)
	return c.flush()
}

// next returns the next frame; with flush, the answers held back are
// written before the socket is waited on, so an initiator never waits on an
// answer while we wait on it.
func (c *ownerConn) next(h *header, flush bool) error {
	for c.end-c.start < FrameSize {
		if flush && len(c.answers) > 0 {
			if err := c.flush(); err != nil {
				return err
			}
		}
		if err := c.fill(); err != nil {
			return err
		}
	}
	if err := h.decode(c.buf[c.start : c.start+FrameSize]); err != nil {
		return err
	}
	c.start += FrameSize
	return nil
}

// fill reads more bytes, and the descriptors that come with them.
func (c *ownerConn) fill() error {
	if c.start > 0 {
		c.end = copy(c.buf[:], c.buf[c.start:c.end])
		c.start = 0
	}
	if c.end == len(c.buf) {
		return fmt.Errorf("%w: a frame longer than the read buffer", errBadFrame)
	}
	n, oobn, _, _, err := c.conn.ReadMsgUnix(c.buf[c.end:], c.oob)
	if oobn > 0 {
		if ferr := c.takeRights(c.oob[:oobn]); ferr != nil {
			return ferr
		}
	}
	if n > 0 {
		c.end += n
		return nil
	}
	if err == nil {
		err = net.ErrClosed
	}
	return err
}

// takeRights queues the descriptors of a control message; more than the
// frames can claim breaks the protocol (they are closed with the
// connection).
func (c *ownerConn) takeRights(oob []byte) error {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return fmt.Errorf("%w: control message: %v", errBadFrame, err)
	}
	for _, m := range msgs {
		fds, err := unix.ParseUnixRights(&m)
		if err != nil {
			continue // credentials or the like: nothing to keep
		}
		c.fds = append(c.fds, fds...)
	}
	if len(c.fds) > maxPendingFDs {
		return fmt.Errorf("%w: %d descriptors sent ahead of their frames", errBadFrame, len(c.fds))
	}
	return nil
}

// takeFD hands over the oldest descriptor received.
func (c *ownerConn) takeFD() (int, error) {
	if len(c.fds) == 0 {
		return -1, fmt.Errorf("%w: a frame that needs a descriptor came without one", errBadFrame)
	}
	fd := c.fds[0]
	c.fds = c.fds[1:]
	return fd, nil
}

// share maps a buffer the initiator shared.
func (c *ownerConn) share(h *header) error {
	fd, err := c.takeFD()
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if _, ok := c.shares[h.local]; ok {
		return fmt.Errorf("%w: share %d sent twice", errBadFrame, h.local)
	}
	if len(c.shares) >= maxShares {
		return fmt.Errorf("%w: more than %d buffers shared", errBadFrame, maxShares)
	}
	if h.offset > maxShareBytes || c.shareBytes+h.offset > maxConnShareBytes {
		return fmt.Errorf("%w: share of %d bytes, %d shared on the connection already", errBadFrame, h.offset, c.shareBytes)
	}
	if err := checkSealed(fd, h.offset); err != nil {
		return fmt.Errorf("%w: share %d: %v", errBadFrame, h.local, err)
	}
	if !c.t.takeShareBytes(h.offset) {
		return fmt.Errorf("%w: share of %d bytes: the owner's views of peers' buffers are at their bound", errBadFrame, h.offset)
	}
	// Page tables are filled ahead only for a buffer whose pages all
	// exist (an engine's, populated when allocated): a sparse one would
	// have us allocate its pages, charged to us. Any other page is
	// faulted in when a slice touches it.
	flags := unix.MAP_SHARED | unix.MAP_NORESERVE
	var st unix.Stat_t
	if unix.Fstat(fd, &st) == nil && uint64(st.Blocks)*512 >= h.offset {
		flags |= unix.MAP_POPULATE
	}
	m, err := unix.Mmap(fd, 0, int(h.offset), unix.PROT_READ|unix.PROT_WRITE, flags)
	if err != nil {
		c.t.releaseShareBytes(h.offset)
		return fmt.Errorf("share %d: mmap %d bytes: %w", h.local, h.offset, err)
	}
	c.shares[h.local] = m
	c.shareBytes += h.offset
	return nil
}

// unmapShare drops a view of an initiator's buffer.
func (c *ownerConn) unmapShare(id uint64) {
	if m, ok := c.shares[id]; ok {
		_ = unix.Munmap(m)
		delete(c.shares, id)
		c.shareBytes -= uint64(len(m))
		c.t.releaseShareBytes(uint64(len(m)))
	}
}

// shareGPU opens an allocation of the initiator's GPU memory by its IPC
// handle. A handle that does not open is not a broken protocol (the
// driver may refuse it): the slices naming it are refused as unreachable.
func (c *ownerConn) shareGPU(h *header) error {
	for c.end-c.start < int(h.length) {
		if err := c.fill(); err != nil {
			return err
		}
	}
	var handle [IPCHandleSize]byte
	copy(handle[:], c.buf[c.start:])
	bus := string(c.buf[c.start+IPCHandleSize : c.start+int(h.length)])
	c.start += int(h.length)
	if _, ok := c.gpus[h.local]; ok {
		return fmt.Errorf("%w: GPU share %d sent twice", errBadFrame, h.local)
	}
	if len(c.gpus) >= maxShares {
		return fmt.Errorf("%w: more than %d GPU allocations shared", errBadFrame, maxShares)
	}
	if !c.gpu {
		return fmt.Errorf("%w: SHARE_GPU to an owner that said it opens no IPC handle", errBadFrame)
	}
	ord, addr, size, err := c.t.opts.GPU.Import(handle, bus)
	if err != nil {
		c.t.warn.Warn("ipc "+c.name, "shm: a peer's CUDA IPC handle does not open here; its slices are refused", "peer", c.name, "bus", bus, "err", err)
		return nil
	}
	if size < h.offset {
		c.t.opts.GPU.Close(ord, addr)
		return fmt.Errorf("%w: GPU share %d of %d bytes, %d announced", errBadFrame, h.local, size, h.offset)
	}
	c.gpus[h.local] = gpuShare{ordinal: ord, addr: addr, size: h.offset}
	return nil
}

// serveSlice admits one slice and copies it, then queues its ANSWER.
func (c *ownerConn) serveSlice(h *header) {
	t := c.t
	ans := header{typ: frameAnswer, seq: h.seq, requestID: h.requestID, generation: h.generation}
	a := transport.Access{
		Initiator: c.name, RequestID: h.requestID, Generation: h.generation, GrantID: h.grantID,
		Epoch: h.epoch, Key: h.key, Addr: h.addr, Length: uint64(h.length), Op: transport.Write,
	}
	if h.typ == frameRead {
		a.Op = transport.Read
	}
	// The initiator's side first: a slice naming memory we cannot reach is
	// refused before it is admitted.
	var view []byte
	var gs *gpuShare
	switch h.status {
	case reachGPU:
		g, ok := c.gpus[h.local]
		if !ok || h.offset > g.size || uint64(h.length) > g.size-h.offset {
			c.refuse(&ans, fmt.Errorf("%w: GPU share %d [%d, +%d)", errUnreachable, h.local, h.offset, h.length))
			return
		}
		g.addr += h.offset // the slice's start
		gs = &g
	case reachShared:
		m := c.shares[h.local]
		if m == nil || h.offset > uint64(len(m)) || uint64(h.length) > uint64(len(m))-h.offset {
			c.refuse(&ans, fmt.Errorf("%w: share %d [%d, +%d)", errUnreachable, h.local, h.offset, h.length))
			return
		}
		view = m[h.offset : h.offset+uint64(h.length)]
	case reachAttach:
		if !c.attach || c.peer.gone() {
			c.refuse(&ans, fmt.Errorf("%w: cross-memory attach", errUnreachable))
			return
		}
	}
	tgt, err := t.owner.Admit(a)
	if err != nil {
		c.refuse(&ans, err)
		return
	}
	if tgt.Stage != nil {
		defer tgt.Stage.Release()
	}
	if t.opts.ApplyDelay > 0 {
		time.Sleep(t.opts.ApplyDelay)
	}
	var moved int
	var refusal error
	if gs != nil {
		moved, refusal = c.copyGPU(a.Op, tgt, *gs)
	} else {
		moved, refusal = c.copySlice(a.Op, tgt, view, h.local)
	}
	if a.Op == transport.Write {
		t.stats.bytesIn.Add(uint64(moved))
	} else {
		t.stats.bytesOut.Add(uint64(moved))
	}
	ans.epoch = uint64(moved)
	if refusal != nil {
		ans.status = statusOf(refusal)
		t.stats.refused.Add(1)
		t.stats.refusedInFlight.Add(1) // admitted, then refused: as tcp counts it
	}
	c.answer(&ans)
}

// errRevoked: the initiator revoked its lease (it stopped the path).
var errRevoked = errors.New("the initiator revoked its lease")

// copySlice moves a slice's bytes chunk by chunk, each under the owner's
// guard and the initiator's lease, and returns the bytes moved into their
// destination and the refusal that stopped it. GPU memory goes through the
// target's staging buffer, as on tcp: a WRITE reaches it only whole.
func (c *ownerConn) copySlice(op transport.Op, tgt transport.Target, view []byte, remote uint64) (int, error) {
	if op == transport.Read && tgt.Stage != nil {
		if err := transport.StageCopy(tgt.Guard, tgt.Stage.Fill); err != nil {
			return 0, err
		}
	}
	moved, err := c.chunks(tgt, ChunkSize, func(off, n int) (int, error) {
		own := tgt.Mem[off : off+n]
		switch {
		case view != nil && op == transport.Write:
			return copyOut(own, view[off:off+n]), nil
		case view != nil:
			return copyOut(view[off:off+n], own), nil
		case c.peer.gone():
			// Checked before each chunk: the peer's pid could be another
			// process's once it exited.
			return 0, errors.New("the peer process exited")
		default:
			return c.peer.attach(op == transport.Write, own, remote+uint64(off))
		}
	})
	if err != nil {
		return moved, err
	}
	if op == transport.Write && tgt.Stage != nil {
		if err := transport.StageCopy(tgt.Guard, tgt.Stage.Flush); err != nil {
			return 0, err
		}
	}
	return moved, nil
}

// chunks runs copyChunk over tgt.Mem in chunks of at most size bytes, each
// under the owner's guard and the initiator's lease (never across a wait),
// and returns the bytes moved and the refusal or error that stopped it:
// a refusal of the guard as is, the lease revoked or a failed copy as
// errUnreachable.
func (c *ownerConn) chunks(tgt transport.Target, size int, copyChunk func(off, n int) (int, error)) (int, error) {
	moved := 0
	leased := !c.t.opts.UnsafeIgnoreLease
	for moved < len(tgt.Mem) {
		n := min(size, len(tgt.Mem)-moved)
		if err := tgt.Guard.Enter(); err != nil {
			return moved, err
		}
		if leased && !c.lease.enter() {
			tgt.Guard.Leave()
			return moved, fmt.Errorf("%w: %w", errUnreachable, errRevoked)
		}
		k, err := copyChunk(moved, n)
		if leased {
			c.lease.leave()
		}
		tgt.Guard.Leave()
		moved += k
		if err != nil {
			return moved, fmt.Errorf("%w: %w", errUnreachable, err)
		}
	}
	return moved, nil
}

// gpuChunk is how many bytes of GPU memory the owner copies under one
// guard: the driver's copies run at tens to hundreds of GB/s, so a chunk
// this size still ends within tens of microseconds.
const gpuChunk = 4 << 20

// copyGPU moves a slice between the initiator's GPU memory (opened by its
// IPC handle: src.addr is the slice's start there) and the owner's memory,
// chunk by chunk under the owner's guard and the initiator's lease: device
// to device where the owner's memory is GPU memory too (its Stage names
// it), else between the device and the owner's host memory. Each copy has
// ended when the driver returns.
func (c *ownerConn) copyGPU(op transport.Op, tgt transport.Target, src gpuShare) (int, error) {
	gpu := c.t.opts.GPU
	ds, device := tgt.Stage.(transport.DeviceStage)
	var devAddr uint64
	if device {
		_, devAddr = ds.Device()
	}
	staged := tgt.Stage != nil && !device
	if op == transport.Read && staged {
		if err := transport.StageCopy(tgt.Guard, tgt.Stage.Fill); err != nil {
			return 0, err
		}
	}
	moved, err := c.chunks(tgt, gpuChunk, func(off, n int) (int, error) {
		peer, own := src.addr+uint64(off), uint64(off)
		var err error
		switch {
		case device && op == transport.Write:
			err = gpu.Copy(src.ordinal, copyDtoD, devAddr+own, peer, uint64(n))
		case device:
			err = gpu.Copy(src.ordinal, copyDtoD, peer, devAddr+own, uint64(n))
		case op == transport.Write:
			err = gpu.Copy(src.ordinal, copyDtoH, addrOf(tgt.Mem[off:]), peer, uint64(n))
		default:
			err = gpu.Copy(src.ordinal, copyHtoD, peer, addrOf(tgt.Mem[off:]), uint64(n))
		}
		if err != nil {
			return 0, err
		}
		return n, nil
	})
	if err != nil {
		return moved, err
	}
	if op == transport.Write && staged {
		if err := transport.StageCopy(tgt.Guard, tgt.Stage.Flush); err != nil {
			return 0, err
		}
	}
	return moved, nil
}

func addrOf(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))) }

func (c *ownerConn) refuse(ans *header, err error) {
	ans.status = statusOf(err)
	c.t.stats.refused.Add(1)
	c.answer(ans)
}

func (c *ownerConn) answer(h *header) {
	var b [FrameSize]byte
	h.encode(b[:])
	c.answers = append(c.answers, b[:]...)
}

// flush writes the answers held back, bounded by the I/O timeout.
func (c *ownerConn) flush() error {
	if len(c.answers) == 0 {
		return nil
	}
	_ = c.conn.SetWriteDeadline(time.Now().Add(c.t.opts.IOTimeout))
	_, err := c.conn.Write(c.answers)
	c.answers = c.answers[:0]
	return err
}

// close releases everything the connection holds: the shared buffers'
// views, the lease, descriptors never claimed, the pidfd.
func (c *ownerConn) close() {
	_ = c.conn.Close()
	for id := range c.shares {
		c.unmapShare(id)
	}
	for id, g := range c.gpus {
		c.t.opts.GPU.Close(g.ordinal, g.addr)
		delete(c.gpus, id)
	}
	if c.lease != nil {
		c.lease.unmap()
	}
	for _, fd := range c.fds {
		_ = unix.Close(fd)
	}
	c.fds = nil
	c.peer.close()
}
