// Package engine is kvferry's native Go API: a KV-cache transfer engine in
// the manner of Mooncake's Transfer Engine.
//
// An Engine owns registered memory, a control plane on ZMQ whose "host:port"
// is the engine's segment name, and data-plane transports. Peers open each
// other as segments (a P2P handshake: the descriptor is fetched from the
// segment's own control endpoint, no metadata server) and move bytes with
// batches of one-sided READ and WRITE requests between their own registered
// memory and the peer's. Every request carries a request id, and every
// synchronous call has a deadline: when it returns, the engine no longer
// touches the memory it named (see docs/SAFETY.md).
//
// A transfer to the engine's own name uses a local memcpy transport.
package engine

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvferry/kvferry/engine/auth"
	"github.com/kvferry/kvferry/engine/control"
	"github.com/kvferry/kvferry/engine/fence"
	"github.com/kvferry/kvferry/engine/internal/bounded"
	"github.com/kvferry/kvferry/engine/kvcodec"
	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/metadata"
	"github.com/kvferry/kvferry/engine/requests"
	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/engine/transport/local"
	"github.com/kvferry/kvferry/engine/transport/rdma"
	"github.com/kvferry/kvferry/engine/transport/shm"
	"github.com/kvferry/kvferry/engine/transport/tcp"
	"github.com/kvferry/kvferry/internal/ratelog"
)

// Op is the direction of a request, seen from the initiator.
type Op = transport.Op

// The operations.
const (
	Read  = transport.Read  // copy the segment's memory into ours
	Write = transport.Write // copy our memory into the segment's
)

// BufferKey names one registration; a range registered again gets a new key.
type BufferKey = memory.Key

// Engine is one transfer engine. All methods are safe for concurrent use.
type Engine struct {
	opts Options
	// auth is the engine's identity and allowlist; nil with
	// authentication off. authMu serialises allowlist reloads.
	auth   *auth.Authority
	authMu sync.Mutex
	log    *slog.Logger
	reg    *memory.Registry
	plane  *control.Plane
	tcp    *tcp.Transport
	local  *local.Transport
	rdma   *rdma.Transport // nil without RDMA devices or with Protocol "tcp"
	shm    *shm.Transport  // nil with Protocol "tcp" or "rdma", or with authentication
	// transports are the abilities of tcp, local and rdma (when up), found
	// once by abilitiesOf: every behaviour check goes through them, the
	// concrete fields above only set the transports up, dial and count.
	transports []abilities
	desc       control.Descriptor // transports part; buffers are filled per request
	epoch      atomic.Uint64

	// peerLog rate-limits the warnings a peer can cause.
	peerLog *ratelog.Limiter

	resolver Resolver
	meta     *metadata.Etcd // the cluster's store (Options.Metadata), nil without one

	segMu    sync.Mutex
	segments map[string]*Segment

	liveMu   sync.Mutex
	live     map[*Batch]struct{} // batches with tasks in flight, for Close
	closing  atomic.Bool
	closed   chan struct{}
	closeCtx context.Context // canceled when Close begins
	cancel   context.CancelFunc
	bg       sync.WaitGroup
	retryMu  sync.Mutex     // orders startRetry against Close
	retrying sync.WaitGroup // retry goroutines

	allocMu sync.Mutex
	allocs  map[uint64][]byte

	slabs sync.Pool // *slab, see batch.go

	// Owner side of aborts: request states, and aborts awaiting ACKs.
	reqs    *requests.Table
	pendMu  sync.Mutex
	pending map[abortKey]*pendingAbort

	// Owner side of CANCELED: which initiators were admitted for which
	// request ids lately (request id 0: they write without ids, which
	// Abort warns about once per initiator).
	admitted    accessCache
	noRIDMu     sync.Mutex
	noRIDWarned *bounded.Set[string, struct{}]

	// Initiator side: tombstones of requests owners aborted. abortMu is
	// held shared by Submit from its tombstone check until its tasks are
	// listed in their batch and the task index, and exclusively by an
	// ABORT's handler.
	abortMu       sync.RWMutex
	tombOwners    *bounded.Set[string, *ownerTombs] // by owner, least recently aborting first
	maxTombOwners int                               // MaxTombstoneOwners; tests lower it (setMaxTombOwners)
	tasks         taskIndex                         // tasks in flight by request id

	// The drain pool: aborted requests' drains, run by at most
	// maxDrainers goroutines.
	drainMu  sync.Mutex
	drainQ   []drainJob
	drainers int

	// Owner side of the rdma fence: aborts per initiator whose QPs were
	// fenced and that initiator has not acknowledged; it may not connect
	// new QPs meanwhile (see rdma.Options.AdmitInitiator).
	fenceMu    sync.Mutex
	fenceDebts *bounded.Set[fenceDebt, struct{}]
	fenceOwed  map[string]int // debts per initiator, so a handshake checks its own in O(1)

	protoMu   sync.Mutex
	protoSaid *bounded.Set[string, string] // peer -> transport chosen, logged once

	// Owner side of fences by memory range: the fenced ranges by epoch,
	// the peers that may plan transfers to us (they fetched our
	// descriptor), and fences awaiting FENCE_ACKs (under pendMu).
	fences     *fence.Table
	planMu     sync.Mutex
	planners   map[string]time.Time
	pendFences map[uint64]*pendingFence
	fenceOrder []uint64 // pendFences' epochs, oldest first

	gpu gpu // the CUDA driver, opened on first use of GPU memory

	evMu     sync.Mutex
	events   chan Event
	evClosed bool
	efd      int

	stats engineCounters
	// metrics counts what Stats does not (per peer, latencies, refusals
	// by reason); nil with Options.MetricsOff.
	metrics     *engineMetrics
	metricsAddr string // where the metrics listener serves, "" when none does
	stopMetrics func()
	// traceID is Options.TraceRequest: the request id whose path through
	// the engine is logged at debug level (0: none).
	traceID uint64
}

type engineCounters struct {
	bytesWritten, bytesRead                             atomic.Uint64
	tasksCompleted, tasksFailed, tasksCanceled, retries atomic.Uint64
	tasksInFlight                                       atomic.Int64
	heartbeats, pathsClosedIdle                         atomic.Uint64
	abortsSafe, abortsNotSafe, abortAcks, acksUnmatched atomic.Uint64
	abortResends, abortsReceived, controlDropped        atomic.Uint64
	acksSent, ownerStageRefused, drainRechecked         atomic.Uint64
	fencesSafe, fencesNotSafe, fenceAcks                atomic.Uint64
	fenceAcksUnmatched, fencesReceived, fenceRefused    atomic.Uint64
	eventsDropped, notifications, tasksAborted          atomic.Uint64
	abortsDropped, canceledDropped, tombOwnersForgotten atomic.Uint64
	stagingInUse, stagers                               atomic.Int64
}

// New starts an engine: it binds the control plane on opts.Host:opts.Port
// and the data plane on opts.Host with a free port.
func New(opts Options) (*Engine, error) {
	if !opts.IgnoreEnv {
		if err := opts.applyEnv(); err != nil {
			return nil, fmt.Errorf("kvferry: options from environment: %w: %w", ErrInvalidArg, err)
		}
	}
	if err := opts.fill(); err != nil {
		return nil, fmt.Errorf("kvferry: options: %w: %w", ErrInvalidArg, err)
	}
	host := strings.TrimSuffix(strings.TrimPrefix(opts.Host, "["), "]")
	// A host name ("localhost", the machine's name, an FQDN) is resolved
	// once here: both planes listen on its address, and the engine keeps
	// the name the user gave (or AdvertiseHost) as its segment name.
	hosts, err := planListenHosts(host, opts.AdvertiseHost)
	if err != nil {
		return nil, fmt.Errorf("kvferry: %w: %w", ErrInvalidArg, err)
	}
	authority, err := newAuthority(opts)
	if err != nil {
		return nil, fmt.Errorf("kvferry: %w: %w", ErrInvalidArg, err)
	}
	if authority == nil && !isLoopbackBind(hosts.bind) {
		opts.Logger.Warn("kvferry: listening beyond this host without authentication: any process that reaches the ports can read and write registered memory; set SecretKeyFile and AllowlistFile, or ClusterSecretFile",
			"bind", hosts.bind)
	}
	e := &Engine{
		opts: opts, log: opts.Logger, peerLog: ratelog.New(opts.Logger), reg: memory.NewRegistry(),
		segments: map[string]*Segment{}, live: map[*Batch]struct{}{},
		closed: make(chan struct{}), allocs: map[uint64][]byte{},
		reqs:    requests.New(requests.Options{MaxTombstones: opts.MaxTombstones, TombstoneTTL: opts.TombstoneTTL}),
		pending: map[abortKey]*pendingAbort{},
		events:  make(chan Event, opts.EventQueue), efd: -1,
		fenceDebts: newFenceDebts(maxFenceDebts), fenceOwed: map[string]int{}, protoSaid: newProtoSaid(), noRIDWarned: newNoRIDWarned(), admitted: newAccessCache(),
		fences: fence.New(0), planners: map[string]time.Time{}, pendFences: map[uint64]*pendingFence{},
		auth: authority,
	}
	e.setMaxTombOwners(MaxTombstoneOwners)
	e.closeCtx, e.cancel = context.WithCancel(context.Background())
	plane, err := control.ListenWith(hosts.bind, opts.Port, control.Options{
		MaxConns: opts.ControlMaxConns, MaxConnsPerHost: opts.ControlMaxConnsPerHost,
		BufferBytes: uint64(opts.ControlBufferMiB) << 20, Advertise: hosts.advertise, Auth: authority,
	}, e.log)
	if err != nil {
		// Mostly a host that is not ours or a port in use: the options'
		// fault, not an internal one.
		e.cancel()
		return nil, fmt.Errorf("kvferry: %w: %w", ErrInvalidArg, err)
	}
	e.plane = plane
	e.traceID = opts.TraceRequest
	if !opts.MetricsOff {
		e.metrics = newEngineMetrics(plane.Name(), opts.MetricsPeers)
	}
	var compressor *kvcodec.Encoder
	if c := opts.Compression; c != "" && c != "off" {
		if c == "auto" {
			c = "huff0"
		}
		codec, _ := kvcodec.ParseCodec(c) // fill checked it
		if compressor, err = kvcodec.NewEncoder(codec); err != nil {
			e.cancel()
			_ = plane.Close()
			return nil, fmt.Errorf("kvferry: compression %s: %w", c, err)
		}
	}
	e.tcp = tcp.New(tcp.Options{
		Compressor: compressor, CompressMin: compressMin, CompressAuto: opts.Compression == "auto",
		ListenHost: hosts.bind, IOTimeout: opts.IOTimeout, Auth: authority, AdvertiseHost: hosts.dataHost, Logger: e.log, ApplyDelay: opts.Testing.ApplyDelay,
		MaxConnsPerPeer: opts.TCPMaxConnsPerPeer, MaxConns: opts.TCPMaxConns, IdleTimeout: opts.TCPIdleTimeout,
		FrameTimeout: opts.TCPFrameTimeout, MinRate: opts.TCPMinRate,
	})
	tcpAddr, err := e.tcp.Listen(e)
	if err != nil {
		e.cancel()
		_ = plane.Close()
		return nil, fmt.Errorf("kvferry: %w: %w", ErrInvalidArg, err)
	}
	e.local = local.New(e, plane.Name())
	e.local.ChunkDelay = opts.Testing.LocalChunkDelay
	e.desc = control.Descriptor{
		Name: plane.Name(), Version: control.ProtocolVersion,
		Transports: []control.TransportAddr{{Name: "tcp", Addr: hosts.dataAddr(tcpAddr)}},
	}
	if err := e.startSHM(); err != nil {
		e.cancel()
		_ = e.tcp.Close()
		_ = plane.Close()
		return nil, fmt.Errorf("kvferry: %w", err)
	}
	if err := e.startRDMA(); err != nil {
		e.cancel()
		if e.shm != nil {
			_ = e.shm.Close()
		}
		_ = e.tcp.Close()
		_ = plane.Close()
		return nil, fmt.Errorf("kvferry: %w", err)
	}
	e.findTransports()
	e.resolver = opts.Resolver
	if e.resolver == nil {
		e.resolver = p2pResolver{e.plane}
	}
	plane.Handle(control.MsgGetDescriptor, e.handleGetDescriptor)
	plane.Handle(control.MsgPing, e.handlePing)
	plane.Handle(control.MsgAbort, e.handleAbort)
	plane.Handle(control.MsgAbortAck, e.handleAbortAck)
	plane.Handle(control.MsgNotify, e.handleNotify)
	plane.Handle(control.MsgCanceled, e.handleCanceled)
	plane.Handle(control.MsgTransport, e.handleTransport)
	plane.Handle(control.MsgFence, e.handleFence)
	plane.Handle(control.MsgFenceAck, e.handleFenceAck)
	plane.Start()
	e.bg.Add(1)
	go e.heartbeats()
	e.startMetricsListener()
	if err := e.startMetadata(); err != nil {
		_ = e.Close()
		return nil, fmt.Errorf("kvferry: %w", err)
	}
	e.log.Debug("kvferry: engine started", "segment", e.Name(), "tcp", tcpAddr)
	return e, nil
}

// compressMin is the smallest WRITE compressed (Options.Compression):
// below it the block's headers and the codec's setup eat the gain.
const compressMin = 16 << 10

// Name is the engine's segment name, "host:port" ("[::1]:port" for IPv6).
func (e *Engine) Name() string { return e.plane.Name() }

// Port is the control plane's port.
func (e *Engine) Port() int {
	_, p, _ := net.SplitHostPort(e.Name())
	n, _ := strconv.Atoi(p)
	return n
}

// Descriptor returns this engine's current segment descriptor.
func (e *Engine) Descriptor() *control.Descriptor {
	d := e.desc
	d.Epoch = e.epoch.Load()
	d.FenceEpoch = e.fences.Epoch()
	if e.rdma != nil {
		// The NIC preference matrix changes with the locations registered.
		d.Transports = append([]control.TransportAddr(nil), d.Transports...)
		for i := range d.Transports {
			if d.Transports[i].Name == "rdma" {
				d.Transports[i].Addr = e.rdma.DescriptorAddr()
			}
		}
	}
	regions := e.reg.Regions()
	d.Buffers = make([]control.Buffer, len(regions))
	for i, r := range regions {
		d.Buffers[i] = control.Buffer{Addr: r.Addr, Len: r.Len, Key: uint64(r.Key), Location: r.Location}
	}
	return &d
}

// handlePing answers a heartbeat with our fence epoch: a peer that pings
// us opened our segment and may plan transfers to us, so it is told of
// fences from now on, and learns our epoch even when it finds segments
// through a Resolver of its own (it never fetches our descriptor then).
func (e *Engine) handlePing(from string, _ []byte) (control.MsgType, []byte) {
	e.notePlanner(from) // before the epoch is read, as for a descriptor
	return control.MsgPong, binary.LittleEndian.AppendUint64(nil, e.fences.Epoch())
}

func (e *Engine) handleGetDescriptor(from string, _ []byte) (control.MsgType, []byte) {
	e.notePlanner(from) // before the descriptor reads the fence epoch
	return control.MsgDescriptor, e.Descriptor().Encode()
}

// Close stops new work, cancels transfers still in flight (their tasks end
// CANCELED; call Batch.Wait first to let them finish), cuts every connection
// and returns once no goroutine or socket of the engine remains. Memory from
// AllocBuffer stays mapped until FreeBuffer.
func (e *Engine) Close() error {
	e.retryMu.Lock()
	first := e.closing.CompareAndSwap(false, true)
	e.retryMu.Unlock()
	if !first {
		<-e.closed
		return nil
	}
	e.cancel() // dials under way for retries give up
	if e.meta != nil {
		// Our entry goes first: peers watching stop counting on us.
		if err := e.meta.Close(); err != nil {
			e.log.Debug("kvferry: metadata store: close", "err", err)
		}
	}
	if e.stopMetrics != nil {
		e.stopMetrics()
	}
	e.liveMu.Lock()
	batches := make([]*Batch, 0, len(e.live))
	for b := range e.live {
		batches = append(batches, b)
	}
	e.liveMu.Unlock()
	for _, b := range batches {
		b.cancel(Canceled, ErrClosed)
	}
	e.segMu.Lock()
	segs := e.segments
	e.segments = map[string]*Segment{}
	e.segMu.Unlock()
	for _, s := range segs {
		s.shutdown(ErrClosed)
	}
	e.retrying.Wait()
	var errs []error
	errs = append(errs, e.local.Close())
	if e.shm != nil {
		errs = append(errs, e.shm.Close())
	}
	errs = append(errs, e.tcp.Close())
	if e.rdma != nil {
		errs = append(errs, e.rdma.Close())
	}
	errs = append(errs, e.plane.Close())
	close(e.closed)
	e.bg.Wait()
	e.closeEvents()
	e.freeStages()
	e.log.Debug("kvferry: engine closed", "segment", e.Name())
	return errors.Join(errs...)
}

func (e *Engine) checkOpen() error {
	if e.closing.Load() {
		return ErrClosed
	}
	return nil
}

// startBackground counts a background goroutine in, unless the engine is
// closing; Close waits for those counted.
func (e *Engine) startBackground() bool { return e.startIn(&e.bg) }

// startIn counts a goroutine in wg, unless the engine is closing: retryMu
// orders it against Close, which sets closing under it before waiting on
// wg.
func (e *Engine) startIn(wg *sync.WaitGroup) bool {
	e.retryMu.Lock()
	defer e.retryMu.Unlock()
	if e.closing.Load() {
		return false
	}
	wg.Add(1)
	return true
}

// controlMalformed counts a malformed control message from a peer and logs
// it, rate-limited per kind and peer.
func (e *Engine) controlMalformed(what, from string, err error) {
	e.stats.controlDropped.Add(1)
	e.peerWarn("malformed "+what, from, "kvferry: dropped malformed "+what, "peer", from, "err", err)
}

// peerWarn logs a warning a peer can cause, rate-limited per kind and peer
// (see ratelog): a peer sending garbage must not fill the host's logs.
func (e *Engine) peerWarn(kind, peer, msg string, args ...any) {
	e.peerLog.Warn(kind+"\x00"+peer, msg, args...)
}

// heartbeats pings every open remote segment and declares dead those that
// miss HeartbeatMisses pings in a row.
func (e *Engine) heartbeats() {
	defer e.bg.Done()
	tick := time.NewTicker(e.opts.HeartbeatInterval)
	defer tick.Stop()
	for {
		select {
		case <-e.closed:
			return
		case now := <-tick.C:
			e.reqs.Sweep(now)
			e.sweepTombs(now)
		}
		e.segMu.Lock()
		segs := make([]*Segment, 0, len(e.segments))
		for _, s := range e.segments {
			if !s.self {
				segs = append(segs, s)
			}
		}
		e.segMu.Unlock()
		now := monoNow()
		e.trimIdle(now, segs)
		var wg sync.WaitGroup
		for _, s := range segs {
			if !s.pingDue(now, e.opts.IdleHeartbeatInterval) {
				continue
			}
			e.stats.heartbeats.Add(1)
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx, cancel := context.WithTimeout(context.Background(), e.opts.HeartbeatInterval)
				defer cancel()
				if s.dead.Load() {
					// A dead segment is first probed with a plain
					// connect, so one whose process is gone (refused)
					// costs no control socket; see Segment.heartbeat.
					if err := probe(ctx, s.name); err != nil {
						s.heartbeat(err)
						return
					}
				}
				sent := time.Now()
				typ, body, err := e.plane.Request(ctx, s.name, control.MsgPing, nil)
				if err == nil && e.metrics != nil {
					e.metrics.rtt.Observe(time.Since(sent).Seconds())
				}
				s.heartbeat(err)
				if err == nil && typ == control.MsgPong {
					s.learnFenceEpoch(body)
				}
			}()
		}
		wg.Wait()
	}
}

// resolveListenHost returns the address to listen on for host and, when
// host is a name rather than an address literal, the name to advertise.
// The first IPv4 address is preferred, as peers on IPv4-only networks are
// the common case; a name with only IPv6 addresses listens on the first.
func resolveListenHost(host string) (bind, advertise string, err error) {
	if host == "" {
		return "127.0.0.1", "", nil
	}
	if _, perr := netip.ParseAddr(host); perr == nil {
		return host, "", nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	addrs, err := net.DefaultResolver.LookupNetIP(ctx, "ip", host)
	if err != nil {
		return "", "", fmt.Errorf("resolve host %q: %w", host, err)
	}
	if len(addrs) == 0 {
		return "", "", fmt.Errorf("resolve host %q: no address", host)
	}
	pick := addrs[0]
	for _, a := range addrs {
		if a.Unmap().Is4() {
			pick = a.Unmap()
			break
		}
	}
	return pick.String(), host, nil
}
