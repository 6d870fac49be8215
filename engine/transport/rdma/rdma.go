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
	"math/rand/v2"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
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
		uncertain: newUncertainSet(nil), eps: map[*Endpoint]struct{}{}, holds: newHolders(),
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

// ---- memory ---------------------------------------------------------------

// Registered implements memory.Watcher: each region is registered on every
// NIC, split at the devices' max MR size.
func (t *Transport) Registered(regs []*memory.Region) error {
	done := make([]*regMRs, 0, len(regs))
	for _, r := range regs {
		rm, err := t.register(r)
		if err != nil {
			for _, d := range done {
				t.deregister(d)
			}
			return fmt.Errorf("rdma: %w", err)
		}
		done = append(done, rm)
	}
	t.mrMu.Lock()
	for _, rm := range done {
		t.mrs[rm.region.Key] = rm
	}
	t.mrMu.Unlock()
	return nil
}

func (t *Transport) register(r *memory.Region) (*regMRs, error) {
	step := uint64(1) << 62
	for _, n := range t.nics {
		step = min(step, n.maxMR)
	}
	rm := &regMRs{region: r}
	access := verbs.AccessLocalWrite | verbs.AccessRemoteWrite | verbs.AccessRemoteRead
	relaxed := t.lib.HasRelaxedOrdering()
	for off := uint64(0); off < r.Len; off += step {
		p := mrPiece{off: off, len: min(step, r.Len-off)}
		for _, n := range t.nics {
			mr, err := t.regPiece(n, r, off, p.len, access, relaxed)
			if err != nil {
				rm.pieces = append(rm.pieces, p)
				t.deregister(rm)
				return nil, err
			}
			p.mrs = append(p.mrs, mr)
		}
		rm.pieces = append(rm.pieces, p)
	}
	return rm, nil
}

// regPiece registers one piece of a region on n. GPU memory goes through
// dma-buf when the driver and the NIC take it, else as is (which needs
// nvidia-peermem on real hardware).
func (t *Transport) regPiece(n *NIC, r *memory.Region, off, length uint64, access verbs.Access, relaxed bool) (*verbs.MR, error) {
	if strings.HasPrefix(r.Location, "cuda:") {
		if t.opts.DmaBuf != nil {
			fd, at, err := t.opts.DmaBuf(r.Location, r.Addr+off, length)
			if err == nil {
				mr, err := n.pd.RegDmabufMR(at, length, r.Addr+off, fd, access)
				_ = syscall.Close(fd)
				if err == nil {
					t.stats.DmabufMRs.Add(1)
					return mr, nil
				}
				t.log.Debug("kvferry: dma-buf registration refused; registering GPU memory as is", "nic", n.Name, "err", err)
			} else {
				t.log.Debug("kvferry: no dma-buf for GPU memory; registering it as is", "err", err)
			}
		}
		mr, err := n.pd.RegMR(r.Addr+off, length, access, relaxed)
		if err != nil {
			return nil, fmt.Errorf("GPU memory %s on %s (dma-buf and nvidia-peermem both failed): %w", r.Location, n.Name, err)
		}
		t.stats.PeermemMRs.Add(1)
		return mr, nil
	}
	return n.pd.RegMR(r.Addr+off, length, access, relaxed)
}

func (t *Transport) deregister(rm *regMRs) {
	for _, p := range rm.pieces {
		for _, mr := range p.mrs {
			if err := mr.Dereg(); err != nil {
				t.log.Error("kvferry: rdma deregistration failed; the range may still be reachable", "err", err)
			}
		}
	}
}

// Unregistered implements memory.Watcher: deregistration returns once the
// NICs no longer reach the ranges.
func (t *Transport) Unregistered(regs []*memory.Region) {
	for _, r := range regs {
		t.mrMu.Lock()
		rm := t.mrs[r.Key]
		delete(t.mrs, r.Key)
		t.mrMu.Unlock()
		if rm != nil {
			t.deregister(rm)
		}
	}
}

// localKey finds the lkey for [addr, addr+n) of region key on NIC nic; ok
// is false when the range is not registered with this transport or
// crosses a piece boundary (see localSpans).
func (t *Transport) localSpans(key memory.Key, addr, n uint64, nic int) ([]span, error) {
	t.mrMu.RLock()
	rm := t.mrs[key]
	t.mrMu.RUnlock()
	if rm == nil || !rm.region.Contains(addr, n) {
		return nil, fmt.Errorf("%w: local memory [%#x, +%d) is not registered with rdma", transport.ErrRefused, addr, n)
	}
	var out []span
	off := addr - rm.region.Addr
	end := off + n
	for _, p := range rm.pieces {
		if p.off+p.len <= off || p.off >= end {
			continue
		}
		s := max(off, p.off)
		e := min(end, p.off+p.len)
		out = append(out, span{addr: rm.region.Addr + s, len: e - s, key: p.mrs[nic].LKey})
	}
	return out, nil
}

type span struct {
	addr, len uint64
	key       uint32
}

// ---- owner side -----------------------------------------------------------

// Serve answers one TRANSPORT request from peer (on the control plane's
// loop); the reply is the body, or an error the engine sends as an ERROR
// reply.
func (t *Transport) Serve(from string, body []byte) ([]byte, error) {
	if !t.enter() {
		return nil, transport.ErrClosed
	}
	defer t.leave()
	if len(body) == 0 {
		return nil, fmt.Errorf("%w: empty", errWire)
	}
	switch body[0] {
	case kindInfo:
		if len(body) != 2 || body[1] != wireVersion {
			return nil, fmt.Errorf("%w: info request of %d bytes", errWire, len(body))
		}
		return t.info().encode(), nil
	case kindConnect:
		req, err := decodeConnect(body)
		if err != nil {
			return nil, err
		}
		return t.serveConnect(from, req)
	case kindKeys:
		req, err := decodeKeys(body)
		if err != nil {
			return nil, err
		}
		return t.serveKeys(from, req)
	case kindRelease:
		m, err := decodeRelease(body)
		if err != nil {
			return nil, err
		}
		t.holds.release(from, m.Conn, m.Seq, m.RequestIDs)
		t.stats.Releases.Add(1)
		return []byte{kindRelease, wireVersion}, nil
	case kindDisconnect:
		if len(body) != 10 || body[1] != wireVersion {
			return nil, fmt.Errorf("%w: disconnect of %d bytes", errWire, len(body))
		}
		t.dropConn(from, leU64(body[2:]))
		return []byte{kindDisconnect, wireVersion}, nil
	}
	return nil, fmt.Errorf("%w: kind %d", errWire, body[0])
}

func leU64(b []byte) uint64 {
	var v uint64
	for i := 7; i >= 0; i-- {
		v = v<<8 | uint64(b[i])
	}
	return v
}

func (t *Transport) info() *infoReply {
	m := &infoReply{}
	m.Matrix, m.Tiers = t.matrix()
	for _, n := range t.nics {
		m.NICs = append(m.NICs, nicInfo{
			Name: trunc(n.Name), Port: uint8(n.Port.Num), Ethernet: n.Port.Ethernet(), MTU: uint8(n.Port.ActiveMTU),
			LID: n.Port.LID, GID: n.Port.GID, GIDIndex: uint8(max(n.Port.GIDIndex, 0)),
			NUMA: int16(n.Placement.NUMANode), PCI: trunc(n.Placement.PCIAddress),
		})
	}
	return m
}

func trunc(s string) string {
	if len(s) > maxName {
		return s[:maxName]
	}
	return s
}

// DefaultMaxResponderQPs caps the QPs an owner makes for initiators
// connected to it, all together (a legitimate initiator engine needs PathsPerPeer paths
// of at most 16 NIC pairs: 64 at the defaults, 1024 at most). Past it a
// connect request is refused and the initiator's transfer fails over to
// tcp or fails.
const DefaultMaxResponderQPs = 16384

func (t *Transport) serveConnect(from string, req *connectReq) ([]byte, error) {
	for _, p := range req.Pairs {
		if int(p.Remote) >= len(t.nics) {
			return nil, fmt.Errorf("%w: pair names NIC %d of %d", errWire, p.Remote, len(t.nics))
		}
	}
	if t.opts.AdmitInitiator != nil {
		if err := t.opts.AdmitInitiator(from); err != nil {
			return nil, err // early, to spare the QPs; checked again below
		}
	}
	// Every QP counts against Options.MaxResponderQPs from before it is made: any
	// peer can ask, under any name, and QPs are the NIC's to lose.
	reserved := int64(len(req.Pairs))
	if n := t.stats.respQPs.Add(reserved); n > int64(t.opts.MaxResponderQPs) {
		t.stats.respQPs.Add(-reserved)
		t.stats.ConnectsRefused.Add(1)
		return nil, fmt.Errorf("rdma: %d responder QPs in use, %d more asked (at most %d)", n-reserved, reserved, t.opts.MaxResponderQPs)
	}
	// The QPs are made without connMu, so a Fence never waits for verbs
	// calls; nothing reaches them before the initiator has the reply.
	reply := &connectReply{}
	var made []*verbs.QP
	drop := func() {
		for _, q := range made {
			_ = q.ToError()
			_ = q.Destroy()
		}
		t.stats.respQPs.Add(-reserved)
	}
	for _, p := range req.Pairs {
		n := t.nics[p.Remote]
		qp, err := t.connectQP(n, verbs.Remote{QPN: p.QP.QPN, PSN: p.QP.PSN, LID: p.LID, GID: p.GID, Global: p.Ethernet || n.Port.Ethernet(), MTU: verbs.MTU(p.MTU)})
		if err != nil {
			drop()
			return nil, err
		}
		made = append(made, qp.qp)
		reply.QPs = append(reply.QPs, qpInfo{QPN: qp.qp.Num, PSN: qp.psn})
	}
	// The gate and the QPs' entry into conns happen under connMu, which
	// Fence holds too: a connection is either fenced or refused.
	t.connMu.Lock()
	defer t.connMu.Unlock()
	if t.opts.AdmitInitiator != nil {
		if err := t.opts.AdmitInitiator(from); err != nil {
			drop()
			return nil, err
		}
	}
	byConn := t.conns[from]
	if byConn == nil {
		if len(t.conns) >= 4096 {
			drop()
			return nil, fmt.Errorf("rdma: too many initiators connected")
		}
		byConn = map[uint64]*respConn{}
		t.conns[from] = byConn
	}
	rc := byConn[req.Conn]
	if rc == nil {
		if len(byConn) >= 1024 {
			drop()
			return nil, fmt.Errorf("rdma: too many connections from %s", from)
		}
		rc = &respConn{qps: map[uint8]*verbs.QP{}}
		byConn[req.Conn] = rc
	}
	for i, p := range req.Pairs {
		if old := rc.qps[p.Slot]; old != nil {
			t.destroyResponder(old)
		}
		rc.qps[p.Slot] = made[i]
		if err := t.postRecvs(t.nics[p.Remote], made[i], from, recvsPerQP); err != nil {
			t.log.Warn("kvferry: rdma receives for notifications not posted", "peer", from, "err", err)
		}
	}
	return reply.encode(), nil
}

type connectedQP struct {
	qp  *verbs.QP
	psn uint32
}

// connectQP creates a QP on n and takes it to RTS connected to r. The
// owner's QPs only respond, but RTS costs nothing and lets the same code
// serve both ends.
func (t *Transport) connectQP(n *NIC, r verbs.Remote) (*connectedQP, error) {
	qp, err := n.pd.CreateQP(n.cq, n.cq, n.maxWR, 16, verbs.MaxInline)
	if err != nil {
		return nil, err
	}
	psn := rand.Uint32() & 0xffffff
	if err := t.bringUp(qp, n, r, psn); err != nil {
		_ = qp.Destroy()
		return nil, err
	}
	return &connectedQP{qp: qp, psn: psn}, nil
}

func (t *Transport) bringUp(qp *verbs.QP, n *NIC, r verbs.Remote, psn uint32) error {
	access := verbs.AccessLocalWrite | verbs.AccessRemoteWrite | verbs.AccessRemoteRead
	if err := qp.ToInit(n.Port.Num, access); err != nil {
		return err
	}
	if err := t.toRTR(qp, n, r); err != nil {
		return err
	}
	return qp.ToRTS(psn, t.opts.Timeout, t.opts.RetryCount)
}

func (t *Transport) toRTR(qp *verbs.QP, n *NIC, r verbs.Remote) error {
	mtu := min(n.Port.ActiveMTU, r.MTU)
	return qp.ToRTR(r, n.Port.Num, mtu, n.Port.GIDIndex)
}

func (t *Transport) serveKeys(from string, req *keysReq) ([]byte, error) {
	refused := true // until the reply is built
	t.stats.KeyRequests.Add(1)
	if req.RequestID != 0 {
		// Recorded before the admission: an Abort bumps the generation
		// first and reads the holders after, so either this admission
		// sees the new generation or the Abort sees this holder.
		added, evict := t.holds.add(from, req.Conn, req.Seq, req.RequestID)
		if evict != "" {
			// Cut before the reply goes out: rkeys of this reply then
			// reach only QPs already cut, and the initiator asks again.
			t.forgetByFence(evict)
			added = added && evict != from
		}
		if added {
			defer func() {
				if refused {
					t.holds.remove(from, req.Conn, req.RequestID)
				}
			}()
		}
	}
	t.mrMu.RLock()
	rm := t.mrs[memory.Key(req.Key)]
	t.mrMu.RUnlock()
	if t.owner != nil {
		// The owner admits the access as it would on tcp: key, range,
		// request state and grants. Nothing is copied here; the target
		// is dropped.
		tgt, err := t.owner.Admit(transport.Access{
			Op: transport.Op(req.Op), Initiator: from, RequestID: req.RequestID, Generation: req.Generation,
			GrantID: req.GrantID, Epoch: req.FenceEpoch, Key: memory.Key(req.Key), Addr: req.Addr, Length: req.Len, Direct: true,
		})
		if err == nil && tgt.Stage != nil {
			tgt.Stage.Release()
		}
		if err != nil {
			if errors.Is(err, transport.ErrAborted) {
				return encodeKeysRefusal(keysAborted, err.Error()), nil
			}
			if errors.Is(err, transport.ErrFenced) {
				// The status says fenced; the reason need not again.
				return encodeKeysRefusal(keysFenced, strings.TrimPrefix(err.Error(), transport.ErrFenced.Error()+": ")), nil
			}
			return encodeKeysRefusal(keysRefused, err.Error()), nil
		}
	}
	if rm == nil {
		return encodeKeysRefusal(keysRefused, fmt.Sprintf("key %#x is not registered with rdma", req.Key)), nil
	}
	m := &keysReply{Addr: rm.region.Addr, Len: rm.region.Len, Location: trunc(rm.region.Location)}
	// Request id 0 is admitted for the whole registration (only a fence
	// by range or unregistration stops it); a request for what it asked.
	m.Admitted = transport.Span{Addr: rm.region.Addr, Len: rm.region.Len}
	stale := false
	if fe, ok := t.owner.(transport.FenceEpocher); ok {
		// Planned before the last fence: admitted for what it asked only,
		// which the owner checked against the fenced ranges above.
		stale = req.FenceEpoch < fe.FenceEpoch()
	}
	if req.RequestID != 0 || stale {
		if !rm.region.Contains(req.Addr, req.Len) {
			return encodeKeysRefusal(keysRefused, fmt.Sprintf("[%#x, +%d) is outside key %#x", req.Addr, req.Len, req.Key)), nil
		}
		m.Admitted = transport.Span{Addr: req.Addr, Len: req.Len}
	}
	for _, p := range rm.pieces {
		pc := piece{Off: p.off, Len: p.len}
		for _, mr := range p.mrs {
			pc.RKeys = append(pc.RKeys, mr.RKey)
		}
		m.Pieces = append(m.Pieces, pc)
	}
	if len(m.Pieces) > maxPieces {
		return nil, fmt.Errorf("rdma: key %#x has %d pieces (at most %d)", req.Key, len(m.Pieces), maxPieces)
	}
	refused = false
	return m.encode(), nil
}

func (t *Transport) dropConn(from string, conn uint64) {
	t.connMu.Lock()
	rc := t.conns[from][conn]
	delete(t.conns[from], conn)
	t.holds.dropConn(from, conn)
	if len(t.conns[from]) == 0 {
		delete(t.conns, from)
		// No QP of it is left: the rkeys it holds reach nothing until it
		// connects again, and its engine asks again after that.
		t.holds.forget(from)
	}
	if rc != nil {
		// In the error state before connMu is let go: a Fence racing
		// this no longer sees these QPs and must not find them live.
		for _, q := range rc.qps {
			_ = q.ToError()
		}
	}
	t.connMu.Unlock()
	if rc != nil {
		for _, q := range rc.qps {
			t.destroyResponder(q)
		}
	}
}

// Fence implements transport.Fencer: every responder QP of initiator goes
// to the error state, after which its NIC executes none of the initiator's
// work; the QPs are destroyed. The initiator's work on other requests fails
// with a retryable error and is posted again on new QPs once it connects
// again, which AdmitInitiator gates.
func (t *Transport) Fence(ctx context.Context, initiator string) error {
	if !t.opts.Fence {
		return fmt.Errorf("rdma: %w: the owner-side fence is off", transport.ErrProtocol)
	}
	return t.cut(ctx, initiator)
}

// cut moves every responder QP of initiator to the error state and
// destroys them; the rkeys it holds are void from then on (see holders).
func (t *Transport) cut(ctx context.Context, initiator string) error {
	t.connMu.Lock()
	conns := t.conns[initiator]
	delete(t.conns, initiator)
	t.holds.forget(initiator)
	var errs []error
	var qps []*verbs.QP
	for _, rc := range conns {
		for _, q := range rc.qps {
			if err := q.ToError(); err != nil {
				errs = append(errs, err)
			}
			qps = append(qps, q)
		}
	}
	t.connMu.Unlock()
	t.stats.Fences.Add(1)
	for _, q := range qps {
		t.dropRecvs(q)
		_ = q.Destroy()
		t.stats.respQPs.Add(-1)
	}
	if len(errs) > 0 {
		// A QP that did not reach the error state may still execute.
		return fmt.Errorf("rdma: fence %s: %w", initiator, errors.Join(errs...))
	}
	return ctx.Err()
}

// Initiators returns the initiators with responder QPs connected to us:
// those a fence by memory range must cut, since the rkeys they hold for
// request id 0 reach whole registrations.
func (t *Transport) Initiators() []string {
	t.connMu.Lock()
	defer t.connMu.Unlock()
	names := make([]string, 0, len(t.conns))
	for n := range t.conns {
		names = append(names, n)
	}
	return names
}

// FenceEnabled reports whether Fence works (the engine takes the transport
// for a Fencer only then).
func (t *Transport) FenceEnabled() bool { return t.opts.Fence }

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

// ---- uncertainty and lifetime ---------------------------------------------

type uncertainKey struct {
	peer string
	rid  uint64
}

// Bounds of the uncertain set: far longer than any packet can stay in a
// network, and as many as the tombstones an engine keeps.
const (
	uncertainTTL = 10 * time.Minute
	maxUncertain = 1 << 16
)

// newUncertainSet returns an empty uncertain set on clock now (nil: the
// wall clock). A mark is protected for as long as it is within its window
// (KeepFresh): the set never forgets a fresh one to make room.
func newUncertainSet(now func() time.Time) *bounded.Set[uncertainKey, struct{}] {
	return bounded.New(bounded.Options[uncertainKey, struct{}]{Cap: maxUncertain, TTL: uncertainTTL, KeepFresh: true, Now: now})
}

// markUncertain records that a work request of (peer, rid) ended without
// the responder's answer; a mark again moves its expiry. A fresh mark is
// never forgotten: past the cap, expired marks go first, and when none has
// expired every request of every peer counts as uncertain until the newest
// mark would have expired (a drain then says "cut", never "drained" for a
// request it forgot).
func (t *Transport) markUncertain(peer string, rid uint64) {
	now := t.uncertain.Now()
	t.uncMu.Lock()
	defer t.uncMu.Unlock()
	t.uncertain.Expire(now)
	if !t.uncertain.Put(uncertainKey{peer, rid}, struct{}{}) {
		t.uncAll = now.Add(uncertainTTL)
	}
}

// Uncertain reports whether a work request of (peer, rid) ended without
// the responder's answer in the last uncertainTTL: the initiator can then
// not promise that the request is drained.
func (t *Transport) Uncertain(peer string, rid uint64) bool {
	now := t.uncertain.Now()
	t.uncMu.Lock()
	defer t.uncMu.Unlock()
	if now.Before(t.uncAll) {
		return true
	}
	return t.uncertain.Fresh(uncertainKey{peer, rid}, now)
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

// ---- completions ----------------------------------------------------------

// wrCtx is one posted work request: a slice's, a notification's SEND, or
// a receive for notifications.
type wrCtx struct {
	ep    *Endpoint
	pair  *pair
	ws    *wslice
	bytes uint64
	send  *sendCtx
	recv  *recvCtx
}

// watchdog breaks NIC paths that hold work requests of which none
// completed within CompletionTimeout. A provider that never completes a
// request (a peer gone quiet under a retry count the provider reads as
// "for ever", a stuck device) would otherwise hold every wait on it for
// good; breaking the path moves its QP to the error state, whose flush
// completes what was posted, and the work moves to another path.
func (t *Transport) watchdog() {
	defer t.wg.Done()
	every := min(max(t.opts.CompletionTimeout/4, 10*time.Millisecond), time.Second)
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-t.closed:
			return
		case <-tick.C:
		}
		t.opMu.Lock()
		eps := make([]*Endpoint, 0, len(t.eps))
		for e := range t.eps {
			eps = append(eps, e)
		}
		t.opMu.Unlock()
		now := time.Now()
		for _, e := range eps {
			e.breakStalled(now, t.opts.CompletionTimeout)
		}
	}
}

func (n *NIC) kick() {
	select {
	case n.poll <- struct{}{}:
	default:
	}
}

// poller takes the NIC's completions in batches. It spins briefly while
// work is outstanding, sleeps with backoff after that, and blocks when
// nothing is outstanding, so an idle engine costs no CPU.
func (t *Transport) poller(n *NIC) {
	defer t.wg.Done()
	wcs := make([]verbs.WC, 64)
	idle := 0
	for {
		select {
		case <-t.closed:
			return
		default:
		}
		k := n.cq.Poll(wcs)
		if k < 0 {
			t.log.Error("kvferry: rdma poll failed", "nic", n.Name, "rc", k)
			k = 0
		}
		if k > 0 {
			idle = 0
			t.complete(n, wcs[:k])
			continue
		}
		if n.inflight.Load() == 0 {
			// Idle. Receives for notifications may still complete: look
			// every millisecond while any is posted (no completion
			// channel), else only when work is posted.
			wait := 50 * time.Millisecond
			if n.recvs.Load() > 0 {
				wait = time.Millisecond
			}
			select {
			case <-t.closed:
				return
			case <-n.poll:
			case <-time.After(wait):
			}
			continue
		}
		idle++
		switch {
		case idle < 64:
			// spin: a completion is usually microseconds away
		case idle < 256:
			time.Sleep(20 * time.Microsecond)
		default:
			time.Sleep(200 * time.Microsecond)
		}
	}
}

func (t *Transport) complete(n *NIC, wcs []verbs.WC) {
	for i := range wcs {
		wc := &wcs[i]
		t.wrMu.Lock()
		c := t.wrs[wc.ID]
		delete(t.wrs, wc.ID)
		t.wrMu.Unlock()
		if c == nil {
			continue
		}
		if c.recv == nil {
			n.inflight.Add(-1)
		}
		t.stats.Completed.Add(1)
		if wc.Status != verbs.WCSuccess {
			t.stats.ErrorCompletions.Add(1)
		}
		switch {
		case c.recv != nil:
			t.received(c.recv, wc)
		case c.send != nil:
			c.ep.sent(c, wc.Status)
		default:
			c.ep.completed(c, wc.Status, t.lib.WCStatusString(wc.Status))
		}
	}
}

func (t *Transport) track(c *wrCtx) uint64 {
	t.wrMu.Lock()
	t.nextWR++
	id := t.nextWR
	t.wrs[id] = c
	t.wrMu.Unlock()
	return id
}

func (t *Transport) untrack(id uint64) { t.untrackIf(id) }

// untrackIf forgets a work request and reports whether it was still
// tracked (a completion or dropRecvs may have taken it first).
func (t *Transport) untrackIf(id uint64) bool {
	t.wrMu.Lock()
	_, ok := t.wrs[id]
	delete(t.wrs, id)
	t.wrMu.Unlock()
	return ok
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
