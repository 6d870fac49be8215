package control

// Our side of a conversation: requests that wait for the reply with their
// correlation id, one-way sends, and the matching of what comes back.

import (
	"context"
	"fmt"
	"net"

	zmq "github.com/pebbe/zmq4"
)

// Request sends a request to peer ("host:port") and waits for its reply
// until ctx ends.
func (p *Plane) Request(ctx context.Context, peer string, t MsgType, body []byte) (MsgType, []byte, error) {
	if _, _, err := net.SplitHostPort(peer); err != nil {
		return 0, nil, fmt.Errorf("control: peer %q: %w", peer, err)
	}
	corr := p.corr.Add(1)
	ch := make(chan reply, 1)
	p.waitMu.Lock()
	p.waiting[corr] = waiter{peer: peer, ch: ch}
	p.waitMu.Unlock()
	defer func() {
		p.waitMu.Lock()
		delete(p.waiting, corr)
		p.waitMu.Unlock()
	}()
	packed, flags := PackBody(body)
	frames := [][]byte{EncodeEnvelope(Envelope{Type: t, Flags: flags, Corr: corr})}
	if len(body) > 0 {
		frames = append(frames, packed)
	}
	if err := p.enqueue(op{peer: peer, frames: frames, corr: corr, typ: t, body: body}); err != nil {
		return 0, nil, err
	}
	select {
	case r := <-ch:
		if r.err != nil {
			return 0, nil, fmt.Errorf("control: %s to %s: %w", t, peer, r.err)
		}
		if r.env.Type == MsgError {
			return 0, nil, fmt.Errorf("control: %s from %s: %w: %s", t, peer, ErrRemote, r.body)
		}
		return r.env.Type, r.body, nil
	case <-ctx.Done():
		return 0, nil, fmt.Errorf("control: %s to %s: %w: %w", t, peer, ErrUnreachable, ctx.Err())
	case <-p.done:
		return 0, nil, ErrClosed
	}
}

// Send queues a one-way message (t.IsOneWay()) to peer and returns without
// waiting: delivery is not confirmed, so callers that need it resend until
// the peer's own one-way answer arrives. The message goes over the
// connection the peer opened to us when it has one, else over ours to it,
// which Send opens if needed.
func (p *Plane) Send(peer string, t MsgType, body []byte) error {
	return p.sendOneWay(peer, t, body, false)
}

// SendIfConnected is Send that never opens a connection: the message goes
// over a connection that exists (ours to the peer first, then the peer's to
// us), or is dropped and counted in SendFails. It answers senders nobody vouched for
// (an ABORT's acknowledgement): a made-up sender name costs no socket, and
// a real one resends until it hears back.
func (p *Plane) SendIfConnected(peer string, t MsgType, body []byte) error {
	return p.sendOneWay(peer, t, body, true)
}

func (p *Plane) sendOneWay(peer string, t MsgType, body []byte, noDial bool) error {
	if !t.IsOneWay() {
		return fmt.Errorf("control: send %s: %w: not a one-way message", t, ErrMalformed)
	}
	if !noDial {
		if _, _, err := net.SplitHostPort(peer); err != nil {
			return fmt.Errorf("control: peer %q: %w", peer, err)
		}
	}
	frames := [][]byte{EncodeEnvelope(Envelope{Type: t, Corr: p.corr.Add(1)})}
	if len(body) > 0 {
		frames = append(frames, body)
	}
	return p.enqueue(op{peer: peer, frames: frames, oneway: true, noDial: noDial, typ: t, body: body})
}

// HasInbound reports whether peer (by the name in its handshake) holds a
// control connection to us now, as every engine that opened our segment
// does: a one-way message to it can be delivered without a dial.
func (p *Plane) HasInbound(peer string) bool {
	p.namedMu.Lock()
	defer p.namedMu.Unlock()
	_, ok := p.namedLive[peer]
	return ok
}

// Forget closes our connection to peer; a later Request opens a new one.
func (p *Plane) Forget(peer string) { _ = p.enqueue(op{peer: peer, close: true}) }

func (p *Plane) enqueue(o op) error {
	p.opMu.Lock()
	if p.closed {
		p.opMu.Unlock()
		return ErrClosed
	}
	first := len(p.ops) == 0
	p.ops = append(p.ops, o)
	p.opMu.Unlock()
	if first {
		p.wake()
	}
	return nil
}

func (p *Plane) wake() {
	p.wakeMu.Lock()
	if p.wakeSend != nil {
		_, _ = p.wakeSend.SendBytes(nil, zmq.DONTWAIT)
	}
	p.wakeMu.Unlock()
}

// handleReply hands a message that came on our connection to a peer to its
// requester, or to the one-way handler.
func (p *Plane) handleReply(c *conn, frames [][]byte) {
	env, err := DecodeEnvelope(frames[0])
	if err == nil && !env.Type.IsReply() && !env.Type.IsOneWay() {
		err = fmt.Errorf("%w: %s is neither a reply nor one-way", ErrMalformed, env.Type)
	}
	if err != nil {
		p.malformed("reply", c.name, err)
		return
	}
	var body []byte
	if len(frames) == 2 {
		if body, err = UnpackBody(frames[1], env.Flags); err != nil {
			p.malformed("reply", c.name, err)
			return
		}
	}
	if env.Type.IsOneWay() {
		if h := p.handlers[env.Type]; h != nil {
			h(c.name, body)
		}
		return
	}
	p.deliver(env.Corr, c.name, reply{env: env, body: body})
}

// deliver hands a reply from peer to the request waiting for it; a reply
// nobody waits for (late, duplicate, or from another peer) is dropped and
// counted.
func (p *Plane) deliver(corr uint64, peer string, r reply) {
	p.waitMu.Lock()
	w, ok := p.waiting[corr]
	if ok && w.peer == peer {
		delete(p.waiting, corr)
	}
	p.waitMu.Unlock()
	if !ok || w.peer != peer {
		p.stats.unmatched.Add(1)
		return
	}
	w.ch <- r
}
