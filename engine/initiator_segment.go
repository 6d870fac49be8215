package engine

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kvferry/kvferry/engine/control"
	"github.com/kvferry/kvferry/engine/fence"
	"github.com/kvferry/kvferry/engine/metrics"
	"github.com/kvferry/kvferry/engine/transport"
)

// Resolver fetches a segment's descriptor by name. The default asks the
// segment's own control endpoint (a P2P handshake); a cluster store such as
// etcd can implement it instead.
type Resolver interface {
	Resolve(ctx context.Context, name string) (*control.Descriptor, error)
}

type p2pResolver struct{ plane *control.Plane }

func (r p2pResolver) Resolve(ctx context.Context, name string) (*control.Descriptor, error) {
	// ZMQ connects lazily and retries for ever, so a peer that is not
	// there would cost the whole deadline: a plain TCP connect alongside
	// tells a refused connection at once.
	ctx, cancel := context.WithCancelCause(ctx)
	probed := make(chan struct{})
	go func() {
		defer close(probed)
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp", name)
		if err == nil {
			_ = c.Close()
		} else if errors.Is(err, syscall.ECONNREFUSED) {
			cancel(fmt.Errorf("%w: %s: connection refused (nothing listens there)", control.ErrUnreachable, name))
		}
	}()
	t, body, err := r.plane.Request(ctx, name, control.MsgGetDescriptor, nil)
	cause := context.Cause(ctx)
	cancel(nil)
	<-probed
	if err != nil {
		if errors.Is(cause, control.ErrUnreachable) {
			return nil, cause
		}
		return nil, err
	}
	if t != control.MsgDescriptor {
		return nil, fmt.Errorf("%w: answered %s to GET_DESCRIPTOR", control.ErrMalformed, t)
	}
	d, err := control.DecodeDescriptor(body)
	if err != nil {
		return nil, err
	}
	if d.Name != name {
		return nil, fmt.Errorf("%w: segment %q describes itself as %q", control.ErrMalformed, name, d.Name)
	}
	return d, nil
}

// Segment is an open peer (or the engine itself): its cached descriptor and
// the paths that carry slices to it. Segments are cached by name; opening one
// twice returns the same Segment.
type Segment struct {
	e    *Engine
	name string
	self bool

	refreshing chan struct{} // holds a token while a descriptor fetch runs
	desc       atomic.Pointer[control.Descriptor]

	mu      sync.Mutex
	paths   []*pathRef      // PathsPerPeer entries, nil until dialed
	dialing []chan struct{} // per slot: closed when the dial under way ends
	addr    string          // data-plane address
	shmAddr string          // the peer's shm address, when it offers one
	proto   string          // "tcp", "rdma" or "shm", chosen at each descriptor fetch
	// transport is proto's index into metrics.Transports (local for our
	// own segment), for the metrics, read without the lock.
	transport atomic.Int32
	// peerStat memoizes the metrics' counters of this peer.
	peerStat atomic.Pointer[metrics.Cached]
	closed   error // set by shutdown
	next     atomic.Uint32

	misses atomic.Int32
	dead   atomic.Bool
	// inflight counts our tasks to the segment not yet ended; lastUsed
	// (monoNow) is when one was last submitted; lastPing when the
	// heartbeats last pinged it (0: ping at the next tick). Idle segments
	// are pinged seldom and their paths closed (see trimIdle).
	inflight atomic.Int64
	lastUsed atomic.Int64
	lastPing atomic.Int64
	stale    atomic.Bool // a transfer was refused for a stale key or a fence: refresh before the next plan

	// fences is what the owner told us of its fences: the epoch our
	// transfers are stamped with, and the ranges a stamp is void for
	// (see task.recheck). It starts afresh with each incarnation of the
	// owner.
	fences fence.Known
	// fencedStale: a transfer was refused as fenced; the next Submit asks
	// the owner its epoch first (fenceResync).
	fencedStale atomic.Bool
}

// protocol returns the transport chosen at the last descriptor fetch.
func (s *Segment) protocol() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.proto
}

// Name is the segment's name, "host:port".
func (s *Segment) Name() string { return s.name }

// id is the peer's own name, from its descriptor. It differs from name
// where a custom Resolver maps an alias to the peer.
func (s *Segment) id() string {
	if d := s.desc.Load(); d != nil && d.Name != "" {
		return d.Name
	}
	return s.name
}

// knownAs reports whether a control message from peer (an ABORT) comes
// from this segment's engine: it arrives on the connection we opened by
// the alias, or, when we also reach the engine by its own name, on that one
// (its control socket routes to either), so both names match.
func (s *Segment) knownAs(peer string) bool { return peer == s.name || peer == s.id() }

// Descriptor returns the segment's descriptor: the cached one for a peer,
// the current one for the engine itself.
func (s *Segment) Descriptor() *control.Descriptor {
	if s.self {
		return s.e.Descriptor()
	}
	return s.desc.Load()
}

// OpenSegment opens the segment called name ("host:port"), fetching its
// descriptor; the engine's own name opens the local segment. A name where
// nothing listens fails at once with ErrUnreachable (connection refused); a
// peer that does not answer fails at ctx's deadline.
func (e *Engine) OpenSegment(ctx context.Context, name string) (*Segment, error) {
	if err := e.checkOpen(); err != nil {
		return nil, err
	}
	if _, _, err := net.SplitHostPort(name); err != nil {
		return nil, fmt.Errorf("open segment %q: %w: want host:port: %w", name, ErrInvalidArg, err)
	}
	e.segMu.Lock()
	if s := e.segments[name]; s != nil {
		e.segMu.Unlock()
		return s, nil
	}
	e.segMu.Unlock()
	s := &Segment{e: e, name: name, self: name == e.Name(), refreshing: make(chan struct{}, 1)}
	if s.self {
		s.transport.Store(transportIndex("local"))
	}
	s.paths = make([]*pathRef, e.opts.PathsPerPeer)
	if s.self {
		s.paths = s.paths[:1]
	}
	s.dialing = make([]chan struct{}, len(s.paths))
	s.lastUsed.Store(monoNow())
	if s.self {
		s.desc.Store(e.Descriptor())
	} else if err := s.refresh(ctx); err != nil {
		e.segMu.Lock()
		cached := e.segments[name] != nil
		e.segMu.Unlock()
		if !cached {
			e.plane.Forget(name) // no socket lingers, reconnecting, for a name that failed
		}
		return nil, fmt.Errorf("open segment %q: %w", name, err)
	}
	if _, p2p := e.resolver.(p2pResolver); !p2p && !s.self {
		// The descriptor came from a Resolver of the application's, not
		// from the owner: one ping makes the owner count us among the
		// peers it tells of fences, and tells us its fence epoch, which
		// a stored descriptor may lag. Best effort: the heartbeats do it
		// again every HeartbeatInterval.
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		if typ, body, err := e.plane.Request(pctx, name, control.MsgPing, nil); err == nil && typ == control.MsgPong {
			s.learnFenceEpoch(body)
		}
		cancel()
	}
	e.segMu.Lock()
	defer e.segMu.Unlock()
	if e.closing.Load() {
		return nil, ErrClosed
	}
	if old := e.segments[name]; old != nil {
		return old, nil // a concurrent open won
	}
	e.segments[name] = s
	return s, nil
}

// CloseSegment forgets an open segment: transfers to it still in flight fail,
// and a later OpenSegment fetches its descriptor again.
func (e *Engine) CloseSegment(s *Segment) error {
	if s == nil || s.e != e {
		return fmt.Errorf("close segment: %w: not a segment of this engine", ErrInvalidArg)
	}
	e.segMu.Lock()
	if e.segments[s.name] == s {
		delete(e.segments, s.name)
	}
	e.segMu.Unlock()
	s.shutdown(fmt.Errorf("segment %s closed", s.name))
	if !s.self {
		e.plane.Forget(s.name)
	}
	return nil
}

// refresh fetches the descriptor again.
func (s *Segment) refresh(ctx context.Context) error {
	if s.self {
		s.desc.Store(s.e.Descriptor())
		return nil
	}
	// One fetch at a time, but a caller waiting its turn still keeps its
	// own deadline.
	select {
	case s.refreshing <- struct{}{}:
		defer func() { <-s.refreshing }()
	case <-ctx.Done():
		return fmt.Errorf("%w: waiting for a descriptor fetch: %w", ErrSegmentUnknown, ctx.Err())
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, s.e.opts.DefaultTimeout)
		defer cancel()
	}
	resolver := s.e.resolver
	if r, ok := resolver.(etcdResolver); ok && s.desc.Load() != nil {
		// The store finds a segment; once open, the segment itself is
		// asked: its answer is never behind the store's, and it comes
		// while the store is away.
		resolver = r.p2p
	}
	d, err := resolver.Resolve(ctx, s.name)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrSegmentUnknown, err)
	}
	return s.apply(d)
}

// apply takes a descriptor of the segment, fetched or from the store's
// watch; the caller holds the refreshing token.
func (s *Segment) apply(d *control.Descriptor) error {
	proto, err := s.e.chooseTransport(s.name, d)
	if err != nil {
		return err
	}
	// The tcp address names the peer's incarnation for both transports:
	// it changes when the peer restarts under the same name.
	addr, ok := d.Transport("tcp")
	if !ok {
		return fmt.Errorf("%w: segment offers no tcp transport", ErrUnsupported)
	}
	shmAddr, _ := d.Transport("shm")
	s.mu.Lock()
	s.proto = proto
	if !s.self {
		s.transport.Store(transportIndex(proto))
	}
	s.shmAddr = shmAddr
	if s.addr != "" && s.addr != addr {
		// The peer restarted under the same name: old paths lead nowhere.
		for i, p := range s.paths {
			if p != nil {
				go p.ep.Abort(errors.New("segment restarted"))
				s.paths[i] = nil
			}
		}
		// A new incarnation counts its fences from 0 again. Before the
		// new descriptor is stored: a transfer planned against its keys
		// is stamped with its epochs.
		s.fences.Reset()
	}
	// A descriptor's epoch below ours is not taken for a restart: it may
	// come from a store that lags, or be overtaken by a FENCE. A stamp of
	// ours the owner never issued is refused, and fenceResync asks it.
	s.addr = addr
	s.mu.Unlock()
	s.fences.Learn(d.FenceEpoch)
	s.desc.Store(d)
	return nil
}

// resolve finds the buffer key for [addr, addr+n) at the segment, fetching
// the descriptor again once when the cached one lacks the range.
func (s *Segment) resolve(ctx context.Context, addr, n uint64, refreshed *bool) (BufferKey, error) {
	if s.stale.Load() && !*refreshed {
		// A transfer was refused for a stale key: the peer registered
		// its memory again. Only transfers planned from now on see the
		// new keys; none that started under an old key moves to a new
		// one.
		*refreshed = true
		s.stale.Store(false)
		if err := s.refresh(ctx); err != nil {
			s.stale.Store(true)
			return 0, err
		}
	}
	if b, ok := s.desc.Load().Find(addr, n); ok {
		return BufferKey(b.Key), nil
	}
	if !*refreshed {
		*refreshed = true
		if err := s.refresh(ctx); err != nil {
			return 0, err
		}
		if b, ok := s.desc.Load().Find(addr, n); ok {
			return BufferKey(b.Key), nil
		}
	}
	return 0, fmt.Errorf("[%#x, +%d) at %s: %w", addr, n, s.name, ErrRemoteRange)
}

// pathRef is one dialed path; slices point at the one carrying them, so a
// cancel can stop it.
type pathRef struct{ ep transport.Endpoint }

// path returns a live path, dialing one when the slot is empty or dead. The
// hint spreads slices over slots; a retry passes a different hint. One dial
// per slot runs at a time: others wait for it (or for their ctx), so a dead
// path is not redialed once per slice.
func (s *Segment) path(ctx context.Context, hint uint32) (*pathRef, error) {
	i := int(hint % uint32(len(s.paths)))
	for {
		s.mu.Lock()
		if s.closed != nil {
			s.mu.Unlock()
			return nil, s.closed
		}
		if s.dead.Load() {
			s.mu.Unlock()
			return nil, fmt.Errorf("segment %s: %w", s.name, ErrPeerDead)
		}
		if p := s.paths[i]; p != nil && !p.ep.Dead() {
			s.mu.Unlock()
			return p, nil
		}
		if wait := s.dialing[i]; wait != nil {
			s.mu.Unlock()
			select {
			case <-wait:
				continue
			case <-ctx.Done():
				return nil, fmt.Errorf("segment %s: %w: %w", s.name, transport.ErrConnection, ctx.Err())
			}
		}
		done := make(chan struct{})
		s.dialing[i] = done
		addr := s.addr
		redial := s.paths[i] != nil
		s.mu.Unlock()
		ref, used, err := s.dial(ctx, addr)
		if m := s.e.metrics; m != nil {
			tr := transportIndex(used)
			if err != nil {
				m.dials[tr][1].Add(1)
			} else {
				m.dials[tr][0].Add(1)
				if redial {
					m.redials.Add(1)
				}
			}
		}
		s.mu.Lock()
		s.dialing[i] = nil
		close(done)
		if err == nil {
			if s.closed != nil {
				err = s.closed
				go ref.ep.Abort(s.closed)
			} else {
				s.paths[i] = ref
			}
		}
		s.mu.Unlock()
		return ref, err
	}
}

// dial opens one path, outside the lock: a slow peer must not hold up the
// other slots.
func (s *Segment) dial(ctx context.Context, addr string) (ref *pathRef, used string, err error) {
	var p transport.Endpoint
	s.mu.Lock()
	proto, shmAddr := s.proto, s.shmAddr
	s.mu.Unlock()
	// used and at say which transport and address the dial that counts
	// went to: what an operator needs to tell a dead peer from a
	// firewall, and what the metrics count the dial under.
	used, at := proto, addr
	switch {
	case s.self:
		used, at = "local", "in-process"
		p, err = s.e.local.Dial(ctx, "", s.e.Name())
	case proto == "rdma":
		at = s.name // the rdma handshake goes over the peer's control plane
		p, err = s.e.rdma.Dial(ctx, s.name, s.e.Name())
	case proto == "shm":
		// Slices in memory the owner cannot reach (neither shared nor
		// open to cross-memory attach) take a tcp path of their own.
		at = shmAddr
		p, err = s.e.shm.DialVia(ctx, shmAddr, s.e.Name(), func(ctx context.Context) (transport.Endpoint, error) {
			return s.e.tcp.Dial(ctx, addr, s.e.Name())
		})
		if err != nil && s.e.opts.Protocol == "auto" {
			s.e.peerWarn("shm-dial", s.name, "kvferry: shm path failed; using tcp", "segment", s.name, "shm_addr", shmAddr, "err", err)
			used, at = "tcp", addr
			p, err = s.e.tcp.Dial(ctx, addr, s.e.Name())
		}
	default:
		p, err = s.e.tcp.Dial(ctx, addr, s.e.Name())
	}
	if err != nil {
		return nil, used, fmt.Errorf("segment %s: dial %s path to %s: %w", s.name, used, at, err)
	}
	return &pathRef{ep: p}, used, nil
}

// heartbeat records one ping's outcome. A segment missing HeartbeatMisses in a
// row is declared dead: its paths are cut, so transfers in flight fail now
// rather than when TCP gives up; a later answered ping revives it.
func (s *Segment) heartbeat(err error) {
	if s.e.closing.Load() {
		return // pings fail while the plane closes; that says nothing of the peer
	}
	if err == nil {
		s.misses.Store(0)
		if s.dead.CompareAndSwap(true, false) {
			s.e.log.Info("kvferry: peer answers again", "segment", s.name)
		}
		return
	}
	if int(s.misses.Add(1)) < s.e.opts.HeartbeatMisses {
		return
	}
	// A dead peer keeps no socket of ours: our control connection to it
	// (which would hold a descriptor and reconnect for ever) is closed
	// after every missed ping, and a dead segment is probed with a plain
	// connect before it is pinged again (heartbeats).
	s.e.plane.Forget(s.name)
	if !s.dead.CompareAndSwap(false, true) {
		return
	}
	// Rate-limited: a peer that keeps dropping out and coming back causes
	// this line.
	if m := s.e.metrics; m != nil {
		m.peerDeaths.Add(1)
	}
	s.e.peerWarn("dead", s.name, "kvferry: peer declared dead", "segment", s.name, "misses", s.misses.Load(), "err", err)
	s.cutPaths(fmt.Errorf("segment %s: %w", s.name, ErrPeerDead))
}

// probe connects to a peer's control port and closes the connection at
// once: it tells whether anything listens there without opening a control
// socket.
func probe(ctx context.Context, name string) error {
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", name)
	if err != nil {
		return fmt.Errorf("%w: %s: %w", control.ErrUnreachable, name, err)
	}
	return c.Close()
}

// cutPaths aborts every path; their slices fail and are retried or failed.
func (s *Segment) cutPaths(reason error) {
	s.mu.Lock()
	paths := append([]*pathRef(nil), s.paths...)
	for i := range s.paths {
		s.paths[i] = nil
	}
	s.mu.Unlock()
	for _, p := range paths {
		if p != nil {
			p.ep.Abort(reason)
		}
	}
}

// shutdown closes the segment for good.
func (s *Segment) shutdown(reason error) {
	s.mu.Lock()
	if s.closed == nil {
		s.closed = reason
	}
	s.mu.Unlock()
	s.cutPaths(reason)
}

// pathTimeout bounds dialing a path for a retry.
const pathTimeout = 5 * time.Second
