package control

// The connection table, owned by the loop: our connections to peers (one
// per peer, redialled with a fresh routing id), peers' connections to us
// (named by their READY, the newest taking the name), and their readers.

import (
	"fmt"
	"sync/atomic"
	"syscall"
	"time"

	zmq "github.com/pebbe/zmq4"
)

// dial opens our connection to peer. libzmq retries the TCP connect by
// itself until it succeeds. Each dial takes a new routing id: libzmq ends a
// disconnected connection asynchronously, and an id still in use must not
// be given again.
func (p *Plane) dial(peer string) (*conn, error) {
	c := &conn{name: peer, used: time.Now()}
	if err := p.connect(c); err != nil {
		return nil, err
	}
	p.outPeer[peer] = c
	p.stats.peers.Add(1)
	return c, nil
}

// connect gives c a new routing id and a new libzmq connection.
func (p *Plane) connect(c *conn) error {
	p.dials++
	id := fmt.Sprintf("o%d", p.dials) // libzmq's own ids start with a zero byte
	if err := p.stream.SetConnectRid(id); err != nil {
		return fmt.Errorf("control: routing id: %w", err)
	}
	if err := p.stream.Connect("tcp://" + c.name); err != nil {
		return fmt.Errorf("control: connect %s: %w", c.name, err)
	}
	c.id, c.live, c.since = id, false, time.Now()
	p.conns[id] = c
	return nil
}

// retire ends the libzmq connection under c, whose TCP connection went
// down, and keeps c (its peer and queue) for a new one, dialed at the next
// sweep (until it idles out). libzmq would redial it itself and keep its pipe,
// but the pipe may hold messages written after the drop and before its
// notice reached us: they would go out first on the new connection, before
// our greeting, and the peer would refuse it. A new connection starts
// clean; what was written into the old one is lost, as on a TCP reset.
func (p *Plane) retire(c *conn) {
	if c.id != "" {
		_ = p.stream.Disconnect("tcp://" + c.name)
		delete(p.conns, c.id)
	}
	p.resetReader(c)
	c.id, c.live = "", false
}

// dropOutbound ends our connection to c's peer for good; a later send
// dials again.
func (p *Plane) dropOutbound(c *conn) {
	p.retire(c)
	delete(p.outPeer, c.name)
	p.stats.peers.Add(-1)
}

// closeInbound closes a connection a peer opened to us. An empty message
// closes a STREAM connection, but libzmq refuses it (EAGAIN) while the
// connection's send queue is full (a peer that reads nothing) and once the
// peer's own close is under way. Forgotten then, the connection stayed open
// and uncounted for ever (a zombie past every cap), or its close notice,
// still to come, was taken for a new connection. Such a connection stays
// counted, reads nothing more, and is closed again at each sweep until
// libzmq takes the close or its notice says it ended.
func (p *Plane) closeInbound(c *conn) {
	if err := p.sendRaw(c.id, nil); err != nil && zmq.AsErrno(err) == zmq.Errno(syscall.EAGAIN) {
		p.dropBacklog(c)
		p.resetReader(c)
		p.unname(c)
		c.closing = true
		return
	}
	p.forgetInbound(c)
}

// forgetInbound drops an inbound connection's state (it closed).
func (p *Plane) forgetInbound(c *conn) {
	p.dropBacklog(c)
	p.resetReader(c)
	delete(p.conns, c.id)
	p.unname(c)
	if p.perHost[c.host]--; p.perHost[c.host] <= 0 {
		delete(p.perHost, c.host)
	}
	p.stats.conns.Add(-1)
}

// newestNamed is the inbound connection that takes messages for name: the
// newest of that name, so a reconnecting peer takes over at once.
func (p *Plane) newestNamed(name string) *conn {
	if l := p.named[name]; len(l) > 0 {
		return l[len(l)-1]
	}
	return nil
}

// unname stops routing messages for c's peer name to c. The newest other
// connection of that name takes them: a stranger that claimed the name and
// left must not strand the peer that still holds a connection under it.
func (p *Plane) unname(c *conn) {
	l := p.named[c.name]
	for i, o := range l {
		if o == c {
			l = append(l[:i:i], l[i+1:]...)
			break
		}
	}
	if len(l) == 0 {
		delete(p.named, c.name)
		p.namedMu.Lock()
		delete(p.namedLive, c.name)
		p.namedMu.Unlock()
	} else {
		p.named[c.name] = l
	}
}

func (p *Plane) resetReader(c *conn) {
	if c.rd != nil {
		c.rd.drop()
		c.rd = nil
	}
	if c.sec != nil {
		c.sec.out.drop()
		c.sec = nil
	}
	c.msgSince = time.Time{}
}

func (p *Plane) newReader(c *conn) *zmtpReader {
	reserve, release := p.budget(c)
	rd := newZMTPReader(zmtpLimits{maxFrames: MaxFrames - 1, maxFrame: MaxBody + EnvelopeSize, maxBytes: MaxBody + EnvelopeSize},
		reserve, release)
	rd.onReady = func() error { return p.becameReady(c) }
	return rd
}

// budget returns the functions that reserve and release buffer bytes for
// c's partly received frames. A frame's size is reserved when its header
// arrives: a few headers of 16 MiB frames that never come hold the budget
// until MessageTimeout. Peers we chose to talk to draw from a budget of
// their own.
func (p *Plane) budget(c *conn) (reserve func(uint64) bool, release func(uint64)) {
	held := &p.buffered
	if !c.inbound {
		held = &p.bufferedOut
	}
	reserve = func(n uint64) bool {
		if atomic.LoadUint64(held)+n > p.opts.BufferBytes {
			p.stats.overBudget.Add(1)
			return false
		}
		atomic.AddUint64(held, n)
		return true
	}
	release = func(n uint64) { atomic.AddUint64(held, -n) }
	return reserve, release
}
