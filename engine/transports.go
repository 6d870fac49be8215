package engine

import (
	"context"
	"fmt"

	"github.com/kvferry/kvferry/engine/control"
	"github.com/kvferry/kvferry/engine/internal/bounded"
	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/engine/transport/rdma"
	"github.com/kvferry/kvferry/engine/transport/shm"
)

// The abilities the engine relies on, beyond transport.Transport, that the
// rdma transport has: checked here at build time, so that a renamed method
// fails the build rather than quietly turning an ability off.
var _ interface {
	transport.Fencer
	transport.FenceSwitch
	transport.InitiatorLister
	transport.HandshakeServer
	transport.UncertainTracker
	transport.AccessTracker
	transport.OwnerCopier
} = (*rdma.Transport)(nil)

// abilities is what one of the engine's transports can do beyond
// transport.Transport, found by type assertion once, in abilitiesOf, so
// that Abort, Fence, Revoke and the drain all decide the same way which
// fence applies.
type abilities struct {
	t transport.Transport
	// ownerCopies: the owner's own code copies every byte (tcp, local), so
	// refusal chunk by chunk fences its accesses.
	ownerCopies bool
	// fencer is the transport's owner-side fence of an initiator (rdma:
	// its responder QPs to the error state), nil when it has none.
	fencer transport.Fencer
	// fenceOff: the transport's fence is switched off (FenceSwitch); its
	// Fencer, if any, is not used then.
	fenceOff bool
	// tracker names the initiators holding access to a request ahead of
	// its bytes (rdma rkeys).
	tracker transport.AccessTracker
	// initiators lists the initiators connected now, which a fence by
	// memory range cuts.
	initiators transport.InitiatorLister
	// handshakes serves the transport's requests on the control plane.
	handshakes transport.HandshakeServer
	// uncertain tells work of a request lost without the owner's answer.
	uncertain transport.UncertainTracker
}

// abilitiesOf finds what t can do, by type assertion on its optional
// interfaces (see package transport).
func abilitiesOf(t transport.Transport) abilities {
	a := abilities{t: t}
	if c, ok := t.(transport.OwnerCopier); ok {
		a.ownerCopies = c.OwnerCopies()
	}
	a.fencer, _ = t.(transport.Fencer)
	if sw, ok := t.(transport.FenceSwitch); ok {
		a.fenceOff = !sw.FenceEnabled()
	}
	a.tracker, _ = t.(transport.AccessTracker)
	a.initiators, _ = t.(transport.InitiatorLister)
	a.handshakes, _ = t.(transport.HandshakeServer)
	a.uncertain, _ = t.(transport.UncertainTracker)
	return a
}

// fence returns the transport's owner-side fence when it has one and it is
// on, nil otherwise.
func (a *abilities) fence() transport.Fencer {
	if a.fenceOff {
		return nil
	}
	return a.fencer
}

// servers returns the abilities of the transports that serve accesses to
// our memory: every transport of the engine, found once the transports are
// up (New).
func (e *Engine) servers() []abilities { return e.transports }

// findTransports records the abilities of the engine's transports; New
// calls it once they are up.
func (e *Engine) findTransports() {
	e.transports = []abilities{abilitiesOf(e.tcp), abilitiesOf(e.local)}
	if e.shm != nil {
		e.transports = append(e.transports, abilitiesOf(e.shm))
	}
	if e.rdma != nil {
		e.transports = append(e.transports, abilitiesOf(e.rdma))
	}
}

// startRDMA opens the RDMA transport unless the protocol is tcp. With
// "auto" an engine without RDMA goes on with tcp; with "rdma" it fails.
func (e *Engine) startRDMA() error {
	if e.opts.Protocol == "tcp" || e.opts.Protocol == "shm" {
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

// startSHM opens the same-host transport unless the protocol is tcp or
// rdma, or authentication is on: its peers are the processes of our user
// on this host, which the kernel names, not the keys of the allowlist, so
// an engine that authenticates takes them over tcp. With "shm" forced, a
// failure fails New; with "auto" the engine goes on without it.
func (e *Engine) startSHM() error {
	if e.opts.Protocol == "tcp" || e.opts.Protocol == "rdma" {
		return nil
	}
	if e.auth != nil {
		if e.opts.Protocol == "shm" {
			return fmt.Errorf("protocol shm: %w: the same-host transport does not authenticate by key; turn authentication off or use tcp", ErrUnsupported)
		}
		e.log.Debug("kvferry: shm not used: authentication is on, peers on this host go over tcp")
		return nil
	}
	t, err := shm.New(shm.Options{IOTimeout: e.opts.IOTimeout, Logger: e.log, ApplyDelay: e.opts.Testing.ApplyDelay, GPU: ipcGPU{e}})
	if err == nil {
		var addr string
		if addr, err = t.Listen(e); err == nil {
			e.shm = t
			e.reg.Watch(t)
			e.desc.Transports = append(e.desc.Transports, control.TransportAddr{Name: "shm", Addr: addr})
			e.log.Debug("kvferry: shm transport up", "addr", addr, "attach", shm.AttachPolicy())
			return nil
		}
		_ = t.Close()
	}
	if e.opts.Protocol == "shm" {
		return fmt.Errorf("protocol shm: %w: %w", ErrUnsupported, err)
	}
	e.log.Debug("kvferry: shm not used", "err", err)
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

// maxProtoSaid bounds the peers whose chosen transport is remembered as
// logged; past it the set starts afresh (a choice may be logged again).
const maxProtoSaid = 1 << 16

// newProtoSaid returns the empty set of peers whose transport choice was
// logged, each with the transport: at its cap it keeps only the newest
// (Trim 1), as nothing safety-relevant rests on it.
func newProtoSaid() *bounded.Set[string, string] {
	return bounded.New(bounded.Options[string, string]{Cap: maxProtoSaid, Trim: 1})
}

// chooseTransport picks the transport to a peer from its descriptor, and
// logs the choice once per peer.
func (e *Engine) chooseTransport(peer string, d *control.Descriptor) (string, error) {
	_, peerRDMA := d.Transport("rdma")
	shmAddr, peerSHM := d.Transport("shm")
	sameHost := e.shm != nil && peerSHM && e.shm.SameHost(shmAddr)
	proto := "tcp"
	why := "forced by the protocol option"
	switch e.opts.Protocol {
	case "shm":
		if !sameHost {
			return "", fmt.Errorf("%w: segment %s is not reachable by shm: not on this host, or it offers no shm (protocol shm is forced)", ErrUnsupported, peer)
		}
		proto = "shm"
	case "rdma":
		if !peerRDMA {
			return "", fmt.Errorf("%w: segment %s offers no rdma transport (protocol rdma is forced)", ErrUnsupported, peer)
		}
		proto = "rdma"
	case "auto":
		switch {
		case sameHost:
			proto, why = "shm", "same host (boot id "+e.shm.BootID()+"); "+shm.AttachPolicy()
		case e.rdma != nil && peerRDMA:
			proto, why = "rdma", "both ends have rdma"
		case e.rdma == nil:
			why = "no rdma device here"
		default:
			why = "the peer has no rdma"
		}
	}
	e.protoMu.Lock()
	said, _ := e.protoSaid.Get(peer)
	if said != proto {
		e.protoSaid.Put(peer, proto)
	}
	e.protoMu.Unlock()
	if said != proto {
		e.log.Info("kvferry: transport chosen", "peer", peer, "transport", proto, "why", why)
	}
	return proto, nil
}
