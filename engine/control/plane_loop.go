package control

// The loop goroutine: it polls the STREAM socket and the wake socket, runs
// the queued ops, feeds received bytes to each connection's ZMTP reader, and
// sweeps connections past their deadlines.

import (
	"errors"
	"fmt"
	"syscall"
	"time"

	zmq "github.com/pebbe/zmq4"
)

// loop owns the STREAM socket, the wake PULL and every connection.
func (p *Plane) loop() {
	defer close(p.done)
	poller := zmq.NewPoller()
	poller.Add(p.stream, zmq.POLLIN)
	poller.Add(p.wakeRecv, zmq.POLLIN)
	defer func() {
		for _, c := range p.conns {
			if c.rd != nil {
				c.rd.drop()
			}
		}
		_ = p.stream.Close()
		_ = p.wakeRecv.Close()
	}()
	lastSweep := time.Now()
	wait := tick
	for {
		polled, err := poller.Poll(wait)
		if err != nil {
			if zmq.AsErrno(err) == zmq.Errno(4) { // EINTR
				continue
			}
			p.log.Error("control: poll failed; control plane stopped", "err", err)
			return
		}
		for _, it := range polled {
			switch it.Socket {
			case p.wakeRecv:
				for {
					if _, err := p.wakeRecv.RecvBytes(zmq.DONTWAIT); err != nil {
						break
					}
				}
			case p.stream:
				p.drain()
			}
		}
		if now := time.Now(); now.Sub(lastSweep) >= tick {
			lastSweep = now
			p.sweep(now)
		}
		// At most maxOps of our own sends per turn, as at most maxDrain
		// messages of the peers': callers sending faster than the loop
		// must not keep it from the socket's notices and its deadlines.
		p.opMu.Lock()
		ops, closed := p.ops, p.closed
		p.ops = nil
		if len(ops) > maxOps {
			ops, p.ops = ops[:maxOps], ops[maxOps:]
		}
		wait = tick
		if len(p.ops) > 0 {
			wait = 0 // more to do: poll without waiting
		} else if len(p.backlogged) > 0 {
			wait = time.Millisecond // libzmq tells no room in one connection's queue: look again soon
		}
		p.opMu.Unlock()
		if closed {
			return
		}
		for _, o := range ops {
			p.run(o)
		}
		for _, c := range p.outPeer {
			if len(c.queue) > 0 && c.ready() {
				p.flush(c) // what a full send queue held back
			}
		}
		for c := range p.backlogged {
			p.drainBacklog(c)
		}
	}
}

// run carries out one op on the loop.
func (p *Plane) run(o op) {
	if o.fn != nil {
		o.fn()
		return
	}
	if o.close {
		if c := p.outPeer[o.peer]; c != nil {
			p.dropOutbound(c)
		}
		return
	}
	if o.peer == p.name {
		p.runLocal(o)
		return
	}
	msg := encodeMessage(o.frames)
	if o.noDial {
		// An answer to a name anyone may claim: our own connection to
		// that address, when we have one, is the peer itself; a
		// connection that merely claims the name comes second.
		if c := p.outPeer[o.peer]; c != nil && c.ready() && len(c.queue) < p.opts.MaxQueued {
			c.used = time.Now()
			c.queue = append(c.queue, msg)
			p.flush(c)
			return
		}
	}
	if o.oneway {
		if c := p.newestNamed(o.peer); c != nil {
			// As a reply: in order with the replies on that connection,
			// and kept in its bounded backlog while the socket is full
			// (a burst of FENCEs or ABORTs to a busy peer), not dropped.
			p.reply(c, msg)
			return
		}
		// No connection from the peer: go through ours.
	}
	c := p.outPeer[o.peer]
	if c == nil {
		if o.noDial {
			p.stats.sendFails.Add(1)
			return
		}
		var err error
		if c, err = p.dial(o.peer); err != nil {
			p.failOp(o, err)
			return
		}
	}
	c.used = time.Now()
	if len(c.queue) >= p.opts.MaxQueued {
		p.failOp(o, fmt.Errorf("%w: %d messages queued for %s", ErrOverBudget, len(c.queue), o.peer))
		return
	}
	c.queue = append(c.queue, msg)
	if c.ready() {
		p.flush(c) // else the peer's READY flushes it (becameReady)
	}
}

// ready reports whether our connection c is up and past the peer's READY,
// so messages may go out on it.
func (c *conn) ready() bool { return c.live && c.rd != nil && c.rd.ready }

// flush sends c's queued messages in order while libzmq takes them. A full
// send queue (EAGAIN: the peer reads slowly) keeps the rest for a later
// turn of the loop; an ended pipe queues them for a new connection.
func (p *Plane) flush(c *conn) {
	for len(c.queue) > 0 {
		err := p.sendMsg(c, c.queue[0])
		switch {
		case err == nil:
		case zmq.AsErrno(err) == zmq.Errno(syscall.EAGAIN):
			return
		case zmq.AsErrno(err) == zmq.Errno(syscall.EHOSTUNREACH):
			// libzmq ended the connection's pipe: a new connection,
			// dialed at the next sweep, takes the queue.
			p.retire(c)
			return
		default:
			p.stats.sendFails.Add(1)
		}
		c.queue[0] = nil
		c.queue = c.queue[1:]
	}
	c.queue = nil
}

// runLocal hands a message to our own name to our handlers, as if it had
// come over a connection from us. A connection to our own bound endpoint
// cannot be closed: libzmq's zmq_disconnect("tcp://<name>") matches the
// bind as well as the connect, and tears down the listener with every
// connection it accepted.
func (p *Plane) runLocal(o op) {
	p.stats.received.Add(1)
	body := append([]byte(nil), o.body...) // the handler may keep it; the caller may reuse it
	h := p.handlers[o.typ]
	if o.oneway {
		if h != nil {
			h(p.name, body)
		}
		return
	}
	rt, rb := MsgError, []byte(fmt.Sprintf("no handler for %s", o.typ))
	if h != nil {
		rt, rb = h(p.name, body)
	}
	if !rt.IsReply() {
		p.malformed("reply", p.name, fmt.Errorf("%w: %s is not a reply", ErrMalformed, rt))
		return
	}
	p.deliver(o.corr, p.name, reply{env: Envelope{Type: rt, Corr: o.corr}, body: append([]byte(nil), rb...)})
}

// failOp counts a send that failed and answers its requester at once.
func (p *Plane) failOp(o op, err error) {
	p.stats.sendFails.Add(1)
	if !o.oneway {
		p.deliver(o.corr, o.peer, reply{env: Envelope{Type: MsgError}, body: []byte(err.Error())})
	}
}

// sendRaw writes bytes on the connection with routing id id.
func (p *Plane) sendRaw(id string, b []byte) error {
	_, err := p.stream.SendMessageDontwait(id, b)
	return err
}

// maxDrain bounds the STREAM messages (a read of up to 8 KiB from one
// connection, or a connection's notice) one loop turn handles. libzmq reads
// a connection's bytes far faster than the loop handles the requests in
// them, so draining until the socket is empty let a few peers writing
// requests nonstop keep the loop from our own sends and from its deadlines.
const maxDrain = 64

// maxOps bounds the ops (our own sends) one loop turn runs.
const maxOps = 256

// drain reads what is waiting on the STREAM socket, up to maxDrain
// messages: connection events (an empty message: the connection opened, or
// closed if we knew it) and bytes. The loop's next poll returns at once for
// the rest.
func (p *Plane) drain() {
	for range maxDrain {
		msg, meta, err := p.stream.RecvMessageBytesWithMetadata(zmq.DONTWAIT, "Peer-Address")
		if err != nil {
			return
		}
		if len(msg) != 2 {
			continue // a STREAM socket always delivers routing id and data
		}
		id, data := string(msg[0]), msg[1]
		c := p.conns[id]
		if len(data) == 0 {
			switch {
			case c == nil && id != "" && id[0] == 0:
				p.accept(id, meta["Peer-Address"])
			case c == nil: // the end of an outbound connection we dropped
			case c.inbound:
				p.forgetInbound(c)
			case c.live: // our connection went down: a new one replaces it
				p.retire(c)
			default: // our connection came up
				c.live, c.since = true, time.Now()
				c.rd = p.newReader(c)
				if p.opts.Auth == nil {
					_ = p.sendRaw(c.id, append(zmtpGreeting(), zmtpReady("DEALER", p.name)...))
				} else if err := p.secure(c, false); err != nil {
					p.retire(c)
				}
			}
			continue
		}
		if c == nil || c.rd == nil {
			continue // bytes of a connection we closed
		}
		p.feed(c, data)
	}
}

// accept takes a new inbound connection, or refuses it past the caps.
func (p *Plane) accept(id, host string) {
	if int(p.stats.conns.Load()) >= p.opts.MaxConns || p.perHost[host] >= p.opts.MaxConnsPerHost {
		p.stats.refused.Add(1)
		if err := p.sendRaw(id, nil); err != nil && zmq.AsErrno(err) == zmq.Errno(syscall.EAGAIN) {
			// The peer is already gone and its notice is on its way: keep
			// the id until it comes (see closeInbound).
			p.conns[id] = &conn{id: id, inbound: true, host: host, name: id, closing: true}
			p.perHost[host]++
			p.stats.conns.Add(1)
		}
		p.warn.Warn("refused", "control: connection refused: too many connections",
			"peer_address", host, "total", int(p.stats.conns.Load()), "from_address", p.perHost[host],
			"max", p.opts.MaxConns, "max_per_address", p.opts.MaxConnsPerHost)
		return
	}
	c := &conn{id: id, inbound: true, host: host, since: time.Now(), name: id}
	c.rd = p.newReader(c)
	p.conns[id] = c
	p.perHost[host]++
	p.stats.conns.Add(1)
	if p.opts.Auth == nil {
		_ = p.sendRaw(id, append(zmtpGreeting(), zmtpReady("ROUTER", "")...))
	} else if err := p.secure(c, true); err != nil {
		p.closeInbound(c)
	}
}

// feed parses bytes of connection c and handles the messages they end.
func (p *Plane) feed(c *conn, data []byte) {
	ended := false
	emit := func(frames [][]byte, dropped error) {
		ended = true
		c.used = time.Now()
		p.stats.received.Add(1)
		if dropped != nil {
			p.malformed("message", c.name, dropped)
			return
		}
		if c.inbound {
			p.handleRequest(c, frames)
		} else {
			p.handleReply(c, frames)
		}
	}
	var err error
	if c.sec != nil {
		err = p.feedSecure(c, data, emit)
	} else {
		err = c.rd.feed(data, emit)
	}
	if c.rd == nil {
		return // refused for authentication: already closed
	}
	if err != nil {
		p.stats.cut.Add(1)
		p.warn.Warn("proto", "control: connection closed: protocol error", "peer", c.name, "address", c.host, "err", err)
		p.cut(c)
		return
	}
	switch {
	case !c.rd.inMessage() && (c.sec == nil || !c.sec.out.partial()):
		c.msgSince = time.Time{}
	case ended || c.msgSince.IsZero():
		c.msgSince = time.Now()
	}
}

// becameReady runs once when c's peer completed the handshake.
func (p *Plane) becameReady(c *conn) error {
	if c.inbound {
		switch c.rd.socketType {
		case "DEALER", "ROUTER":
		default:
			return fmt.Errorf("%w: peer socket type %q", errProtocol, c.rd.socketType)
		}
		if c.rd.identity != "" {
			c.name = c.rd.identity
		}
		p.named[c.name] = append(p.named[c.name], c) // the newest connection of a name takes its messages
		p.namedMu.Lock()
		p.namedLive[c.name] = struct{}{}
		p.namedMu.Unlock()
		return nil
	}
	p.flush(c)
	return nil
}

// cut closes a connection that broke the protocol or timed out.
func (p *Plane) cut(c *conn) {
	if c.inbound {
		p.closeInbound(c)
	} else {
		p.dropOutbound(c)
	}
}

// sweep closes connections past their deadlines.
func (p *Plane) sweep(now time.Time) {
	for _, c := range p.outPeer {
		if c.id != "" && c.live {
			continue // up: its reader's deadlines apply, below
		}
		// Not connected. Messages queued for longer than PeerIdleTimeout
		// are stale (their requests have given up): drop them with the
		// connection, or a peer that never answers keeps a socket
		// redialing for ever.
		switch {
		case now.Sub(c.used) > p.opts.PeerIdleTimeout:
			p.dropOutbound(c)
			continue
		case c.id != "" && now.Sub(c.since) > redialIvl:
			p.retire(c) // not up yet: dial again, below
		}
		if c.id == "" { // retired: dial again, as libzmq would have
			if err := p.connect(c); err != nil {
				p.warn.Warn("redial:"+c.name, "control: redial failed", "peer", c.name, "err", err)
				p.dropOutbound(c)
			}
		}
	}
	for _, c := range p.conns {
		if c.closing {
			p.closeInbound(c) // again: libzmq refused the last close
			continue
		}
		if !c.inbound && now.Sub(c.used) > p.opts.PeerIdleTimeout {
			p.dropOutbound(c) // idle: nothing lost, the next send dials again
			continue
		}
		if c.rd == nil {
			continue
		}
		var why string
		switch {
		case c.inbound && len(c.backlog) > 0 && now.Sub(c.blSince) > stallTimeout:
			why = "it does not read its replies"
		case !c.rd.ready && now.Sub(c.since) > p.opts.HandshakeTimeout:
			why = "handshake not completed"
		case !c.msgSince.IsZero() && now.Sub(c.msgSince) > p.opts.MessageTimeout:
			why = "message not completed"
		default:
			continue
		}
		p.stats.cut.Add(1)
		p.warn.Warn("timeout", "control: connection closed: "+why, "peer", c.name, "address", c.host)
		p.cut(c)
	}
}

func (p *Plane) malformed(what, peer string, err error) {
	p.stats.malformed.Add(1)
	if errors.Is(err, ErrOverBudget) {
		p.warn.Warn("budget", "control: dropped "+what, "peer", peer, "err", err)
		return
	}
	p.warn.Warn("malformed", "control: dropped malformed "+what, "peer", peer, "err", err)
}
