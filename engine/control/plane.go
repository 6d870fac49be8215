package control

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"

	zmq "github.com/pebbe/zmq4"
)

// Errors of the control plane; match them with errors.Is.
var (
	ErrClosed      = errors.New("control plane closed")
	ErrUnreachable = errors.New("peer unreachable")
	ErrRemote      = errors.New("peer answered with an error")
)

// Handler answers one request from a peer. It runs on the plane's loop
// goroutine, so it must not block; from is the peer's segment name. For a
// one-way message type the reply is ignored (return 0, nil).
type Handler func(from string, body []byte) (reply MsgType, replyBody []byte)

// Stats are the plane's counters.
type Stats struct {
	Received  uint64 // messages read
	Malformed uint64 // messages dropped by validation
	Unmatched uint64 // replies that matched no waiting request (late, duplicate)
	SendFails uint64 // sends refused by ZMQ (unroutable, queue full)
}

type counters struct{ received, malformed, unmatched, sendFails atomic.Uint64 }

// op is work handed to the loop goroutine.
type op struct {
	peer   string // send a request to peer, or close it when frames is nil
	frames [][]byte
	corr   uint64
	close  bool
	oneway bool // a one-way message: no reply is awaited
}

type reply struct {
	env  Envelope
	body []byte
}

// waiter is a request waiting for its reply: only a reply from the peer it
// was sent to, with its correlation id, is taken.
type waiter struct {
	peer string
	ch   chan reply
}

// Plane is one engine's control plane. Request and Close are safe for
// concurrent use; everything touching a socket runs on one goroutine.
type Plane struct {
	started atomic.Bool // the loop was started (Close starts it to close the sockets)
	name    string
	log     *slog.Logger
	zctx    *zmq.Context
	router  *zmq.Socket

	handlers map[MsgType]Handler // fixed before Start

	wakeMu   sync.Mutex  // serialises sends on wakeSend; ZMQ allows a socket to change threads behind a full barrier
	wakeSend *zmq.Socket // inproc PUSH
	wakeRecv *zmq.Socket // inproc PULL, owned by the loop

	opMu   sync.Mutex
	ops    []op
	closed bool

	corr    atomic.Uint64
	waitMu  sync.Mutex
	waiting map[uint64]waiter

	stats counters
	done  chan struct{}
}

// Listen binds the ROUTER socket on host:port (port 0 picks a free port) and
// returns a plane whose Name is the bound "host:port" ("[::1]:port" for
// IPv6). Register handlers with Handle, then call Start.
func Listen(host string, port int, log *slog.Logger) (*Plane, error) {
	if log == nil {
		log = slog.Default()
	}
	zctx, err := zmq.NewContext()
	if err != nil {
		return nil, fmt.Errorf("control: zmq context: %w", err)
	}
	p := &Plane{log: log, zctx: zctx, handlers: map[MsgType]Handler{}, waiting: map[uint64]waiter{}, done: make(chan struct{})}
	// Correlation ids start at random, so a restarted engine on the same
	// port never takes a late reply meant for its previous run.
	var seed [8]byte
	if _, err := rand.Read(seed[:]); err == nil {
		p.corr.Store(binary.LittleEndian.Uint64(seed[:]) >> 1)
	}
	fail := func(err error) (*Plane, error) {
		p.closeSockets()
		_ = zctx.Term()
		return nil, err
	}
	ipv6 := strings.Contains(host, ":")
	if p.router, err = p.socket(zmq.ROUTER, ipv6); err != nil {
		return fail(err)
	}
	if err := p.router.SetRouterMandatory(1); err != nil {
		return fail(fmt.Errorf("control: ROUTER_MANDATORY: %w", err))
	}
	if err := p.router.SetRouterHandover(true); err != nil {
		return fail(fmt.Errorf("control: ROUTER_HANDOVER: %w", err))
	}
	bindHost := host
	if ipv6 {
		bindHost = "[" + host + "]"
	}
	portStr := "*"
	if port != 0 {
		portStr = fmt.Sprint(port)
	}
	if err := p.router.Bind("tcp://" + bindHost + ":" + portStr); err != nil {
		return fail(fmt.Errorf("control: bind %s:%s: %w", bindHost, portStr, err))
	}
	ep, err := p.router.GetLastEndpoint()
	if err != nil {
		return fail(fmt.Errorf("control: bound endpoint: %w", err))
	}
	p.name = strings.TrimPrefix(ep, "tcp://")
	inproc := fmt.Sprintf("inproc://kvferry-wake-%p", p)
	if p.wakeRecv, err = p.socket(zmq.PULL, false); err != nil {
		return fail(err)
	}
	if err := p.wakeRecv.Bind(inproc); err != nil {
		return fail(fmt.Errorf("control: bind %s: %w", inproc, err))
	}
	if p.wakeSend, err = p.socket(zmq.PUSH, false); err != nil {
		return fail(err)
	}
	if err := p.wakeSend.Connect(inproc); err != nil {
		return fail(fmt.Errorf("control: connect %s: %w", inproc, err))
	}
	return p, nil
}

// socket makes a socket with linger 0 and the size cap.
func (p *Plane) socket(t zmq.Type, ipv6 bool) (*zmq.Socket, error) {
	s, err := p.zctx.NewSocket(t)
	if err != nil {
		return nil, fmt.Errorf("control: new %v socket: %w", t, err)
	}
	_ = s.SetLinger(0)
	if err := s.SetMaxmsgsize(MaxBody + EnvelopeSize); err != nil {
		_ = s.Close()
		return nil, fmt.Errorf("control: MAXMSGSIZE: %w", err)
	}
	if ipv6 {
		_ = s.SetIpv6(true)
	}
	return s, nil
}

// Name is the segment name: the bound "host:port".
func (p *Plane) Name() string { return p.name }

// Handle sets the handler for requests of type t. Call it before Start.
func (p *Plane) Handle(t MsgType, h Handler) { p.handlers[t] = h }

// Start runs the loop goroutine.
func (p *Plane) Start() {
	if p.started.CompareAndSwap(false, true) {
		go p.loop()
	}
}

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
	if err := p.enqueue(op{peer: peer, frames: frames, corr: corr}); err != nil {
		return 0, nil, err
	}
	select {
	case r := <-ch:
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
// the peer's own one-way answer arrives. The message goes through our ROUTER
// when the peer has a DEALER connected to us (ROUTER_MANDATORY tells when it
// has not), else through our DEALER to the peer.
func (p *Plane) Send(peer string, t MsgType, body []byte) error {
	if !t.IsOneWay() {
		return fmt.Errorf("control: send %s: %w: not a one-way message", t, ErrMalformed)
	}
	if _, _, err := net.SplitHostPort(peer); err != nil {
		return fmt.Errorf("control: peer %q: %w", peer, err)
	}
	frames := [][]byte{EncodeEnvelope(Envelope{Type: t, Corr: p.corr.Add(1)})}
	if len(body) > 0 {
		frames = append(frames, body)
	}
	return p.enqueue(op{peer: peer, frames: frames, oneway: true})
}

// Forget closes the socket to peer; a later Request opens a new one.
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

// Close stops the loop, closes every socket and the ZMQ context.
func (p *Plane) Close() error {
	p.opMu.Lock()
	already := p.closed
	p.closed = true
	p.opMu.Unlock()
	if already {
		<-p.done
		return nil
	}
	// A plane closed before Start (New failing half-way) still has its
	// loop close the sockets it owns.
	p.Start()
	p.wake()
	<-p.done
	p.wakeMu.Lock()
	_ = p.wakeSend.Close()
	p.wakeSend = nil
	p.wakeMu.Unlock()
	return p.zctx.Term()
}

// Stats returns a snapshot of the counters.
func (p *Plane) Stats() Stats {
	return Stats{Received: p.stats.received.Load(), Malformed: p.stats.malformed.Load(),
		Unmatched: p.stats.unmatched.Load(), SendFails: p.stats.sendFails.Load()}
}

func (p *Plane) closeSockets() {
	for _, s := range []*zmq.Socket{p.router, p.wakeRecv, p.wakeSend} {
		if s != nil {
			_ = s.Close()
		}
	}
}

// loop owns the ROUTER, the wake PULL and every DEALER.
func (p *Plane) loop() {
	defer close(p.done)
	dealers := map[string]*zmq.Socket{}
	peerOf := map[*zmq.Socket]string{}
	poller := zmq.NewPoller()
	poller.Add(p.router, zmq.POLLIN)
	poller.Add(p.wakeRecv, zmq.POLLIN)
	defer func() {
		for _, d := range dealers {
			_ = d.Close()
		}
		_ = p.router.Close()
		_ = p.wakeRecv.Close()
	}()
	for {
		polled, err := poller.Poll(-1)
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
			case p.router:
				p.drainRouter()
			default:
				p.drainDealer(it.Socket, peerOf[it.Socket])
			}
		}
		p.opMu.Lock()
		ops, closed := p.ops, p.closed
		p.ops = nil
		p.opMu.Unlock()
		if closed {
			return
		}
		for _, o := range ops {
			d := dealers[o.peer]
			if o.close {
				if d != nil {
					_ = poller.RemoveBySocket(d)
					_ = d.Close()
					delete(dealers, o.peer)
					delete(peerOf, d)
				}
				continue
			}
			if o.oneway {
				parts := append([]any{o.peer}, toParts(o.frames)...)
				if _, err := p.router.SendMessageDontwait(parts...); err == nil {
					continue
				}
				// Unroutable (the peer has no DEALER to us): go through ours.
			}
			if d == nil {
				if d, err = p.dial(o.peer); err != nil {
					if o.oneway {
						p.stats.sendFails.Add(1)
						continue
					}
					p.deliver(o.corr, o.peer, reply{env: Envelope{Type: MsgError}, body: []byte(err.Error())})
					continue
				}
				dealers[o.peer] = d
				peerOf[d] = o.peer
				poller.Add(d, zmq.POLLIN)
			}
			if _, err := d.SendMessageDontwait(toParts(o.frames)...); err != nil {
				p.stats.sendFails.Add(1)
				if o.oneway {
					continue
				}
				p.deliver(o.corr, o.peer, reply{env: Envelope{Type: MsgError}, body: []byte("send: " + err.Error())})
			}
		}
	}
}

func toParts(frames [][]byte) []any {
	parts := make([]any, len(frames))
	for i, f := range frames {
		parts[i] = f
	}
	return parts
}

// dial opens the DEALER to peer, with our name as its routing id so the
// peer's ROUTER knows who is asking.
func (p *Plane) dial(peer string) (*zmq.Socket, error) {
	host, _, _ := net.SplitHostPort(peer)
	d, err := p.socket(zmq.DEALER, strings.Contains(host, ":"))
	if err != nil {
		return nil, err
	}
	if err := d.SetIdentity(p.name); err != nil {
		_ = d.Close()
		return nil, fmt.Errorf("control: routing id: %w", err)
	}
	if err := d.Connect("tcp://" + peer); err != nil {
		_ = d.Close()
		return nil, fmt.Errorf("control: connect %s: %w", peer, err)
	}
	return d, nil
}

// recv reads one whole message without blocking, keeping at most MaxFrames
// frames; the rest of an over-long message is read and dropped.
func recv(s *zmq.Socket) (frames [][]byte, extra int, err error) {
	for {
		f, err := s.RecvBytes(zmq.DONTWAIT)
		if err != nil {
			return nil, 0, err
		}
		if len(frames) < MaxFrames {
			frames = append(frames, f)
		} else {
			extra++
		}
		more, err := s.GetRcvmore()
		if err != nil || !more {
			return frames, extra, nil
		}
	}
}

// drainRouter answers every request waiting on the ROUTER.
func (p *Plane) drainRouter() {
	for {
		frames, extra, err := recv(p.router)
		if err != nil {
			return
		}
		p.stats.received.Add(1)
		if len(frames) < 2 || extra > 0 || len(frames[0]) == 0 {
			p.malformed("request", "", fmt.Errorf("%w: %d frames", ErrMalformed, len(frames)+extra))
			continue
		}
		from := string(frames[0])
		env, err := DecodeEnvelope(frames[1])
		if err != nil {
			p.malformed("request", from, err)
			continue
		}
		var body []byte
		if len(frames) == 3 {
			if body, err = UnpackBody(frames[2], env.Flags); err != nil {
				p.malformed("request", from, err)
				continue
			}
		}
		h := p.handlers[env.Type]
		if env.Type.IsOneWay() {
			if h != nil {
				h(from, body)
			}
			continue
		}
		rt, rb := MsgError, []byte(fmt.Sprintf("no handler for %s", env.Type))
		if h != nil {
			rt, rb = h(from, body)
		}
		packed, flags := PackBody(rb)
		parts := []any{frames[0], EncodeEnvelope(Envelope{Type: rt, Flags: flags, Corr: env.Corr})}
		if len(rb) > 0 {
			parts = append(parts, packed)
		}
		if _, err := p.router.SendMessageDontwait(parts...); err != nil {
			p.stats.sendFails.Add(1)
			p.log.Debug("control: reply not sent", "peer", from, "type", rt, "err", err)
		}
	}
}

// drainDealer hands every reply waiting on a DEALER to its requester.
func (p *Plane) drainDealer(d *zmq.Socket, peer string) {
	for {
		frames, extra, err := recv(d)
		if err != nil {
			return
		}
		p.stats.received.Add(1)
		if len(frames) < 1 || len(frames) > 2 || extra > 0 {
			p.malformed("reply", peer, fmt.Errorf("%w: %d frames", ErrMalformed, len(frames)+extra))
			continue
		}
		env, err := DecodeEnvelope(frames[0])
		if err == nil && !env.Type.IsReply() && !env.Type.IsOneWay() {
			err = fmt.Errorf("%w: %s is neither a reply nor one-way", ErrMalformed, env.Type)
		}
		if err != nil {
			p.malformed("reply", peer, err)
			continue
		}
		var body []byte
		if len(frames) == 2 {
			if body, err = UnpackBody(frames[1], env.Flags); err != nil {
				p.malformed("reply", peer, err)
				continue
			}
		}
		if env.Type.IsOneWay() {
			if h := p.handlers[env.Type]; h != nil {
				h(peer, body)
			}
			continue
		}
		p.deliver(env.Corr, peer, reply{env: env, body: body})
	}
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

func (p *Plane) malformed(what, peer string, err error) {
	p.stats.malformed.Add(1)
	p.log.Warn("control: dropped malformed "+what, "peer", peer, "err", err)
}
