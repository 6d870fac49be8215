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
// touches the memory it named (see SAFETY.md in the project's shared docs).
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

	"github.com/kvferry/kvferry/engine/control"
	"github.com/kvferry/kvferry/engine/fence"
	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/requests"
	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/engine/transport/local"
	"github.com/kvferry/kvferry/engine/transport/rdma"
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
	opts  Options
	log   *slog.Logger
	reg   *memory.Registry
	plane *control.Plane
	tcp   *tcp.Transport
	local *local.Transport
	rdma  *rdma.Transport    // nil without RDMA devices or with Protocol "tcp"
	desc  control.Descriptor // transports part; buffers are filled per request
	epoch atomic.Uint64

	// peerLog rate-limits the warnings a peer can cause.
	peerLog *ratelog.Limiter

	resolver Resolver

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
	noRIDWarned map[string]bool

	// Initiator side: tombstones of requests owners aborted. abortMu is
	// held shared by Submit from its tombstone check until its tasks are
	// listed in their batch and the task index, and exclusively by an
	// ABORT's handler.
	abortMu       sync.RWMutex
	tombs         map[tombKey]*tombstone
	tombQueues    map[string][]uint64 // per owner, its tombstones' request ids, oldest first
	maxTombOwners int                 // MaxTombstoneOwners; tests lower it
	tasks         taskIndex           // tasks in flight by request id

	// The drain pool: aborted requests' drains, run by at most
	// maxDrainers goroutines.
	drainMu  sync.Mutex
	drainQ   []drainJob
	drainers int

	// Owner side of the rdma fence: aborts per initiator whose QPs were
	// fenced and that initiator has not acknowledged; it may not connect
	// new QPs meanwhile (see rdma.Options.AdmitInitiator).
	fenceMu sync.Mutex
	fenced  map[string]map[abortKey]struct{}
	nfenced int

	protoMu   sync.Mutex
	protoSaid map[string]string // peer -> transport chosen, logged once

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
}

type engineCounters struct {
	bytesWritten, bytesRead                             atomic.Uint64
	tasksCompleted, tasksFailed, tasksCanceled, retries atomic.Uint64
	tasksInFlight                                       atomic.Int64
	abortsSafe, abortsNotSafe, abortAcks, acksUnmatched atomic.Uint64
	abortResends, abortsReceived, controlDropped        atomic.Uint64
	acksSent, ownerStageRefused                         atomic.Uint64
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
	// the name the user gave as its segment name.
	bindHost, advertise, err := resolveListenHost(host)
	if err != nil {
		return nil, fmt.Errorf("kvferry: %w: %w", ErrInvalidArg, err)
	}
	e := &Engine{
		opts: opts, log: opts.Logger, peerLog: ratelog.New(opts.Logger), reg: memory.NewRegistry(),
		segments: map[string]*Segment{}, live: map[*Batch]struct{}{},
		closed: make(chan struct{}), allocs: map[uint64][]byte{},
		reqs:    requests.New(requests.Options{MaxTombstones: opts.MaxTombstones, TombstoneTTL: opts.TombstoneTTL}),
		pending: map[abortKey]*pendingAbort{}, tombs: map[tombKey]*tombstone{}, tombQueues: map[string][]uint64{},
		events: make(chan Event, opts.EventQueue), efd: -1, maxTombOwners: MaxTombstoneOwners,
		fenced: map[string]map[abortKey]struct{}{}, protoSaid: map[string]string{}, admitted: newAccessCache(),
		fences: fence.New(0), planners: map[string]time.Time{}, pendFences: map[uint64]*pendingFence{},
	}
	e.closeCtx, e.cancel = context.WithCancel(context.Background())
	plane, err := control.ListenWith(bindHost, opts.Port, control.Options{
		MaxConns: opts.ControlMaxConns, MaxConnsPerHost: opts.ControlMaxConnsPerHost,
		BufferBytes: uint64(opts.ControlBufferMiB) << 20, Advertise: advertise,
	}, e.log)
	if err != nil {
		// Mostly a host that is not ours or a port in use: the options'
		// fault, not an internal one.
		e.cancel()
		return nil, fmt.Errorf("kvferry: %w: %w", ErrInvalidArg, err)
	}
	e.plane = plane
	e.tcp = tcp.New(tcp.Options{
		ListenHost: bindHost, IOTimeout: opts.IOTimeout, Logger: e.log, ApplyDelay: opts.Testing.ApplyDelay,
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
		Transports: []control.TransportAddr{{Name: "tcp", Addr: tcpAddr}},
	}
	if err := e.startRDMA(); err != nil {
		e.cancel()
		_ = e.tcp.Close()
		_ = plane.Close()
		return nil, fmt.Errorf("kvferry: %w", err)
	}
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
	e.log.Debug("kvferry: engine started", "segment", e.Name(), "tcp", tcpAddr)
	return e, nil
}

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
	errs = append(errs, e.local.Close(), e.tcp.Close())
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

// Stats is a snapshot of an engine's counters.
type Stats struct {
	BytesWritten    uint64 // bytes of completed WRITE tasks we initiated
	BytesRead       uint64 // bytes of completed READ tasks we initiated
	TasksCompleted  uint64
	TasksFailed     uint64 // FAILED, TIMEOUT and ABORTED tasks
	TasksCanceled   uint64
	TasksInFlight   int64
	Retries         uint64 // slices posted again after a broken path
	OwnerBytesIn    uint64 // bytes peers wrote into our memory
	OwnerBytesOut   uint64 // bytes peers read from our memory
	OwnerRefused    uint64 // peer accesses we refused
	RefusedInFlight uint64 // refusals that struck mid-slice
	ProtocolErrors  uint64 // data connections dropped for malformed frames
	ControlDropped  uint64 // malformed control messages dropped
	ControlLate     uint64 // control replies that matched no request
	// Control-plane connections and buffers.
	ControlConns        int    // control connections peers hold to us
	ControlPeers        int    // control connections we hold to peers
	ControlConnsRefused uint64 // control connections closed at once: ControlMaxConns(PerHost) reached
	ControlConnsCut     uint64 // control connections closed for a protocol error or a timeout
	ControlOverBudget   uint64 // control messages dropped unread: ControlBufferMiB spent
	ControlSendFails    uint64 // control messages not sent (no connection for an answer, queue full)
	Registrations       int    // registered ranges
	OpenSegments        int

	// TCP data connections, as owner.
	DataConns     int64  // accepted data connections open now
	ConnsRefused  uint64 // accepted data connections closed at once, at TCPMaxConnsPerPeer or TCPMaxConns
	IdleClosed    uint64 // data connections closed after TCPIdleTimeout without a request
	FrameTimeouts uint64 // data connections closed because a frame came too slowly (TCPFrameTimeout, TCPMinRate)
	AcceptErrors  uint64 // failed accepts on the data port (out of file descriptors...); the loop backs off and goes on
	// TCP paths, as initiator.
	PathsIdledOut uint64 // our paths an owner closed as idle; their slices it had not read were posted again

	// Aborts, as owner.
	AbortsSafe      uint64 // Abort calls that reported Safe
	AbortsNotSafe   uint64 // Abort calls that reported not Safe
	AbortAcks       uint64 // ABORT_ACKs that completed an initiator's part
	AcksUnmatched   uint64 // ABORT_ACKs dropped: late, duplicate, unknown
	AbortResends    uint64 // ABORTs sent again for want of an ACK
	Tombstones      int64  // aborted request ids remembered as owner
	Grants          int    // live grants
	RequestStates   int    // request ids with owner-side state
	TombstonesEvict uint64 // owner tombstones forgotten (aged out or at the cap)
	// CanceledDropped counts CANCELED messages dropped, not told as
	// events: their sender was never admitted nor granted for the request.
	CanceledDropped uint64
	// Aborts, as initiator.
	AbortsReceived      uint64 // ABORT messages received (duplicates too)
	AbortAcksSent       uint64 // ABORT_ACKs handed to the control plane (dropped there when no connection to the owner exists)
	TasksAborted        uint64 // tasks that ended ABORTED
	InitiatorTombstones int    // request ids we know aborted by their owner
	TombstoneOwners     int    // owners we hold tombstones of (at most MaxTombstoneOwners)
	// AbortsDropped counts ABORTs dropped unanswered for want of room (the
	// drain backlog full, or every owner slot busy draining); the owner
	// resends them.
	AbortsDropped uint64
	// TombstoneOwnersForgotten counts owners whose settled tombstones were
	// forgotten to make room for a new owner.
	TombstoneOwnersForgotten uint64
	// GPU staging through host memory.
	StagingInUse int64 // staging buffers taken and not yet given back
	// Peers' accesses to GPU memory refused because the staging they
	// needed stayed past its bound (256 MiB) for a second.
	StagingRefused uint64
	Stagers        int64 // goroutines staging slices right now
	// Events.
	EventsDropped uint64 // events dropped because the queue was full
	Notifications uint64 // notifications received and queued
	// RDMA (zero without the rdma transport).
	RDMANICs            int    // NIC ports in use
	RDMAWorkRequests    uint64 // work requests posted
	RDMAErrorWCs        uint64 // completions with an error status
	RDMAFailovers       uint64 // NIC paths that failed under work and were reconnected
	RDMAFences          uint64 // owner-side fences of an initiator's QPs
	RDMAFencesPending   int    // aborts whose fenced initiator has not acknowledged yet
	RDMANotifications   uint64 // notifications received in-band
	RDMAGPUDmabuf       uint64 // GPU memory registrations through dma-buf
	RDMAGPUPeermem      uint64 // GPU memory registrations as is (nvidia-peermem)
	RDMAStalls          uint64 // NIC paths broken because no work request completed within RDMACompletionTimeout
	RDMAKeyRequests     uint64 // rkey requests answered as owner (one per new request id and key on a path)
	RDMAHolders         int    // (initiator, request id) pairs holding rkeys from us: an abort covers these initiators
	RDMAKeyReleases     uint64 // releases taken from initiators that dropped rkeys unused for a second or more
	RDMAResponderQPs    int    // QPs made for initiators connected to us (at most 16384)
	RDMAConnectsRefused uint64 // initiators' connect requests refused: the responder QP cap reached

	// Fences by memory range.
	FencesSafe         uint64 // Fence calls that reported Safe
	FencesNotSafe      uint64 // Fence calls that reported not Safe
	FenceEpoch         uint64 // the last fence's epoch (0: none yet)
	FenceRefused       uint64 // peer and local accesses refused as planned before a fence
	FenceAcks          uint64 // FENCE_ACKs that answered a planner's part
	FenceAcksUnmatched uint64 // FENCE_ACKs dropped: late, duplicate, unknown
	FencesReceived     uint64 // FENCE notices received as initiator
	// RDMAPostedByNIC counts work requests posted per local NIC port
	// ("name:port"): how work stripes across NICs.
	RDMAPostedByNIC map[string]uint64
}

// Stats returns a snapshot of the counters.
func (e *Engine) Stats() Stats {
	t := e.tcp.Stats()
	c := e.plane.Stats()
	e.segMu.Lock()
	nseg := len(e.segments)
	e.segMu.Unlock()
	rs := e.reqs.Stats()
	e.abortMu.RLock()
	ntomb, nowners := len(e.tombs), len(e.tombQueues)
	e.abortMu.RUnlock()
	var rs2 rdma.Stats
	nics := 0
	if e.rdma != nil {
		rs2, nics = e.rdma.Stats(), len(e.rdma.NICs())
	}
	e.fenceMu.Lock()
	nfenced := e.nfenced
	e.fenceMu.Unlock()
	return Stats{
		RDMANICs: nics, RDMAWorkRequests: rs2.Posted, RDMAErrorWCs: rs2.ErrorCompletions,
		RDMAFailovers: rs2.Failovers, RDMAFences: rs2.Fences, RDMAFencesPending: nfenced,
		RDMANotifications: rs2.Notifies, RDMAGPUDmabuf: rs2.DmabufMRs, RDMAGPUPeermem: rs2.PeermemMRs,
		RDMAStalls: rs2.Stalls, RDMAPostedByNIC: rs2.PostedByNIC,
		RDMAKeyRequests: rs2.KeyRequests, RDMAHolders: rs2.Holders, RDMAKeyReleases: rs2.Releases,
		RDMAResponderQPs: rs2.ResponderQPs, RDMAConnectsRefused: rs2.ConnectsRefused,
		FencesSafe: e.stats.fencesSafe.Load(), FencesNotSafe: e.stats.fencesNotSafe.Load(), FenceEpoch: e.fences.Epoch(),
		FenceRefused: e.stats.fenceRefused.Load(), FenceAcks: e.stats.fenceAcks.Load(),
		FenceAcksUnmatched: e.stats.fenceAcksUnmatched.Load(), FencesReceived: e.stats.fencesReceived.Load(),
		AbortsSafe: e.stats.abortsSafe.Load(), AbortsNotSafe: e.stats.abortsNotSafe.Load(),
		AbortAcks: e.stats.abortAcks.Load(), AcksUnmatched: e.stats.acksUnmatched.Load(),
		AbortResends: e.stats.abortResends.Load(), Tombstones: rs.Tombstones, Grants: rs.Grants,
		RequestStates: e.reqs.Len(), TombstonesEvict: uint64(rs.Evicted),
		AbortsReceived: e.stats.abortsReceived.Load(), AbortAcksSent: e.stats.acksSent.Load(), TasksAborted: e.stats.tasksAborted.Load(),
		InitiatorTombstones: ntomb, TombstoneOwners: nowners, EventsDropped: e.stats.eventsDropped.Load(),
		AbortsDropped: e.stats.abortsDropped.Load(), TombstoneOwnersForgotten: e.stats.tombOwnersForgotten.Load(),
		Notifications: e.stats.notifications.Load(), CanceledDropped: e.stats.canceledDropped.Load(),
		StagingInUse: e.stats.stagingInUse.Load(), StagingRefused: e.stats.ownerStageRefused.Load(), Stagers: e.stats.stagers.Load(),
		BytesWritten: e.stats.bytesWritten.Load(), BytesRead: e.stats.bytesRead.Load(),
		TasksCompleted: e.stats.tasksCompleted.Load(), TasksFailed: e.stats.tasksFailed.Load(),
		TasksCanceled: e.stats.tasksCanceled.Load(), TasksInFlight: e.stats.tasksInFlight.Load(),
		Retries: e.stats.retries.Load(), OwnerBytesIn: t.BytesIn, OwnerBytesOut: t.BytesOut,
		OwnerRefused: t.Refused, RefusedInFlight: t.RefusedInFlight, ProtocolErrors: t.ProtocolErrors,
		DataConns: t.Conns, ConnsRefused: t.RefusedPerPeer + t.RefusedTotal, IdleClosed: t.IdleClosed,
		FrameTimeouts: t.FrameTimeouts, PathsIdledOut: t.GoAways, AcceptErrors: t.AcceptErrors,
		ControlDropped: c.Malformed + e.stats.controlDropped.Load(), ControlLate: c.Unmatched, Registrations: e.reg.Len(), OpenSegments: nseg,
		ControlConns: c.Conns, ControlPeers: c.Peers, ControlConnsRefused: c.ConnsRefused, ControlConnsCut: c.ConnsCut,
		ControlOverBudget: c.OverBudget, ControlSendFails: c.SendFails,
	}
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
		var wg sync.WaitGroup
		for _, s := range segs {
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
				typ, body, err := e.plane.Request(ctx, s.name, control.MsgPing, nil)
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
