// Package rdma is kvferry's RDMA transport: one-sided RDMA WRITE and READ on
// RC queue pairs between every NIC pair of two engines, over libibverbs
// loaded at run time (package verbs).
//
// The handshake rides the engine's control plane (TRANSPORT messages): an
// initiator learns the owner's NICs and preference matrix, connects one QP
// per NIC pair with QPN, PSN, GID/LID and MTU exchanged, and resolves each
// owner buffer key into rkeys once, asking the owner, which admits the
// access like any other. After that the owner's code is not on the data
// path: the owner's NIC writes its memory. Safe abort therefore rests on
// the owner-side fence (Fence: the initiator's responder QPs go to the
// error state, and it may connect again only once it acknowledged the
// abort) or on the initiator's drain (Endpoint.Drain), as SAFETY.md says.
package rdma

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvferry/kvferry/engine/internal/bounded"
	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/verbs"
	"github.com/kvferry/kvferry/verbs/topo"
)

// Errors of the transport; match them with errors.Is.
var (
	// ErrNotAvailable: libibverbs could not be loaded.
	ErrNotAvailable = verbs.ErrNotAvailable
	// ErrNoDevice: no usable RDMA device (none listed, none active, or
	// none left by the device filter).
	ErrNoDevice = verbs.ErrNoDevice
	// ErrFencePending: the owner fenced this initiator for an abort it
	// has not acknowledged yet; it may connect again once it has.
	ErrFencePending = errors.New("abort fence pending: acknowledge the abort before reconnecting")
)

// Exchange sends one TRANSPORT request to peer over the control plane and
// returns the reply body; an error reply from the peer comes back as an
// error.
type Exchange func(ctx context.Context, peer string, body []byte) ([]byte, error)

// Options configure the transport.
type Options struct {
	// Library is the libibverbs file to load (verbs.DefaultLibrary when
	// empty): KVFERRY_IBVERBS_LIBRARY.
	Library string
	// Devices filters devices and ports as topo.ParseFilter reads it:
	// KVFERRY_RDMA_DEVICES.
	Devices string
	// Exchange reaches peers' transports; required.
	Exchange Exchange
	// AdmitInitiator, when set, is asked before an initiator's QPs are
	// connected: an error refuses them (the engine refuses initiators it
	// fenced for an abort they have not acknowledged).
	AdmitInitiator func(initiator string) error
	// Fence enables the owner-side fence ability (Fencer). Off, aborts
	// rest on the initiators' drained ACKs.
	Fence bool
	// Timeout is the verbs ACK timeout exponent (4.096 us << Timeout);
	// 14 (67 ms) when zero. RetryCount is the transport retry count, 6
	// when zero and at most 6: rxe reads 7 as "retry for ever", and a
	// QP whose peer fenced it would then never fail its work.
	Timeout, RetryCount uint8
	// CompletionTimeout is how long a NIC path may hold work requests
	// without any completing before it is declared broken (its QP goes
	// to the error state, which flushes them); 10 s when zero. A peer
	// that stops answering then cannot hold a wait; work requests the
	// provider never completes, not even by a flush, still keep their
	// slices unfinished.
	CompletionTimeout time.Duration
	// RequestTimeout bounds each handshake exchange; 5 s when zero.
	RequestTimeout time.Duration
	// DmaBuf exports GPU memory at location ("cuda:N") as a dma-buf for
	// registration: it returns a file descriptor the caller closes, and
	// where addr lies in it. Without it, or when it or the NIC refuses,
	// GPU memory is registered as is (nvidia-peermem).
	DmaBuf func(location string, addr, n uint64) (fd int, offset uint64, err error)
	// OnNotify takes a notification that arrived in-band from initiator
	// (on a NIC's poller: it must not block).
	OnNotify func(initiator string, requestID uint64, data []byte)
	Logger   *slog.Logger
	// MaxResponderQPs caps the QPs made for initiators connected to us;
	// 0 takes DefaultMaxResponderQPs.
	MaxResponderQPs int
}

// NIC is one opened device port the transport uses.
type NIC struct {
	Index     int
	Name      string
	Port      verbs.Port
	Placement topo.Placement
	ctx       *verbs.Context
	pd        *verbs.PD
	cq        *verbs.CQ
	maxMR     uint64
	maxWR     int

	slots    *slotPool     // notification buffers
	poll     chan struct{} // kicks the poller when work is posted
	inflight atomic.Int64  // work requests posted on this NIC not yet completed
	posted   atomic.Uint64 // work requests posted on this NIC
	recvs    atomic.Int64  // receives posted for notifications
}

// Transport is the RDMA transport of one engine.
type Transport struct {
	opts  Options
	log   *slog.Logger
	lib   *verbs.Library
	nics  []*NIC
	owner transport.Owner

	mrMu sync.RWMutex
	mrs  map[memory.Key]*regMRs

	wrMu   sync.Mutex
	wrs    map[uint64]*wrCtx
	nextWR uint64

	connMu sync.Mutex
	conns  map[string]map[uint64]*respConn // initiator -> conn id -> responder QPs

	holds *holders // which initiators hold rkeys for which request ids

	// Requests (peer, id) with a work request that ended without the
	// responder's answer, on any endpoint, dead ones included: their
	// bytes may still land, so no drain of them is ever promised.
	uncMu     sync.Mutex
	uncertain *bounded.Set[uncertainKey, struct{}]
	uncAll    time.Time // past its cap, every request counts as uncertain until then
	// unsettled holds, per (peer, request), the broken QPs whose flushed
	// work of the request awaits the owner's replacement of their
	// responder QPs: uncertain until then (see markUnsettled).
	unsettled map[uncertainKey]map[*verbs.QP]struct{}

	// Dial, Serve and disconnects in progress, and live endpoints: Close
	// waits for the first and aborts the second before freeing NICs.
	opMu sync.Mutex
	ops  sync.WaitGroup
	eps  map[*Endpoint]struct{}

	closed  chan struct{}
	closing atomic.Bool
	wg      sync.WaitGroup

	stats counters
}

// counters are the transport's counters.
type counters struct {
	Posted, Completed, ErrorCompletions, Failovers, Fences, Reconnects atomic.Uint64
	Notifies, BadNotifies, DmabufMRs, PeermemMRs, Stalls               atomic.Uint64
	KeyRequests, HolderEvictions, Releases                             atomic.Uint64
	ConnectsRefused                                                    atomic.Uint64
	respQPs                                                            atomic.Int64 // responder QPs made and not destroyed
}

// Stats is a snapshot of the transport's counters.
type Stats struct {
	Posted           uint64            // work requests posted
	Completed        uint64            // completions taken
	ErrorCompletions uint64            // completions with an error status
	Failovers        uint64            // NIC paths that failed and were reconnected (or tried)
	Fences           uint64            // owner-side fences
	Reconnects       uint64            // NIC paths reconnected
	Notifies         uint64            // notifications received in-band
	BadNotifies      uint64            // malformed in-band notifications dropped
	DmabufMRs        uint64            // GPU memory registrations through dma-buf
	PeermemMRs       uint64            // GPU memory registrations without (nvidia-peermem)
	Stalls           uint64            // NIC paths broken because no work request completed within CompletionTimeout
	KeyRequests      uint64            // rkey requests answered as owner (one per new request id, key and path epoch)
	Holders          int               // (initiator, request id) pairs holding rkeys from us
	HolderEvictions  uint64            // initiators cut because they held rkeys for too many requests
	Releases         uint64            // releases of rkeys no longer used, taken as owner
	ResponderQPs     int               // QPs made for initiators connected to us
	ConnectsRefused  uint64            // connect requests refused: MaxResponderQPs reached
	PostedByNIC      map[string]uint64 // work requests posted per NIC ("name:port")
}

// Stats returns a snapshot of the counters.
func (t *Transport) Stats() Stats {
	return Stats{
		Posted: t.stats.Posted.Load(), Completed: t.stats.Completed.Load(), ErrorCompletions: t.stats.ErrorCompletions.Load(),
		Failovers: t.stats.Failovers.Load(), Fences: t.stats.Fences.Load(), Reconnects: t.stats.Reconnects.Load(),
		Notifies: t.stats.Notifies.Load(), BadNotifies: t.stats.BadNotifies.Load(),
		DmabufMRs: t.stats.DmabufMRs.Load(), PeermemMRs: t.stats.PeermemMRs.Load(),
		Stalls: t.stats.Stalls.Load(), PostedByNIC: t.postedByNIC(),
		KeyRequests: t.stats.KeyRequests.Load(), Holders: t.holds.count(), HolderEvictions: t.stats.HolderEvictions.Load(),
		Releases: t.stats.Releases.Load(), ResponderQPs: int(t.stats.respQPs.Load()), ConnectsRefused: t.stats.ConnectsRefused.Load(),
	}
}

func (t *Transport) postedByNIC() map[string]uint64 {
	m := make(map[string]uint64, len(t.nics))
	for i, name := range t.NICNames() {
		m[name] = t.nics[i].posted.Load()
	}
	return m
}

// regMRs is one registration on every NIC, split into pieces no larger
// than the smallest device's max MR size.
type regMRs struct {
	region *memory.Region
	pieces []mrPiece
}

type mrPiece struct {
	off, len uint64
	mrs      []*verbs.MR // per NIC
}

// respConn is the owner's side of one initiator connection.
type respConn struct {
	qps map[uint8]*verbs.QP // by the initiator's pair slot
}

// New loads libibverbs, opens every device port the filter keeps and is
// active, and starts a completion poller per NIC.
func New(opts Options) (*Transport, error) {
	if opts.Exchange == nil {
		return nil, errors.New("rdma: no control-plane exchange")
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.Timeout == 0 {
		opts.Timeout = 14
	}
	if opts.RetryCount == 0 || opts.RetryCount > 6 {
		opts.RetryCount = 6
	}
	if opts.MaxResponderQPs <= 0 {
		opts.MaxResponderQPs = DefaultMaxResponderQPs
	}
	if opts.CompletionTimeout <= 0 {
		opts.CompletionTimeout = 10 * time.Second
	}
	if opts.RequestTimeout == 0 {
		opts.RequestTimeout = 5 * time.Second
	}
	filter, err := topo.ParseFilter(opts.Devices)
	if err != nil {
		return nil, fmt.Errorf("rdma: %w", err)
	}
	lib, err := verbs.Open(opts.Library)
	if err != nil {
		return nil, fmt.Errorf("rdma: %w", err)
	}
	t := &Transport{
		opts: opts, log: opts.Logger, lib: lib, mrs: map[memory.Key]*regMRs{},
		wrs: map[uint64]*wrCtx{}, conns: map[string]map[uint64]*respConn{}, closed: make(chan struct{}),
		uncertain: newUncertainSet(nil), unsettled: map[uncertainKey]map[*verbs.QP]struct{}{}, eps: map[*Endpoint]struct{}{}, holds: newHolders(),
	}
	devs, err := lib.Devices()
	if err != nil {
		return nil, fmt.Errorf("rdma: list devices of %s: %w", lib.Path(), err)
	}
	var seen []string
	for _, d := range devs {
		for _, p := range d.Ports {
			desc := fmt.Sprintf("%s:%d", d.Name, p.Num)
			switch {
			case !filter.Match(d.Name, p.Num):
				seen = append(seen, desc+" (filtered out)")
				continue
			case !p.Active():
				seen = append(seen, desc+" (port not active)")
				continue
			case p.Ethernet() && p.GIDIndex < 0:
				seen = append(seen, desc+" (no GID)")
				continue
			}
			if err := t.openNIC(d, p); err != nil {
				seen = append(seen, fmt.Sprintf("%s (%v)", desc, err))
				continue
			}
			seen = append(seen, desc)
		}
	}
	if len(t.nics) == 0 {
		t.closeNICs()
		if len(seen) == 0 {
			return nil, fmt.Errorf("rdma: %w: %s lists no device (it looks in /sys/class/infiniband_verbs: is an RDMA driver loaded?)", ErrNoDevice, lib.Path())
		}
		filt := ""
		if opts.Devices != "" {
			filt = fmt.Sprintf(" with filter %q", opts.Devices)
		}
		return nil, fmt.Errorf("rdma: %w: searched %s of %s%s", ErrNoDevice, strings.Join(seen, ", "), lib.Path(), filt)
	}
	for _, n := range t.nics {
		t.wg.Add(1)
		go t.poller(n)
	}
	t.wg.Add(1)
	go t.watchdog()
	t.log.Debug("kvferry: rdma transport up", "nics", t.NICNames(), "library", lib.Path())
	return t, nil
}

func (t *Transport) openNIC(d verbs.Device, p verbs.Port) error {
	ctx, err := t.lib.OpenContext(d.Index)
	if err != nil {
		return err
	}
	pd, err := ctx.AllocPD()
	if err != nil {
		_ = ctx.Close()
		return err
	}
	cqSize := min(max(ctx.Attr.MaxCQE, 256), 16384)
	cq, err := ctx.CreateCQ(cqSize)
	if err != nil {
		_ = pd.Dealloc()
		_ = ctx.Close()
		return err
	}
	maxMR := ctx.Attr.MaxMRSize
	if maxMR == 0 {
		maxMR = 1 << 30
	}
	n := &NIC{
		Index: len(t.nics), Name: d.Name, Port: p, Placement: topo.ReadPlacement(d.Path),
		ctx: ctx, pd: pd, cq: cq, maxMR: maxMR, maxWR: min(max(ctx.Attr.MaxQPWR, 16), 1024, cqSize/4),
		poll: make(chan struct{}, 1),
	}
	if n.slots, err = newSlotPool(n); err != nil {
		_ = cq.Destroy()
		_ = pd.Dealloc()
		_ = ctx.Close()
		return err
	}
	t.nics = append(t.nics, n)
	return nil
}

func (t *Transport) closeNICs() {
	for _, n := range t.nics {
		n.slots.close()
		_ = n.cq.Destroy()
		_ = n.pd.Dealloc()
		_ = n.ctx.Close()
	}
}

// Name implements transport.Transport.
func (t *Transport) Name() string { return "rdma" }

// NICs returns the NICs in use.
func (t *Transport) NICs() []*NIC { return t.nics }

// NICNames lists the NICs as "name:port".
func (t *Transport) NICNames() []string {
	out := make([]string, len(t.nics))
	for i, n := range t.nics {
		out[i] = n.Name + ":" + strconv.Itoa(n.Port.Num)
	}
	return out
}

// Library is the loaded libibverbs (for tests driving a fake provider).
func (t *Transport) Library() *verbs.Library { return t.lib }

// Listen implements transport.Transport: peers reach the transport
// through the control plane, so the address is self, the segment name.
func (t *Transport) Listen(owner transport.Owner) (string, error) {
	t.owner = owner
	return "cp", nil
}

// OwnerCopies implements transport.OwnerCopier: the NIC writes owner memory.
func (t *Transport) OwnerCopies() bool { return false }

// Matrix is the preference matrix published to peers: for each location of
// registered memory (and "cpu"), NIC indexes best first.
func (t *Transport) Matrix() map[string][]uint8 {
	m, _ := t.matrix()
	return m
}

// matrix is Matrix with the tier of each entry: NICs of one tier are
// equally good for that location.
func (t *Transport) matrix() (order, tiers map[string][]uint8) {
	locs := map[string]bool{"cpu": true}
	t.mrMu.RLock()
	for _, r := range t.mrs {
		locs[r.region.Location] = true
	}
	t.mrMu.RUnlock()
	order, tiers = make(map[string][]uint8, len(locs)), make(map[string][]uint8, len(locs))
	nics := t.topoNICs()
	for _, loc := range sortedKeys(locs) {
		if len(order) >= maxLocations {
			break
		}
		pref, tier := topo.Preference(loc, -1, nics), topo.Tiers(loc, -1, nics)
		idx, tr := make([]uint8, len(pref)), make([]uint8, len(pref))
		for i, p := range pref {
			idx[i], tr[i] = uint8(p), uint8(tier[p])
		}
		order[loc], tiers[loc] = idx, tr
	}
	return order, tiers
}

// DescriptorAddr is what the segment descriptor says of the transport
// (at most 255 bytes): the NICs and, per memory location, their order of
// preference, e.g. "nics=mlx5_0:1,mlx5_1:1;cpu=0,1;cpu:1=1,0". Peers take
// the same from the INFO handshake, which carries GIDs too; this copy is
// for inspection (descriptors are what tools print).
func (t *Transport) DescriptorAddr() string {
	var b strings.Builder
	b.WriteString("nics=" + strings.Join(t.NICNames(), ","))
	m := t.Matrix()
	for _, loc := range sortedKeys(m) {
		idx := make([]string, len(m[loc]))
		for i, v := range m[loc] {
			idx[i] = strconv.Itoa(int(v))
		}
		part := ";" + loc + "=" + strings.Join(idx, ",")
		if b.Len()+len(part) > 255 {
			break
		}
		b.WriteString(part)
	}
	s := b.String()
	if len(s) > 255 {
		s = s[:255]
	}
	return s
}

func (t *Transport) topoNICs() []topo.NIC {
	out := make([]topo.NIC, len(t.nics))
	for i, n := range t.nics {
		out[i] = topo.NIC{Name: n.Name, Port: n.Port.Num, Placement: n.Placement}
	}
	return out
}

// Close stops serving: every QP goes to the error state, pollers stop, and
// memory is deregistered by the registry's Unregister (or here, for what
// is left).
func (t *Transport) Close() error {
	t.opMu.Lock()
	first := t.closing.CompareAndSwap(false, true)
	eps := make([]*Endpoint, 0, len(t.eps))
	for ep := range t.eps {
		eps = append(eps, ep)
	}
	t.opMu.Unlock()
	if !first {
		return nil
	}
	for _, ep := range eps {
		ep.Abort(transport.ErrClosed)
	}
	t.ops.Wait()
	t.connMu.Lock()
	conns := t.conns
	t.conns = map[string]map[uint64]*respConn{}
	t.connMu.Unlock()
	for _, byConn := range conns {
		for _, rc := range byConn {
			for _, q := range rc.qps {
				t.destroyResponder(q)
			}
		}
	}
	close(t.closed)
	for _, n := range t.nics {
		n.kick()
	}
	t.wg.Wait()
	t.mrMu.Lock()
	left := make([]*regMRs, 0, len(t.mrs))
	for _, rm := range t.mrs {
		left = append(left, rm)
	}
	t.mrs = map[memory.Key]*regMRs{}
	t.mrMu.Unlock()
	for _, rm := range left {
		t.deregister(rm)
	}
	t.closeNICs()
	return nil
}

// enter counts an operation in unless the transport is closing.
func (t *Transport) enter() bool {
	t.opMu.Lock()
	defer t.opMu.Unlock()
	if t.closing.Load() {
		return false
	}
	t.ops.Add(1)
	return true
}

func (t *Transport) leave() { t.ops.Done() }

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
