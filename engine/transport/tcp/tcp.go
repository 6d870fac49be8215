// Package tcp is kvferry's TCP transport: persistent connections that send
// straight from registered memory and receive straight into it, with every
// access checked by the owner chunk by chunk.
//
// A WRITE completes at the initiator only after the owner answered that its
// bytes were applied, so COMPLETED means landed. The owner copies bytes with
// non-blocking syscalls and holds its memory guard only around each one, so a
// peer stopped mid-frame never stalls an unregistration (and, later, an
// abort). See the frame layout in wire.go.
package tcp

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvferry/kvferry/engine/transport"
)

// Options configure a TCP transport. Zero fields take the defaults below.
type Options struct {
	// ListenHost is the host to listen on; port is always chosen by the
	// kernel. Default "127.0.0.1".
	ListenHost string
	// IOTimeout bounds one blocked socket write; the connection is closed
	// when it expires. Default 30 s.
	IOTimeout time.Duration
	// HandshakeTimeout bounds the HELLO exchange. Default 5 s.
	HandshakeTimeout time.Duration
	// UserTimeout is TCP_USER_TIMEOUT: how long sent data may stay
	// unacknowledged before the kernel declares the peer dead. Default 10 s.
	UserTimeout time.Duration
	// Logger receives connection-level events. Default slog.Default().
	Logger *slog.Logger
	// ApplyDelay is for tests only: the owner sleeps this long after
	// admitting each WRITE and before applying its bytes, so that a test
	// can abort while frames are certainly in flight.
	ApplyDelay time.Duration
}

func (o *Options) fill() {
	if o.ListenHost == "" {
		o.ListenHost = "127.0.0.1"
	}
	if o.IOTimeout <= 0 {
		o.IOTimeout = 30 * time.Second
	}
	if o.HandshakeTimeout <= 0 {
		o.HandshakeTimeout = 5 * time.Second
	}
	if o.UserTimeout <= 0 {
		o.UserTimeout = 10 * time.Second
	}
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
}

type counters struct {
	bytesIn, bytesOut, refused, refusedInFlight, protocolErrors, acceptErrors atomic.Uint64
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

	epMu      sync.Mutex
	endpoints map[*endpoint]struct{}
}

// New returns a TCP transport.
func New(opts Options) *Transport {
	opts.fill()
	return &Transport{opts: opts, conns: connSet{conns: map[net.Conn]struct{}{}}, endpoints: map[*endpoint]struct{}{}, closed: make(chan struct{})}
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
		t.tune(c)
		if !t.conns.add(c) {
			_ = c.Close()
			return
		}
		t.wg.Add(1)
		go func() {
			t.serve(c)
			t.conns.remove(c)
		}()
	}
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
	if len(self) == 0 || len(self) > maxHelloName {
		return nil, fmt.Errorf("tcp: dial %s: our name %q must be 1 to %d bytes", addr, self, maxHelloName)
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
	ep, err := newEndpoint(t, conn, self, deadline)
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

// Stats returns a snapshot of the counters.
func (t *Transport) Stats() Stats {
	return Stats{
		BytesIn: t.stats.bytesIn.Load(), BytesOut: t.stats.bytesOut.Load(),
		Refused: t.stats.refused.Load(), RefusedInFlight: t.stats.refusedInFlight.Load(),
		ProtocolErrors: t.stats.protocolErrors.Load(), AcceptErrors: t.stats.acceptErrors.Load(),
	}
}
