package control

// The plane's types, its options and counters, and its life: Listen, Start,
// Close. The loop is in plane_loop.go, the connection table in
// plane_conns.go, our requests and one-way sends in plane_request.go, and
// the answers to peers' requests in plane_serve.go.

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvferry/kvferry/engine/auth"
	"github.com/kvferry/kvferry/internal/defaults"
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
	// Auth, when set, runs CURVE on every connection both ways: a peer
	// whose key Auth does not allow, or that speaks NULL, is refused
	// during the handshake and never reaches a handler; we send nothing
	// to a peer that does not prove a key Auth allows. Nil: the NULL
	// mechanism, open to anyone (Mooncake's behaviour).
	Auth *auth.Authority
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
	defaults.Fill(&o.MaxConns, DefaultMaxConns)
	defaults.Fill(&o.MaxConnsPerHost, DefaultMaxConnsPerHost)
	defaults.Fill(&o.BufferBytes, DefaultBufferBytes)
	defaults.Fill(&o.HandshakeTimeout, DefaultHandshakeTimeout)
	defaults.Fill(&o.MessageTimeout, DefaultMessageTimeout)
	defaults.Fill(&o.MaxQueued, DefaultMaxQueued)
	defaults.Fill(&o.PeerIdleTimeout, DefaultPeerIdleTimeout)
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
	AuthRefused   uint64 // connections refused for authentication: peers not let in, and peers we would not trust
}

type counters struct {
	received, malformed, unmatched, sendFails, refused, cut, overBudget, authRefused atomic.Uint64
	conns, peers                                                                     atomic.Int64
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
	fn     func() // run on the loop (Revoke, PeerKey)
}

type reply struct {
	env  Envelope
	body []byte
	err  error // the request failed here (the peer did not authenticate)
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
	sec      *curveSession // with Options.Auth: the connection's CURVE state
	live     bool          // outbound: the TCP connection is up now
	since    time.Time     // when it (re)connected
	msgSince time.Time     // when the message in progress began; zero when none
	used     time.Time     // outbound: when it last carried a message either way
	queue    [][]byte      // outbound: encoded messages waiting for the peer's READY
	closing  bool          // inbound: we closed it, libzmq has not yet (see closeInbound)
	backlog  [][]byte      // inbound: replies libzmq's send queue refused, in order
	blBytes  int           // their bytes
	blSince  time.Time     // when the backlog last became non-empty
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
		OverBudget: p.stats.overBudget.Load(), AuthRefused: p.stats.authRefused.Load(), BufferedBytes: atomic.LoadUint64(&p.buffered) + atomic.LoadUint64(&p.bufferedOut)}
}

func (p *Plane) closeSockets() {
	for _, s := range []*zmq.Socket{p.stream, p.wakeRecv, p.wakeSend} {
		if s != nil {
			_ = s.Close()
		}
	}
}
