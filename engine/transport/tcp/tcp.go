// Package tcp is kvferry's TCP transport: persistent connections that send
// straight from registered memory and receive straight into it, with every
// access checked by the owner chunk by chunk.
//
// A WRITE completes at the initiator only after the owner answered that its
// bytes were applied, so COMPLETED means landed. The owner copies bytes with
// non-blocking syscalls and holds its memory guard only around each one, so a
// peer stopped mid-frame never stalls an unregistration, an Abort or a
// Fence. See the frame layout in wire.go.
package tcp

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvferry/kvferry/engine/auth"
	"github.com/kvferry/kvferry/engine/kvcodec"
	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/internal/defaults"
	"github.com/kvferry/kvferry/internal/ratelog"
)

// Options configure a TCP transport. Zero fields take the defaults below.
type Options struct {
	// ListenHost is the host to listen on; port is always chosen by the
	// kernel. Default "127.0.0.1".
	ListenHost string
	// IOTimeout bounds one socket write, plus its length at MinRate (as
	// for a frame arriving: a large slice on a link above MinRate is not
	// cut); the connection is closed when it expires. Default 30 s.
	IOTimeout time.Duration
	// HandshakeTimeout bounds the HELLO exchange. Default 5 s.
	HandshakeTimeout time.Duration
	// UserTimeout is TCP_USER_TIMEOUT: how long sent data may stay
	// unacknowledged before the kernel declares the peer dead. Default 10 s.
	UserTimeout time.Duration
	// MaxConnsPerPeer caps the data connections accepted from one remote
	// IP address and open at once, counted from the accept (before the
	// handshake). The key is the address the kernel connected, not the
	// name a peer gives in HELLO: names are unauthenticated, so a peer
	// could dodge a cap per name by inventing names, or use up another
	// peer's share by borrowing its name. A connection past the cap is
	// closed at once and counted (Stats.RefusedPerPeer). An IPv6 peer is
	// keyed by its whole address (hosts of one subnet often share a /64);
	// MaxConns bounds one that holds many addresses. Default 1024: an
	// initiator engine opens one connection per path (engine PathsPerPeer,
	// 4 by default, 64 at most) to each owner, so this leaves room for
	// sixteen engines per host at the largest path count.
	MaxConnsPerPeer int
	// MaxConns caps the data connections accepted and open at once, from
	// every address together; past it a connection is closed at once and
	// counted (Stats.RefusedTotal). Default 8192.
	MaxConns int
	// IdleTimeout closes an accepted connection on which no request is in
	// progress (every request read was answered, and no byte of the next
	// one came) for this long. An initiator that says it understands
	// GOAWAY (this version's does) is told which requests were read, so it
	// posts the others again on a new connection without failing them.
	// Default 2 min.
	IdleTimeout time.Duration
	// FrameTimeout and MinRate bound how long one frame may take to
	// arrive once its first byte was waited for: FrameTimeout plus its
	// length (header and payload) at MinRate bytes per second. A
	// connection whose frame is late is closed and counted
	// (Stats.FrameTimeouts). Defaults 10 s and 1 MiB/s: a 1 MiB slice may
	// take 11 s, a 64 MiB one 74 s, far slower than any link that
	// carries KV caches, while a peer trickling bytes to hold a
	// connection and its memory is cut.
	FrameTimeout time.Duration
	MinRate      int
	// Logger receives connection-level events. Default slog.Default().
	Logger *slog.Logger
	// ApplyDelay is for tests only: the owner sleeps this long after
	// admitting each WRITE and before applying its bytes (and each READ it
	// answers compressed, before reading its bytes), so that a test can
	// abort while frames are certainly in flight.
	ApplyDelay time.Duration
	// Auth, when set, authenticates every data connection both ways
	// before a byte of memory moves (see auth.go): an initiator whose key
	// it does not allow is refused (Stats.AuthRefused), and Dial fails
	// with ErrUnauthenticated against an owner that does not prove an
	// allowed key or does not authenticate at all. Nil: no
	// authentication, the wire of earlier versions.
	Auth *auth.Authority
	// Compressor, when set, compresses the data we send of slices of at
	// least CompressMin bytes, when the block is smaller than the slice:
	// our WRITEs to owners that take compressed WRITEs, and our answers to
	// READs of initiators that take compressed answers (both say so in the
	// handshake; this version's always do).
	Compressor  *kvcodec.Encoder
	CompressMin int
	// CompressAuto compresses only while it pays on the path: each path
	// measures the time per byte of its groups sent compressed and plain
	// and takes the faster (see autoCompress).
	CompressAuto bool
	// AdvertiseHost is the host peers dial our data port by when it is not
	// the bound address (a name, NAT's outside address). With Auth, an
	// initiator's handshake names the address it dialed, and only ours
	// (this host, the bound address, or a local one under a wildcard
	// bind, with our port) are accepted.
	AdvertiseHost string
}

// Defaults of Options.
const (
	DefaultMaxConnsPerPeer = 1024
	DefaultMaxConns        = 8192
	DefaultIdleTimeout     = 2 * time.Minute
	DefaultFrameTimeout    = 10 * time.Second
	DefaultMinRate         = 1 << 20
)

func (o *Options) fill() {
	if o.ListenHost == "" {
		o.ListenHost = "127.0.0.1"
	}
	defaults.Fill(&o.IOTimeout, 30*time.Second)
	defaults.Fill(&o.HandshakeTimeout, 5*time.Second)
	defaults.Fill(&o.UserTimeout, 10*time.Second)
	defaults.Fill(&o.MaxConnsPerPeer, DefaultMaxConnsPerPeer)
	defaults.Fill(&o.MaxConns, DefaultMaxConns)
	defaults.Fill(&o.IdleTimeout, DefaultIdleTimeout)
	defaults.Fill(&o.FrameTimeout, DefaultFrameTimeout)
	defaults.Fill(&o.MinRate, DefaultMinRate)
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
}

// Stats are the transport's counters.
type Stats struct {
	BytesIn         uint64 // bytes written into owner memory by peers
	BytesOut        uint64 // bytes read from owner memory by peers
	Refused         uint64 // accesses refused by the owner
	RefusedInFlight uint64 // refusals that struck after some bytes had moved
	ProtocolErrors  uint64 // connections dropped for a malformed frame
	AcceptErrors    uint64 // accepts that failed (out of file descriptors, ...), each retried after a backoff
	Conns           int64  // accepted connections open now
	RefusedPerPeer  uint64 // accepted connections closed at once: their address had MaxConnsPerPeer open
	RefusedTotal    uint64 // accepted connections closed at once: MaxConns were open
	IdleClosed      uint64 // accepted connections closed after IdleTimeout without a request
	FrameTimeouts   uint64 // accepted connections closed because a frame (HELLO included) came too slowly
	GoAways         uint64 // our paths an owner closed as idle; their slices it had not read were handed back
	AuthRefused     uint64 // connections refused for authentication, or cut when their key left the allowlist
	// Compressed data (WRITE_Z, READ_DATA_Z). As receiver: block bytes
	// received and the bytes they decoded to, blocks refused for want of
	// decoding room (WRITE_Z), malformed blocks. As sender: slices sent
	// compressed, their bytes before and after.
	CompressedIn        uint64
	CompressedRawIn     uint64
	CompressedRefused   uint64
	CompressedMalformed uint64
	CompressedSlices    uint64
	CompressedRawOut    uint64
	CompressedOut       uint64
}

type counters struct {
	bytesIn, bytesOut, refused, refusedInFlight, protocolErrors, acceptErrors     atomic.Uint64
	refusedPerPeer, refusedTotal, idleClosed, frameTimeouts, goAways, authRefused atomic.Uint64
	compressedIn, compressedRawIn, compressedRefused, compressedMalformed         atomic.Uint64
	compressedSlices, compressedRawOut, compressedOut                             atomic.Uint64
}

// Transport is the TCP transport. It is safe for concurrent use.
type Transport struct {
	opts    Options
	owner   transport.Owner
	ln      *net.TCPListener
	conns   connSet
	wg      sync.WaitGroup
	closing atomic.Bool
	closed  chan struct{} // closed by Close
	stats   counters
	limits  connLimits
	// WRITE_Z: the decoding room shared by every connection, and the
	// decoder (made at the first block).
	zBudget byteBudget
	// readZBudget: the room of compressed READ answers, every connection
	// together.
	readZBudget byteBudget
	zdecOnce    sync.Once
	zdec        *kvcodec.Decoder
	zdecErr     error
	// enc compresses our WRITEs to owners that take WRITE_Z; nil: off.
	enc  *kvcodec.Encoder
	warn *ratelog.Limiter // peer-caused warnings

	epMu      sync.Mutex
	endpoints map[*endpoint]struct{}

	// With Options.Auth: accepted connections that authenticated, so
	// CutUnallowed finds those whose key left the allowlist.
	authMu sync.Mutex
	authed map[*authedConn]struct{}
}

// New returns a TCP transport.
func New(opts Options) *Transport {
	opts.fill()
	return &Transport{
		opts: opts, conns: connSet{conns: map[net.Conn]struct{}{}}, endpoints: map[*endpoint]struct{}{}, closed: make(chan struct{}),
		authed: map[*authedConn]struct{}{},
		limits: connLimits{perPeer: map[netip.Addr]int{}}, warn: ratelog.New(opts.Logger),
		zBudget: byteBudget{max: zBudgetBytes}, readZBudget: byteBudget{max: readZBudgetBytes}, enc: opts.Compressor,
	}
}

// Name returns "tcp".
func (t *Transport) Name() string { return "tcp" }

// OwnerCopies reports true: the owner's own code copies every byte, so its
// refusal is a fence (transport.OwnerCopier).
func (t *Transport) OwnerCopies() bool { return true }

// Listen starts serving peers' accesses and returns "host:port".
func (t *Transport) Listen(owner transport.Owner) (string, error) {
	if t.ln != nil {
		return "", errors.New("tcp: already listening")
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(t.opts.ListenHost, "0"))
	if err != nil {
		return "", fmt.Errorf("tcp: listen on %s: %w", t.opts.ListenHost, err)
	}
	t.owner = owner
	t.ln = ln.(*net.TCPListener)
	t.wg.Add(1)
	go t.accept()
	return ln.Addr().String(), nil
}

// Bounds of the backoff after a failed accept.
const (
	acceptBackoffMin = 5 * time.Millisecond
	acceptBackoffMax = time.Second
)

// accept serves every connection until Close. An accept that fails (the
// process is out of file descriptors, the kernel out of memory) is retried
// after a backoff, never the end of serving: a peer that opens connections
// until the owner runs out must not stop it for good.
func (t *Transport) accept() {
	defer t.wg.Done()
	var backoff time.Duration
	for {
		c, err := t.ln.AcceptTCP()
		if err != nil {
			if t.closing.Load() || errors.Is(err, net.ErrClosed) {
				return
			}
			t.stats.acceptErrors.Add(1)
			if backoff == 0 {
				// Once per run of failures: a full process logs nothing more
				// until an accept succeeds again.
				t.opts.Logger.Warn("tcp: accept failed; retrying with backoff", "err", err)
			}
			backoff = min(max(2*backoff, acceptBackoffMin), acceptBackoffMax)
			select {
			case <-t.closed:
				return
			case <-time.After(backoff):
			}
			continue
		}
		backoff = 0
		peer := remoteIP(c)
		if !t.admitConn(peer) {
			_ = c.Close()
			continue
		}
		t.tune(c)
		if !t.conns.add(c) {
			t.limits.release(peer)
			_ = c.Close()
			return
		}
		t.wg.Add(1)
		go func() {
			t.serve(c, peer)
			t.conns.remove(c)
			t.limits.release(peer)
		}()
	}
}

// admitConn takes a place for a connection accepted from peer, or counts
// and reports its refusal: the caller then closes it before reading a byte.
func (t *Transport) admitConn(peer netip.Addr) bool {
	switch t.limits.take(peer, t.opts.MaxConnsPerPeer, t.opts.MaxConns) {
	case connAdmitted:
		return true
	case connOverPeer:
		t.stats.refusedPerPeer.Add(1)
		t.warn.Warn("conn-cap-peer "+peer.String(), "tcp: refusing a data connection: its address has too many open",
			"remote", peer.String(), "max_conns_per_peer", t.opts.MaxConnsPerPeer)
	default:
		t.stats.refusedTotal.Add(1)
		t.warn.Warn("conn-cap-total", "tcp: refusing a data connection: too many open",
			"remote", peer.String(), "max_conns", t.opts.MaxConns)
	}
	return false
}

// remoteIP is the address a connection came from; IPv4 in IPv6 reads as
// IPv4, so one peer has one key whatever the listening socket's family.
func remoteIP(c *net.TCPConn) netip.Addr {
	if a, ok := c.RemoteAddr().(*net.TCPAddr); ok {
		return a.AddrPort().Addr().Unmap()
	}
	return netip.Addr{}
}

// connLimits counts accepted connections, per remote address and in total.
type connLimits struct {
	mu      sync.Mutex
	total   int
	perPeer map[netip.Addr]int
}

// Outcomes of connLimits.take.
const (
	connAdmitted = iota
	connOverPeer
	connOverTotal
)

// take counts a connection from peer in unless that reaches a cap.
func (l *connLimits) take(peer netip.Addr, maxPeer, maxTotal int) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.total >= maxTotal {
		return connOverTotal
	}
	if l.perPeer[peer] >= maxPeer {
		return connOverPeer
	}
	l.total++
	l.perPeer[peer]++
	return connAdmitted
}

// release counts a connection from peer out.
func (l *connLimits) release(peer netip.Addr) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.total--
	if n := l.perPeer[peer] - 1; n > 0 {
		l.perPeer[peer] = n
	} else {
		delete(l.perPeer, peer) // the map holds only addresses with connections open
	}
}

// open returns the connections counted in.
func (l *connLimits) open() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.total
}

// tune sets keepalive and TCP_USER_TIMEOUT, so a dead peer is found without
// waiting for a reset.
func (t *Transport) tune(c *net.TCPConn) {
	_ = c.SetNoDelay(true)
	_ = c.SetKeepAliveConfig(net.KeepAliveConfig{Enable: true, Idle: 5 * time.Second, Interval: time.Second, Count: 5})
	if rc, err := c.SyscallConn(); err == nil {
		_ = rc.Control(func(fd uintptr) {
			_ = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(t.opts.UserTimeout/time.Millisecond))
		})
	}
}

// Dial opens one connection to a peer and says HELLO with our segment name.
func (t *Transport) Dial(ctx context.Context, addr, self string) (transport.Endpoint, error) {
	if t.closing.Load() {
		return nil, transport.ErrClosed
	}
	maxName := maxHelloName
	if t.opts.Auth != nil {
		maxName -= helloAuthPrefix + 2 + len(addr)
	}
	if len(self) == 0 || len(self) > maxName {
		return nil, fmt.Errorf("tcp: dial %s: our name %q must be 1 to %d bytes", addr, self, maxName)
	}
	// The whole dial, HELLO included, ends by ctx's deadline or
	// HandshakeTimeout, whichever is sooner: a stopped peer's kernel still
	// completes the TCP connect.
	deadline := time.Now().Add(t.opts.HandshakeTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	d := net.Dialer{Deadline: deadline}
	nc, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("tcp: dial %s: %w: %w", addr, transport.ErrConnection, err)
	}
	conn := nc.(*net.TCPConn)
	t.tune(conn)
	// Until the handshake is done the connection is only in conns, so
	// Close can cut it; cancellation of ctx cuts it too.
	if !t.conns.add(conn) {
		_ = conn.Close()
		return nil, transport.ErrClosed
	}
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Unix(1, 0)) })
	ep, err := newEndpoint(t, conn, addr, self, deadline)
	stopped := stop()
	t.conns.remove(conn)
	if err == nil && !stopped {
		err = ctx.Err()
	}
	if err != nil {
		if ep != nil {
			ep.Abort(err)
		}
		_ = conn.Close()
		return nil, fmt.Errorf("tcp: handshake with %s: %w: %w", addr, transport.ErrConnection, err)
	}
	t.epMu.Lock()
	if t.endpoints == nil || ep.Dead() {
		t.epMu.Unlock()
		ep.Abort(transport.ErrClosed)
		return nil, fmt.Errorf("tcp: dial %s: %w: path died at once", addr, transport.ErrConnection)
	}
	if t.opts.Auth != nil && !t.opts.Auth.Allowed(ep.ownerKey) {
		// The allowlist was reloaded during the handshake; CutUnallowed
		// scans endpoints under epMu, so checking here leaves no gap.
		t.epMu.Unlock()
		ep.Abort(ErrUnauthenticated)
		return nil, fmt.Errorf("tcp: dial %s: %w: the owner's key left the allowlist", addr, ErrUnauthenticated)
	}
	t.endpoints[ep] = struct{}{}
	t.epMu.Unlock()
	return ep, nil
}

func (t *Transport) forget(ep *endpoint) {
	t.epMu.Lock()
	if t.endpoints != nil {
		delete(t.endpoints, ep)
	}
	t.epMu.Unlock()
}

// Close stops listening, cuts every connection (ours and peers'), fails
// outstanding slices, and returns once no goroutine of the transport runs.
func (t *Transport) Close() error {
	if !t.closing.CompareAndSwap(false, true) {
		return nil
	}
	close(t.closed)
	if t.ln != nil {
		_ = t.ln.Close()
	}
	t.conns.closeAll()
	t.epMu.Lock()
	eps := t.endpoints
	t.endpoints = nil
	t.epMu.Unlock()
	for ep := range eps {
		ep.Abort(transport.ErrClosed)
	}
	t.wg.Wait()
	return nil
}

// writeDeadline is the deadline of a socket write of n bytes starting now:
// IOTimeout plus n at MinRate, the pace a frame arriving is allowed
// (frameTime), so neither side cuts a frame the other would accept.
func (t *Transport) writeDeadline(n int) time.Time {
	return time.Now().Add(t.opts.IOTimeout + time.Duration(int64(n)*int64(time.Second)/int64(t.opts.MinRate)))
}

// Stats returns a snapshot of the counters.
func (t *Transport) Stats() Stats {
	return Stats{
		BytesIn: t.stats.bytesIn.Load(), BytesOut: t.stats.bytesOut.Load(),
		Refused: t.stats.refused.Load(), RefusedInFlight: t.stats.refusedInFlight.Load(),
		ProtocolErrors: t.stats.protocolErrors.Load(), AcceptErrors: t.stats.acceptErrors.Load(),
		Conns: int64(t.limits.open()), RefusedPerPeer: t.stats.refusedPerPeer.Load(), RefusedTotal: t.stats.refusedTotal.Load(),
		IdleClosed: t.stats.idleClosed.Load(), FrameTimeouts: t.stats.frameTimeouts.Load(), GoAways: t.stats.goAways.Load(),
		AuthRefused:  t.stats.authRefused.Load(),
		CompressedIn: t.stats.compressedIn.Load(), CompressedRawIn: t.stats.compressedRawIn.Load(), CompressedRefused: t.stats.compressedRefused.Load(),
		CompressedMalformed: t.stats.compressedMalformed.Load(), CompressedSlices: t.stats.compressedSlices.Load(),
		CompressedRawOut: t.stats.compressedRawOut.Load(), CompressedOut: t.stats.compressedOut.Load(),
	}
}

// decoder returns the WRITE_Z decoder, made at the first use.
func (t *Transport) decoder() (*kvcodec.Decoder, error) {
	t.zdecOnce.Do(func() { t.zdec, t.zdecErr = kvcodec.NewDecoder() })
	return t.zdec, t.zdecErr
}
