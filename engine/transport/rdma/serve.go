// The owner's side of the handshake: TRANSPORT requests from initiators
// (NIC info, connects, releases, disconnects) and the responder QPs they
// make.

package rdma

import (
	"fmt"
	"math/rand/v2"

	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/verbs"
)

// Serve answers one TRANSPORT request from peer (on the control plane's
// loop); the reply is the body, or an error the engine sends as an ERROR
// reply.
func (t *Transport) Serve(from string, body []byte) ([]byte, error) {
	if !t.enter() {
		return nil, transport.ErrClosed
	}
	defer t.leave()
	if len(body) == 0 {
		return nil, fmt.Errorf("%w: empty", ErrMalformed)
	}
	switch body[0] {
	case kindInfo:
		if len(body) != 2 || body[1] != wireVersion {
			return nil, fmt.Errorf("%w: info request of %d bytes", ErrMalformed, len(body))
		}
		return t.info().encode(), nil
	case kindConnect:
		req, err := decodeConnect(body)
		if err != nil {
			return nil, err
		}
		return t.serveConnect(from, req)
	case kindKeys:
		req, err := decodeKeys(body)
		if err != nil {
			return nil, err
		}
		return t.serveKeys(from, req)
	case kindRelease:
		m, err := decodeRelease(body)
		if err != nil {
			return nil, err
		}
		t.holds.release(from, m.Conn, m.Seq, m.RequestIDs)
		t.stats.Releases.Add(1)
		return []byte{kindRelease, wireVersion}, nil
	case kindDisconnect:
		if len(body) != 10 || body[1] != wireVersion {
			return nil, fmt.Errorf("%w: disconnect of %d bytes", ErrMalformed, len(body))
		}
		t.dropConn(from, leU64(body[2:]))
		return []byte{kindDisconnect, wireVersion}, nil
	}
	return nil, fmt.Errorf("%w: kind %d", ErrMalformed, body[0])
}

func leU64(b []byte) uint64 {
	var v uint64
	for i := 7; i >= 0; i-- {
		v = v<<8 | uint64(b[i])
	}
	return v
}

func (t *Transport) info() *infoReply {
	m := &infoReply{}
	m.Matrix, m.Tiers = t.matrix()
	for _, n := range t.nics {
		m.NICs = append(m.NICs, nicInfo{
			Name: trunc(n.Name), Port: uint8(n.Port.Num), Ethernet: n.Port.Ethernet(), MTU: uint8(n.Port.ActiveMTU),
			LID: n.Port.LID, GID: n.Port.GID, GIDIndex: uint8(max(n.Port.GIDIndex, 0)),
			NUMA: int16(n.Placement.NUMANode), PCI: trunc(n.Placement.PCIAddress),
		})
	}
	return m
}

func trunc(s string) string {
	if len(s) > maxName {
		return s[:maxName]
	}
	return s
}

// DefaultMaxResponderQPs caps the QPs an owner makes for initiators
// connected to it, all together (a legitimate initiator engine needs PathsPerPeer paths
// of at most 16 NIC pairs: 64 at the defaults, 1024 at most). Past it a
// connect request is refused and the initiator's transfer fails over to
// tcp or fails.
const DefaultMaxResponderQPs = 16384

func (t *Transport) serveConnect(from string, req *connectReq) ([]byte, error) {
	for _, p := range req.Pairs {
		if int(p.Remote) >= len(t.nics) {
			return nil, fmt.Errorf("%w: pair names NIC %d of %d", ErrMalformed, p.Remote, len(t.nics))
		}
	}
	if t.opts.AdmitInitiator != nil {
		if err := t.opts.AdmitInitiator(from); err != nil {
			return nil, err // early, to spare the QPs; checked again below
		}
	}
	// Every QP counts against Options.MaxResponderQPs from before it is made: any
	// peer can ask, under any name, and QPs are the NIC's to lose.
	reserved := int64(len(req.Pairs))
	if n := t.stats.respQPs.Add(reserved); n > int64(t.opts.MaxResponderQPs) {
		t.stats.respQPs.Add(-reserved)
		t.stats.ConnectsRefused.Add(1)
		return nil, fmt.Errorf("rdma: %d responder QPs in use, %d more asked (at most %d)", n-reserved, reserved, t.opts.MaxResponderQPs)
	}
	// The QPs are made without connMu, so a Fence never waits for verbs
	// calls; nothing reaches them before the initiator has the reply.
	reply := &connectReply{}
	var made []*verbs.QP
	drop := func() {
		for _, q := range made {
			_ = q.ToError()
			_ = q.Destroy()
		}
		t.stats.respQPs.Add(-reserved)
	}
	for _, p := range req.Pairs {
		n := t.nics[p.Remote]
		qp, err := t.connectQP(n, verbs.Remote{QPN: p.QP.QPN, PSN: p.QP.PSN, LID: p.LID, GID: p.GID, Global: p.Ethernet || n.Port.Ethernet(), MTU: verbs.MTU(p.MTU)})
		if err != nil {
			drop()
			return nil, err
		}
		made = append(made, qp.qp)
		reply.QPs = append(reply.QPs, qpInfo{QPN: qp.qp.Num, PSN: qp.psn})
	}
	// The gate and the QPs' entry into conns happen under connMu, which
	// Fence holds too: a connection is either fenced or refused.
	t.connMu.Lock()
	defer t.connMu.Unlock()
	if t.opts.AdmitInitiator != nil {
		if err := t.opts.AdmitInitiator(from); err != nil {
			drop()
			return nil, err
		}
	}
	byConn := t.conns[from]
	if byConn == nil {
		if len(t.conns) >= 4096 {
			drop()
			return nil, fmt.Errorf("rdma: too many initiators connected")
		}
		byConn = map[uint64]*respConn{}
		t.conns[from] = byConn
	}
	rc := byConn[req.Conn]
	if rc == nil {
		if len(byConn) >= 1024 {
			drop()
			return nil, fmt.Errorf("rdma: too many connections from %s", from)
		}
		rc = &respConn{qps: map[uint8]*verbs.QP{}}
		byConn[req.Conn] = rc
	}
	for i, p := range req.Pairs {
		if old := rc.qps[p.Slot]; old != nil {
			t.destroyResponder(old)
		}
		rc.qps[p.Slot] = made[i]
		if err := t.postRecvs(t.nics[p.Remote], made[i], from, recvsPerQP); err != nil {
			t.log.Warn("kvferry: rdma receives for notifications not posted", "peer", from, "err", err)
		}
	}
	return reply.encode(), nil
}

type connectedQP struct {
	qp  *verbs.QP
	psn uint32
}

// connectQP creates a QP on n and takes it to RTS connected to r. The
// owner's QPs only respond, but RTS costs nothing and lets the same code
// serve both ends.
func (t *Transport) connectQP(n *NIC, r verbs.Remote) (*connectedQP, error) {
	qp, err := n.pd.CreateQP(n.cq, n.cq, n.maxWR, 16, verbs.MaxInline)
	if err != nil {
		return nil, err
	}
	psn := rand.Uint32() & 0xffffff
	if err := t.bringUp(qp, n, r, psn); err != nil {
		_ = qp.Destroy()
		return nil, err
	}
	return &connectedQP{qp: qp, psn: psn}, nil
}

func (t *Transport) bringUp(qp *verbs.QP, n *NIC, r verbs.Remote, psn uint32) error {
	access := verbs.AccessLocalWrite | verbs.AccessRemoteWrite | verbs.AccessRemoteRead
	if err := qp.ToInit(n.Port.Num, access); err != nil {
		return err
	}
	if err := t.toRTR(qp, n, r); err != nil {
		return err
	}
	return qp.ToRTS(psn, t.opts.Timeout, t.opts.RetryCount)
}

func (t *Transport) toRTR(qp *verbs.QP, n *NIC, r verbs.Remote) error {
	mtu := min(n.Port.ActiveMTU, r.MTU)
	return qp.ToRTR(r, n.Port.Num, mtu, n.Port.GIDIndex)
}

func (t *Transport) dropConn(from string, conn uint64) {
	t.connMu.Lock()
	rc := t.conns[from][conn]
	delete(t.conns[from], conn)
	t.holds.dropConn(from, conn)
	if len(t.conns[from]) == 0 {
		delete(t.conns, from)
		// No QP of it is left: the rkeys it holds reach nothing until it
		// connects again, and its engine asks again after that.
		t.holds.forget(from)
	}
	if rc != nil {
		// In the error state before connMu is let go: a Fence racing
		// this no longer sees these QPs and must not find them live.
		for _, q := range rc.qps {
			_ = q.ToError()
		}
	}
	t.connMu.Unlock()
	if rc != nil {
		for _, q := range rc.qps {
			t.destroyResponder(q)
		}
	}
}
