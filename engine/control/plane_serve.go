package control

// The peers' side: answering their requests through the handlers, and the
// backlog of replies libzmq's send queue refused, kept in order and bounded.

import (
	"fmt"
	"syscall"
	"time"

	zmq "github.com/pebbe/zmq4"
)

// handleRequest answers one message a peer sent on its connection to us.
func (p *Plane) handleRequest(c *conn, frames [][]byte) {
	from := c.name
	if c.blBytes >= backlogBytes {
		// It does not read its replies: answering more would only queue
		// them. Its requests time out at its end.
		p.stats.sendFails.Add(1)
		return
	}
	env, err := DecodeEnvelope(frames[0])
	if err != nil {
		p.malformed("request", from, err)
		return
	}
	var body []byte
	if len(frames) == 2 {
		if body, err = UnpackBody(frames[1], env.Flags); err != nil {
			p.malformed("request", from, err)
			return
		}
	}
	h := p.handlers[env.Type]
	if env.Type.IsOneWay() {
		if h != nil {
			h(from, body)
		}
		return
	}
	rt, rb := MsgError, []byte(fmt.Sprintf("no handler for %s", env.Type))
	if h != nil {
		rt, rb = h(from, body)
	}
	packed, flags := PackBody(rb)
	out := [][]byte{EncodeEnvelope(Envelope{Type: rt, Flags: flags, Corr: env.Corr})}
	if len(rb) > 0 {
		out = append(out, packed)
	}
	p.reply(c, encodeMessage(out))
}

// reply sends a reply on inbound connection c, behind any backlog; what
// libzmq's send queue refuses joins the backlog while there is room.
func (p *Plane) reply(c *conn, msg []byte) {
	if len(c.backlog) == 0 {
		err := p.sendMsg(c, msg)
		if err == nil {
			return
		}
		if zmq.AsErrno(err) != zmq.Errno(syscall.EAGAIN) {
			p.stats.sendFails.Add(1)
			p.log.Debug("control: reply not sent", "peer", c.name, "err", err)
			return
		}
		c.blSince = time.Now()
		p.backlogged[c] = struct{}{}
	}
	if c.blBytes+len(msg) > backlogBytes && len(c.backlog) > 0 || p.blTotal+len(msg) > totalBacklogBytes {
		p.stats.sendFails.Add(1)
		return
	}
	c.backlog = append(c.backlog, msg)
	c.blBytes += len(msg)
	p.blTotal += len(msg)
}

// drainBacklog sends what c's backlog holds while libzmq takes it.
func (p *Plane) drainBacklog(c *conn) {
	for len(c.backlog) > 0 {
		err := p.sendMsg(c, c.backlog[0])
		if err != nil && zmq.AsErrno(err) == zmq.Errno(syscall.EAGAIN) {
			return
		}
		if err != nil {
			p.stats.sendFails.Add(1)
		}
		c.blBytes -= len(c.backlog[0])
		p.blTotal -= len(c.backlog[0])
		c.backlog[0] = nil
		c.backlog = c.backlog[1:]
	}
	p.dropBacklog(c)
}

// dropBacklog forgets c's backlog (sent, or its connection ended).
func (p *Plane) dropBacklog(c *conn) {
	p.blTotal -= c.blBytes
	c.backlog, c.blBytes, c.blSince = nil, 0, time.Time{}
	delete(p.backlogged, c)
}
