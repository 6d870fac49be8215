package rdma

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/verbs"
)

// Notifications travel in-band: a SEND on a QP of the path, posted once
// every work request of the request completed, so the owner receives it
// after the request's data (RC completes in order of placement). The
// payload is the request id (8 bytes), the data's length (1 byte) and the
// data.
const (
	// MaxNotifyData is the most bytes of data a notification carries.
	MaxNotifyData = 64
	notifyHeader  = 9
	slotSize      = 128
	poolSlots     = 4096 // per NIC: receives of every responder QP, and sends
	recvsPerQP    = 16
)

// ErrNotifyDropped: the owner's NIC took the notification but its engine
// had no room for it (never returned to the sender, which cannot know).
var ErrNotifyDropped = errors.New("notification dropped: the owner's event queue is full")

// slotPool is registered memory for SENDs and RECVs of notifications.
type slotPool struct {
	mem  []byte
	mr   *verbs.MR
	mu   sync.Mutex
	free []int
}

func newSlotPool(n *NIC) (*slotPool, error) {
	mem, _, err := memory.Alloc(poolSlots * slotSize)
	if err != nil {
		return nil, err
	}
	mr, err := n.pd.RegMR(memory.AddrOf(mem), uint64(len(mem)), verbs.AccessLocalWrite, false)
	if err != nil {
		_ = memory.Free(mem)
		return nil, err
	}
	p := &slotPool{mem: mem, mr: mr, free: make([]int, poolSlots)}
	for i := range p.free {
		p.free[i] = poolSlots - 1 - i
	}
	return p, nil
}

func (p *slotPool) get() (int, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.free) == 0 {
		return 0, false
	}
	i := p.free[len(p.free)-1]
	p.free = p.free[:len(p.free)-1]
	return i, true
}

func (p *slotPool) put(i int) {
	p.mu.Lock()
	p.free = append(p.free, i)
	p.mu.Unlock()
}

func (p *slotPool) addr(i int) uint64 { return p.mr.Addr + uint64(i*slotSize) }

func (p *slotPool) bytes(i int) []byte { return p.mem[i*slotSize : (i+1)*slotSize : (i+1)*slotSize] }

func (p *slotPool) close() {
	_ = p.mr.Dereg()
	_ = memory.Free(p.mem)
}

// recvCtx is a receive posted on a responder QP.
type recvCtx struct {
	n         *NIC
	slot      int
	qp        *verbs.QP
	initiator string
}

// postRecvs gives a responder QP its receive buffers.
func (t *Transport) postRecvs(n *NIC, qp *verbs.QP, initiator string, count int) error {
	wrs := make([]verbs.RecvWR, 0, count)
	for range count {
		if n.recvs.Load()+int64(len(wrs)) >= int64(n.cq.Size/4) {
			break // the CQ is shared with data: receives take a quarter at most
		}
		slot, ok := n.slots.get()
		if !ok {
			break
		}
		id := t.track(&wrCtx{recv: &recvCtx{n: n, slot: slot, qp: qp, initiator: initiator}})
		wrs = append(wrs, verbs.RecvWR{ID: id, Addr: n.slots.addr(slot), Length: slotSize, LKey: n.slots.mr.LKey})
	}
	if len(wrs) < count {
		t.log.Warn("kvferry: rdma notification buffers exhausted; notifications to this QP wait (RNR) until some are free",
			"nic", n.Name, "peer", initiator, "posted", len(wrs), "wanted", count)
	}
	n.recvs.Add(int64(len(wrs)))
	posted, err := qp.PostRecv(wrs)
	for _, w := range wrs[posted:] {
		t.untrack(w.ID)
		n.recvs.Add(-1)
		n.slots.put(int((w.Addr - n.slots.mr.Addr) / slotSize))
	}
	return err
}

// dropRecvs forgets the receives of a responder QP about to be destroyed:
// a destroyed QP completes nothing more.
func (t *Transport) dropRecvs(qp *verbs.QP) {
	t.wrMu.Lock()
	var freed []*recvCtx
	for id, c := range t.wrs {
		if c.recv != nil && c.recv.qp == qp {
			delete(t.wrs, id)
			freed = append(freed, c.recv)
		}
	}
	t.wrMu.Unlock()
	for _, r := range freed {
		r.n.recvs.Add(-1)
		r.n.slots.put(r.slot)
	}
}

// destroyResponder cuts and destroys an owner-side QP.
func (t *Transport) destroyResponder(qp *verbs.QP) {
	_ = qp.ToError()
	t.dropRecvs(qp)
	_ = qp.Destroy()
	t.stats.respQPs.Add(-1)
}

// received takes a receive's completion (on the poller): the notification
// goes to the engine and the buffer back to the QP.
func (t *Transport) received(c *recvCtx, wc *verbs.WC) {
	c.n.recvs.Add(-1)
	if wc.Status != verbs.WCSuccess {
		c.n.slots.put(c.slot) // flushed: the QP is gone or going
		return
	}
	b := c.n.slots.bytes(c.slot)
	if wc.ByteLen < notifyHeader || wc.ByteLen > slotSize || int(b[8]) != int(wc.ByteLen)-notifyHeader || b[8] > MaxNotifyData {
		t.stats.BadNotifies.Add(1)
		t.log.Warn("kvferry: dropped a malformed rdma notification", "peer", c.initiator, "bytes", wc.ByteLen)
	} else if t.opts.OnNotify != nil {
		rid := binary.LittleEndian.Uint64(b)
		data := append([]byte(nil), b[notifyHeader:wc.ByteLen]...)
		t.stats.Notifies.Add(1)
		t.opts.OnNotify(c.initiator, rid, data)
	}
	// Give the buffer back to the QP unless it was destroyed meanwhile.
	id := t.track(&wrCtx{recv: c})
	c.n.recvs.Add(1)
	if _, err := c.qp.PostRecv([]verbs.RecvWR{{ID: id, Addr: c.n.slots.addr(c.slot), Length: slotSize, LKey: c.n.slots.mr.LKey}}); err != nil {
		if t.untrackIf(id) {
			c.n.recvs.Add(-1)
			c.n.slots.put(c.slot)
		}
	}
}

// notifyFlushGrace bounds how long Notify waits, past its deadline, for
// the flush of a SEND it gave up on.
const notifyFlushGrace = 20 * time.Millisecond

// Notify sends a notification of requestID to the owner, in-band, after
// every work request of that request on this path completed. It returns
// once the owner's NIC took it, or at ctx's end plus notifyFlushGrace at
// most: the pair is then cut, so the SEND cannot arrive later once its
// flush was seen (the error says when it was not).
func (e *Endpoint) Notify(ctx context.Context, requestID uint64, data []byte) error {
	if len(data) > MaxNotifyData {
		return fmt.Errorf("rdma notify: %d bytes of data (at most %d)", len(data), MaxNotifyData)
	}
	defer e.wakeOn(ctx)()
	e.mu.Lock()
	var p *pair
	for {
		if e.dead {
			err := e.deadErr
			e.mu.Unlock()
			return err
		}
		if ctx.Err() != nil {
			e.mu.Unlock()
			return fmt.Errorf("rdma notify: %w", ctx.Err())
		}
		if !e.busyLocked(requestID) {
			for _, q := range e.pairs {
				if q.healthy && q.inflight < q.nic.maxWR {
					p = q
					break
				}
			}
			if p != nil {
				break
			}
		}
		e.cond.Wait()
	}
	slot, ok := p.nic.slots.get()
	if !ok {
		e.mu.Unlock()
		return fmt.Errorf("rdma notify: no send buffer free on %s", p.nic.Name)
	}
	buf := p.nic.slots.bytes(slot)
	binary.LittleEndian.PutUint64(buf, requestID)
	buf[8] = byte(len(data))
	copy(buf[notifyHeader:], data)
	done := make(chan uint32, 1)
	c := &wrCtx{ep: e, pair: p, send: &sendCtx{slot: slot, done: done}}
	id := e.t.track(c)
	if p.inflight == 0 {
		p.progress = time.Now() // the watchdog times the SEND from here
	}
	p.inflight++
	p.nic.inflight.Add(1)
	wr := verbs.WR{ID: id, LocalAddr: p.nic.slots.addr(slot), Length: uint32(notifyHeader + len(data)), LKey: p.nic.slots.mr.LKey, Opcode: verbs.OpSend, Flags: verbs.FlagSignaled}
	if _, err := p.qp.PostSend([]verbs.WR{wr}); err != nil {
		e.t.untrack(id)
		p.inflight--
		p.nic.inflight.Add(-1)
		p.nic.slots.put(slot)
		e.breakPair(p, err)
		e.mu.Unlock()
		return fmt.Errorf("rdma notify: %w", err)
	}
	e.mu.Unlock()
	p.nic.kick()
	select {
	case st := <-done:
		if st != verbs.WCSuccess {
			return fmt.Errorf("rdma notify on %s: %s (status %d)", p.nic.Name, e.t.lib.WCStatusString(st), st)
		}
		return nil
	case <-ctx.Done():
		// The SEND may still go out: cut the pair, so that once its
		// flush is seen it cannot arrive after the caller was told it
		// failed. The flush is waited for briefly only: the deadline
		// holds, and past the grace the error says it may still arrive.
		e.mu.Lock()
		e.breakPair(p, ctx.Err())
		if p.qp != nil {
			_ = p.qp.ToError()
		}
		e.mu.Unlock()
		select {
		case <-done:
			return fmt.Errorf("rdma notify: %w", ctx.Err())
		case <-time.After(notifyFlushGrace):
			return fmt.Errorf("rdma notify: %w (its SEND was not flushed within %v of the cut: the peer may still get it)", ctx.Err(), notifyFlushGrace)
		}
	}
}

// Quiet returns once no work request of requestID is queued or on the wire
// on this path (a notification sent afterwards on any path arrives after
// the request's data).
func (e *Endpoint) Quiet(ctx context.Context, requestID uint64) error {
	return e.waitIdle(ctx, requestID, true)
}

// waitIdle waits until no work of requestID is queued or on the wire here;
// a dead path ends the wait early only when untilDead (a notification has
// nothing to wait for there; a drain must see every completion).
func (e *Endpoint) waitIdle(ctx context.Context, requestID uint64, untilDead bool) error {
	defer e.wakeOn(ctx)()
	e.mu.Lock()
	defer e.mu.Unlock()
	for e.busyLocked(requestID) && !(untilDead && e.dead) {
		if ctx.Err() != nil {
			return fmt.Errorf("rdma: wait for request %d: %w", requestID, ctx.Err())
		}
		e.cond.Wait()
	}
	return nil
}

// sendCtx is a notification SEND in flight.
type sendCtx struct {
	slot int
	done chan uint32
}

// sent takes a notification SEND's completion (on the poller).
func (e *Endpoint) sent(c *wrCtx, status uint32) {
	e.mu.Lock()
	c.pair.inflight--
	c.pair.progress = time.Now()
	if status != verbs.WCSuccess {
		e.breakPair(c.pair, fmt.Errorf("notification SEND: status %d", status))
	}
	e.cond.Broadcast()
	e.mu.Unlock()
	c.pair.nic.slots.put(c.send.slot)
	c.send.done <- status
}
