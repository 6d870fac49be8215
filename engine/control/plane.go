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
	"syscall"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvferry/kvferry/internal/ratelog"
)

// Errors of the control plane; match them with errors.Is.
var (
	ErrClosed      = errors.New("control plane closed")
	ErrUnreachable = errors.New("peer unreachable")
	ErrRemote      = errors.New("peer answered with an error")
	// ErrOverBudget: a message was dropped because the plane's buffer
	// budget (Options.BufferBytes) was spent, or a peer's send queue
	// (Options.MaxQueued) was full.
	ErrOverBudget = errors.New("control plane buffer budget spent")
)

// Handler answers one request from a peer. It runs on the plane's loop
// goroutine, so it must not block; from is the peer's segment name. For a
// one-way message type the reply is ignored (return 0, nil).
type Handler func(from string, body []byte) (reply MsgType, replyBody []byte)

// Options bound what peers can make the plane spend. Zero fields take the
// defaults.
type Options struct {
	// MaxConns caps the connections peers open to us (default 1024).
	// Each engine that opened our segment holds one. Past it a new
	// connection is closed at once.
	MaxConns int
	// MaxConnsPerHost caps them per remote address (default 256), so one
	// host cannot take every slot.
	MaxConnsPerHost int
	// BufferBytes caps the bytes of partly received messages held for all
	// connections peers opened to us together (default 128 MiB). A message
	// that would pass it is dropped as it arrives, never buffered. Replies
	// on our own connections to peers have a budget of the same size of
	// their own, so strangers holding this one cannot starve the answers
	// to our requests.
	BufferBytes uint64
	// HandshakeTimeout: a connection that has not completed the ZMTP
	// handshake by then is closed (default 10 s).
	HandshakeTimeout time.Duration
	// MessageTimeout: a message that has started must arrive whole within
	// it, or its connection is closed (default 30 s: MaxBody at 1 MB/s).
	MessageTimeout time.Duration
	// MaxQueued caps the messages queued for one peer while its connection
	// is being set up (default 1024); past it sends fail.
	MaxQueued int
	// Advertise is the host part of Name when the plane is bound on an
	// address resolved from a host name: peers know this engine by the
	// name its user gave ("localhost:port", "node7:port"), not by the
	// address it resolved to. Empty: the bound address.
	Advertise string
	// PeerIdleTimeout closes our connection to a peer after it carried
	// nothing for that long (default 2 minutes); the next message to the
	// peer opens it again. So a peer we reached once (a name taken from a
	// grant, or one that went away) does not keep a socket for ever.
	PeerIdleTimeout time.Duration
}

// Defaults of Options.
const (
	DefaultMaxConns         = 1024
	DefaultMaxConnsPerHost  = 256
	DefaultBufferBytes      = 128 << 20
	DefaultHandshakeTimeout = 10 * time.Second
	DefaultMessageTimeout   = 30 * time.Second
	DefaultMaxQueued        = 1024
	DefaultPeerIdleTimeout  = 2 * time.Minute
	// rcvHWM is libzmq's receive queue per connection, in reads of at most
	// 8 KiB: the plane drains it continuously, so a short queue costs no
	// speed and bounds what libzmq holds per connection to 128 KiB.
	rcvHWM = 16
	// sndHWM is libzmq's send queue per connection, in messages. Replies
	// it refuses wait in the connection's backlog, bounded in bytes
	// (backlogBytes per connection, totalBacklogBytes for all), and go out
	// in order as it drains; a peer that pipelines and reads never loses
	// one. A peer whose backlog is full does not read: its further
	// requests are dropped unanswered, and after stallTimeout with a
	// backlog it is closed.
	sndHWM            = 16
	backlogBytes      = 256 << 10
	totalBacklogBytes = 64 << 20
	stallTimeout      = 10 * time.Second
	// tick is how often the loop checks deadlines when nothing arrives.
	tick = 250 * time.Millisecond
	// redialIvl is how often the loop dials again a peer whose connection
	// did not come up (refused, or nothing answers): a new connection with
	// a new routing id each time.
	redialIvl = time.Second
	// zmqReconnectIvl is libzmq's own interval between connect attempts of
	// one connection. The loop replaces a connection that went down or did
	// not come up (see retire and redialIvl), and libzmq's redial of the
	// old one must never come first: it would send what was left in the
	// old pipe ahead of any greeting.
	zmqReconnectIvl = time.Hour
)

func (o *Options) fill() {
	if o.MaxConns <= 0 {
		o.MaxConns = DefaultMaxConns
	}
	if o.MaxConnsPerHost <= 0 {
		o.MaxConnsPerHost = DefaultMaxConnsPerHost
	}
	if o.BufferBytes == 0 {
		o.BufferBytes = DefaultBufferBytes
	}
	if o.HandshakeTimeout <= 0 {
		o.HandshakeTimeout = DefaultHandshakeTimeout
	}
	if o.MessageTimeout <= 0 {
		o.MessageTimeout = DefaultMessageTimeout
	}
	if o.MaxQueued <= 0 {
		o.MaxQueued = DefaultMaxQueued
	}
	if o.PeerIdleTimeout <= 0 {
		o.PeerIdleTimeout = DefaultPeerIdleTimeout
	}
}

// Stats are the plane's counters.
type Stats struct {
	Received  uint64 // messages read
	Malformed uint64 // messages dropped by validation
	Unmatched uint64 // replies that matched no waiting request (late, duplicate)
	SendFails uint64 // sends refused (unroutable, queue full, no connection for a reply)

	Conns         int    // connections peers hold to us now
	Peers         int    // peers we hold a connection to now
	ConnsRefused  uint64 // connections closed at once: MaxConns or MaxConnsPerHost reached
	ConnsCut      uint64 // connections closed for a protocol error or a timeout
	OverBudget    uint64 // messages dropped because BufferBytes was spent
	BufferedBytes uint64 // bytes of partly received messages held now
}

type counters struct {
	received, malformed, unmatched, sendFails, refused, cut, overBudget atomic.Uint64
	conns, peers                                                        atomic.Int64
}

// op is work handed to the loop goroutine.
type op struct {
	peer   string // send a request to peer, or close it when close is set
	frames [][]byte
	corr   uint64
	close  bool
	oneway bool // a one-way message: no reply is awaited
	noDial bool // send only over a connection that exists
	typ    MsgType
	body   []byte // unpacked, for a message to our own name
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

// conn is one ZMTP connection on the plane's STREAM socket: one a peer
// opened to us (inbound), or one we opened to a peer.
type conn struct {
	id       string // libzmq's routing id for it on the STREAM socket
	inbound  bool
	name     string // inbound: the peer's name, once its READY came; outbound: the peer
	host     string // inbound: the remote address
	rd       *zmtpReader
	live     bool      // outbound: the TCP connection is up now
	since    time.Time // when it (re)connected
	msgSince time.Time // when the message in progress began; zero when none
	used     time.Time // outbound: when it last carried a message either way
	queue    [][]byte  // outbound: encoded messages waiting for the peer's READY
	closing  bool      // inbound: we closed it, libzmq has not yet (see closeInbound)
	backlog  [][]byte  // inbound: replies libzmq's send queue refused, in order
	blBytes  int       // their bytes
	blSince  time.Time // when the backlog last became non-empty
}

// Plane is one engine's control plane. Request and Close are safe for
// concurrent use; everything touching a socket runs on one goroutine.
type Plane struct {
	started atomic.Bool // the loop was started (Close starts it to close the sockets)
	name    string
	log     *slog.Logger
	warn    *ratelog.Limiter
	opts    Options
	zctx    *zmq.Context
	stream  *zmq.Socket // every connection, both ways; owned by the loop

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

	// Owned by the loop.
	conns map[string]*conn   // by routing id
	named map[string][]*conn // inbound connections past READY, by name, oldest first: the newest takes the name's messages
	// namedLive mirrors which names have an inbound connection in named,
	// for HasInbound from other goroutines.
	namedMu     sync.Mutex
	namedLive   map[string]struct{}
	outPeer     map[string]*conn   // outbound, by peer
	perHost     map[string]int     // inbound connections per remote address
	backlogged  map[*conn]struct{} // inbound connections with a reply backlog
	blTotal     int                // bytes of every backlog
	buffered    uint64             // bytes held by readers of inbound connections (atomic for Stats)
	bufferedOut uint64             // bytes held by readers of our connections to peers
	dials       uint64             // outbound connections made: their routing ids

	stats counters
	done  chan struct{}
}

// Listen binds the plane on host:port (port 0 picks a free port) with the
// default Options; see ListenWith.
func Listen(host string, port int, log *slog.Logger) (*Plane, error) {
	return ListenWith(host, port, Options{}, log)
}

// ListenWith binds the plane's socket on host:port (port 0 picks a free
// port) and returns a plane whose Name is the bound "host:port"
// ("[::1]:port" for IPv6). Register handlers with Handle, then call Start.
func ListenWith(host string, port int, opts Options, log *slog.Logger) (*Plane, error) {
	if log == nil {
		log = slog.Default()
	}
	opts.fill()
	zctx, err := zmq.NewContext()
	if err != nil {
		return nil, fmt.Errorf("control: zmq context: %w", err)
	}
	p := &Plane{log: log, warn: ratelog.New(log), opts: opts, zctx: zctx, handlers: map[MsgType]Handler{},
		waiting: map[uint64]waiter{}, done: make(chan struct{}),
		conns: map[string]*conn{}, named: map[string][]*conn{}, namedLive: map[string]struct{}{}, outPeer: map[string]*conn{}, perHost: map[string]int{}, backlogged: map[*conn]struct{}{}}
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
	if p.stream, err = p.socket(zmq.STREAM); err != nil {
		return fail(err)
	}
	if err := p.stream.SetRcvhwm(rcvHWM); err != nil {
		return fail(fmt.Errorf("control: RCVHWM: %w", err))
	}
	if err := p.stream.SetSndhwm(sndHWM); err != nil {
		return fail(fmt.Errorf("control: SNDHWM: %w", err))
	}
	if err := p.stream.SetReconnectIvl(zmqReconnectIvl); err != nil {
		return fail(fmt.Errorf("control: RECONNECT_IVL: %w", err))
	}
	ipv6 := strings.Contains(host, ":")
	_ = p.stream.SetIpv6(ipv6)
	bindHost := host
	if ipv6 {
		bindHost = "[" + host + "]"
	}
	portStr := "*"
	if port != 0 {
		portStr = fmt.Sprint(port)
	}
	if err := p.stream.Bind("tcp://" + bindHost + ":" + portStr); err != nil {
		return fail(fmt.Errorf("control: bind %s:%s: %w", bindHost, portStr, err))
	}
	ep, err := p.stream.GetLastEndpoint()
	if err != nil {
		return fail(fmt.Errorf("control: bound endpoint: %w", err))
	}
	p.name = strings.TrimPrefix(ep, "tcp://")
	if opts.Advertise != "" {
		_, port, _ := net.SplitHostPort(p.name)
		p.name = net.JoinHostPort(opts.Advertise, port)
	}
	// Both ways on one socket: an outbound connection gets a routing id we
	// choose (outID), so it never collides with libzmq's ids for inbound
	// ones, which start with a zero byte. Set after the bind, IPv6 lets it
	// reach peers of either family without changing the bound name.
	_ = p.stream.SetIpv6(true)
	inproc := fmt.Sprintf("inproc://kvferry-wake-%p", p)
	if p.wakeRecv, err = p.socket(zmq.PULL); err != nil {
		return fail(err)
	}
	if err := p.wakeRecv.Bind(inproc); err != nil {
		return fail(fmt.Errorf("control: bind %s: %w", inproc, err))
	}
	if p.wakeSend, err = p.socket(zmq.PUSH); err != nil {
		return fail(err)
	}
	if err := p.wakeSend.Connect(inproc); err != nil {
		return fail(fmt.Errorf("control: connect %s: %w", inproc, err))
	}
	return p, nil
}

// socket makes a socket with linger 0.
func (p *Plane) socket(t zmq.Type) (*zmq.Socket, error) {
	s, err := p.zctx.NewSocket(t)
	if err != nil {
		return nil, fmt.Errorf("control: new %v socket: %w", t, err)
	}
	_ = s.SetLinger(0)
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
	if err := p.enqueue(op{peer: peer, frames: frames, corr: corr, typ: t, body: body}); err != nil {
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
		Unmatched: p.stats.unmatched.Load(), SendFails: p.stats.sendFails.Load(),
		Conns: int(p.stats.conns.Load()), Peers: int(p.stats.peers.Load()),
		ConnsRefused: p.stats.refused.Load(), ConnsCut: p.stats.cut.Load(),
		OverBudget: p.stats.overBudget.Load(), BufferedBytes: atomic.LoadUint64(&p.buffered) + atomic.LoadUint64(&p.bufferedOut)}
}

func (p *Plane) closeSockets() {
	for _, s := range []*zmq.Socket{p.stream, p.wakeRecv, p.wakeSend} {
		if s != nil {
			_ = s.Close()
		}
	}
}

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
		err := p.sendRaw(c.id, c.queue[0])
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
	c.msgSince = time.Time{}
}

func (p *Plane) newReader(c *conn) *zmtpReader {
	// A frame's size is reserved when its header arrives: a few headers of
	// 16 MiB frames that never come hold the budget until MessageTimeout.
	// Peers we chose to talk to draw from a budget of their own.
	held := &p.buffered
	if !c.inbound {
		held = &p.bufferedOut
	}
	reserve := func(n uint64) bool {
		if atomic.LoadUint64(held)+n > p.opts.BufferBytes {
			p.stats.overBudget.Add(1)
			return false
		}
		atomic.AddUint64(held, n)
		return true
	}
	release := func(n uint64) { atomic.AddUint64(held, -n) }
	rd := newZMTPReader(zmtpLimits{maxFrames: MaxFrames - 1, maxFrame: MaxBody + EnvelopeSize, maxBytes: MaxBody + EnvelopeSize},
		reserve, release)
	rd.onReady = func() error { return p.becameReady(c) }
	return rd
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
				_ = p.sendRaw(c.id, append(zmtpGreeting(), zmtpReady("DEALER", p.name)...))
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
	_ = p.sendRaw(id, append(zmtpGreeting(), zmtpReady("ROUTER", "")...))
}

// feed parses bytes of connection c and handles the messages they end.
func (p *Plane) feed(c *conn, data []byte) {
	ended := false
	err := c.rd.feed(data, func(frames [][]byte, dropped error) {
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
	})
	if err != nil {
		p.stats.cut.Add(1)
		p.warn.Warn("proto", "control: connection closed: protocol error", "peer", c.name, "address", c.host, "err", err)
		p.cut(c)
		return
	}
	switch {
	case !c.rd.inMessage():
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
		err := p.sendRaw(c.id, msg)
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
		err := p.sendRaw(c.id, c.backlog[0])
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

func (p *Plane) malformed(what, peer string, err error) {
	p.stats.malformed.Add(1)
	if errors.Is(err, ErrOverBudget) {
		p.warn.Warn("budget", "control: dropped "+what, "peer", peer, "err", err)
		return
	}
	p.warn.Warn("malformed", "control: dropped malformed "+what, "peer", peer, "err", err)
}
