package engine

import (
	"context"
	"fmt"

	"github.com/kvferry/kvferry/engine/control"
	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/engine/transport/rdma"
)

// servers returns the transports that serve accesses to our memory.
func (e *Engine) servers() []transport.Transport {
	if e.rdma != nil {
		return []transport.Transport{e.tcp, e.local, e.rdma}
	}
	return []transport.Transport{e.tcp, e.local}
}

// ownerCopiesAll reports whether every transport serving peers copies bytes
// in the owner's own code, so that refusal fences them.
func (e *Engine) ownerCopiesAll() bool {
	for _, t := range e.servers() {
		if c, ok := t.(transport.OwnerCopier); !ok || !c.OwnerCopies() {
			return false
		}
	}
	return true
}

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
