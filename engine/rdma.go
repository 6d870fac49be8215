package engine

import (
	"context"
	"errors"
	"fmt"

	"github.com/kvferry/kvferry/engine/control"
	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/engine/transport/rdma"
)

// startRDMA opens the RDMA transport unless the protocol is tcp. With
// "auto" an engine without RDMA goes on with tcp; with "rdma" it fails.
func (e *Engine) startRDMA() error {
	if e.opts.Protocol == "tcp" {
		return nil
	}
	t, err := rdma.New(rdma.Options{
		Library: e.opts.RDMALibrary, Devices: e.opts.RDMADevices, Exchange: e.exchange,
		AdmitInitiator: e.admitInitiator, Fence: !e.opts.RDMANoFence, Logger: e.log,
		OnNotify: e.notified, DmaBuf: e.dmaBuf,
		RetryCount: uint8(e.opts.RDMARetryCount), CompletionTimeout: e.opts.RDMACompletionTimeout,
	})
	if err != nil {
		if e.opts.Protocol == "rdma" {
			return fmt.Errorf("protocol rdma: %w: %w", ErrUnsupported, err)
		}
		e.log.Debug("kvferry: rdma not used; tcp only", "err", err)
		return nil
	}
	if _, err := t.Listen(e); err != nil {
		_ = t.Close()
		return err
	}
	e.rdma = t
	e.reg.Watch(t)
	e.desc.Transports = append(e.desc.Transports, control.TransportAddr{Name: "rdma", Addr: t.DescriptorAddr()})
	e.log.Info("kvferry: rdma transport up", "nics", t.NICNames())
	return nil
}

// exchange carries an rdma handshake request to peer's transport.
func (e *Engine) exchange(ctx context.Context, peer string, body []byte) ([]byte, error) {
	typ, rep, err := e.plane.Request(ctx, peer, control.MsgTransport, body)
	if err != nil {
		return nil, err
	}
	switch typ {
	case control.MsgTransportRep:
		return rep, nil
	case control.MsgError:
		return nil, fmt.Errorf("%w: %s", control.ErrRemote, truncate(string(rep), 256))
	}
	return nil, fmt.Errorf("%w: %v answers a transport request", control.ErrMalformed, typ)
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

// handleTransport serves a peer's rdma handshake request (on the plane's
// loop: the work is a few verbs calls).
func (e *Engine) handleTransport(from string, body []byte) (control.MsgType, []byte) {
	if e.rdma == nil {
		return control.MsgError, []byte("no rdma transport here")
	}
	rep, err := e.rdma.Serve(from, body)
	if err != nil {
		if errors.Is(err, rdma.ErrFencePending) {
			e.log.Debug("kvferry: rdma connect refused until the abort is acknowledged", "peer", from)
		} else {
			e.controlMalformed("TRANSPORT", from, err)
		}
		return control.MsgError, []byte(err.Error())
	}
	return control.MsgTransportRep, rep
}

// chooseTransport picks the transport to a peer from its descriptor, and
// logs the choice once per peer.
func (e *Engine) chooseTransport(peer string, d *control.Descriptor) (string, error) {
	_, peerRDMA := d.Transport("rdma")
	proto := "tcp"
	why := "forced by the protocol option"
	switch e.opts.Protocol {
	case "rdma":
		if !peerRDMA {
			return "", fmt.Errorf("%w: segment %s offers no rdma transport (protocol rdma is forced)", ErrUnsupported, peer)
		}
		proto = "rdma"
	case "auto":
		switch {
		case e.rdma != nil && peerRDMA:
			proto, why = "rdma", "both ends have rdma"
		case e.rdma == nil:
			why = "no rdma device here"
		default:
			why = "the peer has no rdma"
		}
	}
	e.protoMu.Lock()
	said := e.protoSaid[peer]
	if said != proto && len(e.protoSaid) < 1<<16 {
		e.protoSaid[peer] = proto
	}
	e.protoMu.Unlock()
	if said != proto {
		e.log.Info("kvferry: transport chosen", "peer", peer, "transport", proto, "why", why)
	}
	return proto, nil
}

// admitInitiator refuses an initiator's new QPs while it owes the ACK of
// an abort whose fence cut its old ones, and sends those ABORTs again: an
// ACK lost after the abort's deadline must not lock it out for good.
func (e *Engine) admitInitiator(initiator string) error {
	e.fenceMu.Lock()
	pend := make([]abortKey, 0, len(e.fenced[initiator]))
	for k := range e.fenced[initiator] {
		pend = append(pend, k)
	}
	e.fenceMu.Unlock()
	if len(pend) == 0 {
		return nil
	}
	for _, k := range pend {
		_ = e.plane.Send(initiator, control.MsgAbort, control.AbortMsg{RequestID: k.rid, Generation: k.gen}.Encode())
	}
	return fmt.Errorf("%w: %d aborts of %s unacknowledged", rdma.ErrFencePending, len(pend), initiator)
}

// maxFenceDebts bounds the unacknowledged fences remembered. They are not
// forgotten to make room: an initiator whose debt was dropped could connect
// again without knowing of the abort. Past the bound, Abort reports not
// Safe instead of fencing.
const maxFenceDebts = 1 << 20

// noteFence records, before the fence, that initiator owes an ACK for k.
func (e *Engine) noteFence(initiator string, k abortKey) error {
	e.fenceMu.Lock()
	defer e.fenceMu.Unlock()
	m := e.fenced[initiator]
	if _, ok := m[k]; ok {
		return nil
	}
	if e.nfenced >= maxFenceDebts {
		return fmt.Errorf("%d rdma fences await their initiators' ACKs (at most %d): %w", e.nfenced, maxFenceDebts, ErrBusy)
	}
	if m == nil {
		m = map[abortKey]struct{}{}
		e.fenced[initiator] = m
	}
	m[k] = struct{}{}
	e.nfenced++
	return nil
}

// ackedFence clears initiator's debt for k.
func (e *Engine) ackedFence(initiator string, k abortKey) {
	e.fenceMu.Lock()
	if m := e.fenced[initiator]; m != nil {
		if _, ok := m[k]; ok {
			delete(m, k)
			e.nfenced--
		}
		if len(m) == 0 {
			delete(e.fenced, initiator)
		}
	}
	e.fenceMu.Unlock()
}

// recheck is every slice's Recheck: a transport posting a slice again on
// its own first asks whether its task was aborted or canceled meanwhile.
func (t *task) recheck(*transport.Slice) error {
	if f := TaskStatus(t.final.Load()); f != 0 {
		return fmt.Errorf("%w: task ended %s", transport.ErrCanceled, f)
	}
	e := t.b.e
	e.abortMu.RLock()
	aborted := e.segAbortedLocked(t.req.Segment, t.req.RequestID, t.req.Generation)
	e.abortMu.RUnlock()
	if aborted {
		return fmt.Errorf("%w: %w: request %d", transport.ErrRefused, transport.ErrAborted, t.req.RequestID)
	}
	if t.fenceVoid() {
		return fmt.Errorf("%w: %w: planned at fence epoch %d", transport.ErrRefused, transport.ErrFenced, t.epoch)
	}
	return nil
}

// notified queues a notification that arrived in-band over rdma. Unlike one
// on the control plane it cannot be refused: when the event queue is full
// it is dropped and counted (Stats.EventsDropped).
func (e *Engine) notified(from string, requestID uint64, data []byte) {
	if e.emit(Event{Kind: EventNotify, Peer: from, RequestID: requestID, Data: data}) {
		e.stats.notifications.Add(1)
	}
}

// inbandNotifier is an endpoint that carries notifications on its own
// queue pairs (rdma).
type inbandNotifier interface {
	Quiet(ctx context.Context, requestID uint64) error
	Notify(ctx context.Context, requestID uint64, data []byte) error
}

// notifyInband sends a notification on seg's rdma paths, after every work
// request of requestID on any of them completed; ok is false when seg has
// no rdma path to carry it (the control plane then does).
func (e *Engine) notifyInband(ctx context.Context, seg *Segment, requestID uint64, data []byte) (ok bool, err error) {
	seg.mu.Lock()
	if seg.proto != "rdma" {
		seg.mu.Unlock()
		return false, nil
	}
	var eps []inbandNotifier
	for _, p := range seg.paths {
		if p == nil || p.ep.Dead() {
			continue
		}
		if n, ok := p.ep.(inbandNotifier); ok {
			eps = append(eps, n)
		}
	}
	seg.mu.Unlock()
	if len(eps) == 0 {
		return false, nil
	}
	for _, n := range eps {
		if err := n.Quiet(ctx, requestID); err != nil {
			return true, fmt.Errorf("notify %s: %w: %w", seg.name, ErrTimeout, err)
		}
	}
	if err := eps[0].Notify(ctx, requestID, data); err != nil {
		if ctx.Err() != nil {
			return true, fmt.Errorf("notify %s: %w: %w", seg.name, ErrTimeout, err)
		}
		return true, fmt.Errorf("notify %s: %w: %w", seg.name, ErrConnection, err)
	}
	return true, nil
}

// dmaBuf exports GPU memory for rdma registration: the dma-buf covers the
// pages around [addr, addr+n) (the driver wants whole pages).
func (e *Engine) dmaBuf(location string, addr, n uint64) (int, uint64, error) {
	dev := gpuOrdinal(location)
	drv, err := e.cuda()
	if err != nil || dev < 0 {
		return -1, 0, fmt.Errorf("dma-buf of %s: %w", location, ErrUnsupported)
	}
	const page = 4096
	base := addr &^ (page - 1)
	end := (addr + n + page - 1) &^ (page - 1)
	fd, err := drv.DmaBuf(dev, base, end-base)
	if err != nil {
		return -1, 0, err
	}
	return fd, addr - base, nil
}
