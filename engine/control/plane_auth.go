package control

// The plane's side of CURVE: starting a connection's session, feeding it,
// boxing what we send, refusing peers that fail it, and cutting peers whose
// key was taken off the allowlist.

import (
	"context"
	"errors"
	"fmt"

	"github.com/kvferry/kvferry/engine/auth"
)

// secure starts c's CURVE session and sends our greeting.
func (p *Plane) secure(c *conn, server bool) error {
	s, err := newCurveSession(p.opts.Auth, server)
	if err != nil {
		p.log.Error("control: CURVE session not started", "err", err)
		return err
	}
	s.out.reserve, s.out.release = p.budget(c)
	if !server {
		s.identity = p.name
	}
	c.sec = s
	return p.sendRaw(c.id, s.greeting())
}

// feedSecure runs c's bytes through its CURVE session: handshake steps, then
// the plain frames into c's reader. A peer that fails authentication is
// refused here (and c closed); other errors are protocol errors for the
// caller.
func (p *Plane) feedSecure(c *conn, data []byte, emit func([][]byte, error)) error {
	s := c.sec
	handOver := func() error {
		if s.ready == nil {
			return nil
		}
		g := s.ready
		s.ready = nil
		return c.rd.feed(g, emit)
	}
	err := s.feed(data,
		func(cmd []byte) { _ = p.sendRaw(c.id, cmd) },
		func(frame []byte) error {
			if err := handOver(); err != nil {
				return err
			}
			return c.rd.feed(frame, emit)
		})
	if err == nil && c.rd != nil {
		err = handOver()
	}
	var r *curveRefusal
	if errors.As(err, &r) {
		p.refuseAuth(c, r)
		return nil
	}
	return err
}

// refuseAuth ends a connection whose peer failed authentication; it never
// reaches a handler. A peer we serve that proved a key we do not allow gets
// CURVE's ERROR and is closed at the next sweep, so the ERROR has left
// before the close; any other is closed at once. A peer we dialed is
// not trusted: the requests waiting for it fail with ErrUnauthenticated and
// what was queued for it is dropped, never sent.
func (p *Plane) refuseAuth(c *conn, r *curveRefusal) {
	p.stats.authRefused.Add(1)
	if c.inbound {
		p.warn.Warn("auth", "control: peer refused: not authenticated", "address", c.host, "err", r.err)
		if r.reason == "" {
			p.closeInbound(c)
			return
		}
		_ = p.sendRaw(c.id, errorCommand(r.reason))
		p.dropBacklog(c)
		p.resetReader(c)
		p.unname(c)
		c.closing = true
		return
	}
	p.warn.Warn("auth:"+c.name, "control: peer not trusted: not authenticated", "peer", c.name, "err", r.err)
	p.failWaiters(c.name, r.err)
	p.dropOutbound(c)
}

// failWaiters fails every request waiting for a reply from peer.
func (p *Plane) failWaiters(peer string, err error) {
	p.waitMu.Lock()
	var chans []chan reply
	for corr, w := range p.waiting {
		if w.peer == peer {
			chans = append(chans, w.ch)
			delete(p.waiting, corr)
		}
	}
	p.waitMu.Unlock()
	for _, ch := range chans {
		ch <- reply{err: err}
	}
}

// sendMsg writes an encoded message on c, boxed when c runs CURVE.
func (p *Plane) sendMsg(c *conn, msg []byte) error {
	if c.sec != nil {
		if c.sec.stage != curveOpen {
			return fmt.Errorf("%w: CURVE handshake not done", ErrUnauthenticated)
		}
		msg = c.sec.seal(msg)
	}
	return p.sendRaw(c.id, msg)
}

// onLoop runs fn on the loop goroutine and waits for it, or for ctx.
func (p *Plane) onLoop(ctx context.Context, fn func()) error {
	done := make(chan struct{})
	if err := p.enqueue(op{fn: func() { fn(); close(done) }}); err != nil {
		return err
	}
	select {
	case <-done:
		return nil
	case <-p.done:
		return ErrClosed
	case <-ctx.Done():
		return fmt.Errorf("control: %w", ctx.Err())
	}
}

// Revoke closes every connection whose peer's key Options.Auth no longer
// allows (after its allowlist was reloaded), both ways, and returns the
// names of the peers cut. When it returns, no further message from them
// reaches a handler: their connections were closed on the loop, which is
// the only goroutine that reads them. A cut peer's next connection is
// refused in its handshake.
func (p *Plane) Revoke(ctx context.Context) ([]string, error) {
	if p.opts.Auth == nil {
		return nil, nil
	}
	var names []string
	err := p.onLoop(ctx, func() {
		seen := map[string]bool{}
		for _, c := range p.conns {
			if c.sec == nil || c.sec.stage != curveOpen || p.opts.Auth.Allowed(c.sec.peerKey) {
				continue
			}
			if !seen[c.name] {
				seen[c.name] = true
				names = append(names, c.name)
			}
			p.stats.authRefused.Add(1)
			p.warn.Warn("auth-revoke", "control: peer cut: its key was removed from the allowlist", "peer", c.name, "key", c.sec.peerKey.String())
			if c.inbound {
				p.dropBacklog(c)
				p.resetReader(c)
				p.unname(c)
				c.closing = true
				p.closeInbound(c)
			} else {
				p.failWaiters(c.name, fmt.Errorf("%w: the peer's key was removed from the allowlist", ErrUnauthenticated))
				p.dropOutbound(c)
			}
		}
	})
	return names, err
}

// PeerKey returns the key the newest connection named name proved in its
// handshake (with Options.Auth), so callers can tell whether a peer they
// know by name is still allowed.
func (p *Plane) PeerKey(ctx context.Context, name string) (auth.Key, bool) {
	var k auth.Key
	var ok bool
	_ = p.onLoop(ctx, func() {
		c := p.newestNamed(name)
		if c == nil {
			c = p.outPeer[name]
		}
		if c != nil && c.sec != nil && c.sec.stage == curveOpen {
			k, ok = c.sec.peerKey, true
		}
	})
	return k, ok
}
