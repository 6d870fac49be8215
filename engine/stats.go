package engine

import (
	"github.com/kvferry/kvferry/engine/transport/rdma"
	"github.com/kvferry/kvferry/engine/transport/shm"
)

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
	// AuthRefused counts peers refused for authentication (control and
	// tcp data connections that did not prove an allowed key, peers we
	// would not trust, peers cut when their key left the allowlist).
	AuthRefused   uint64
	Registrations int // registered ranges
	OpenSegments  int

	// TCP data connections, as owner.
	DataConns     int64  // accepted data connections open now
	ConnsRefused  uint64 // accepted data connections closed at once, at TCPMaxConnsPerPeer or TCPMaxConns
	IdleClosed    uint64 // data connections closed after TCPIdleTimeout without a request
	FrameTimeouts uint64 // data connections closed because a frame came too slowly (TCPFrameTimeout, TCPMinRate)
	AcceptErrors  uint64 // failed accepts on the data port (out of file descriptors...); the loop backs off and goes on
	// TCP paths, as initiator.
	PathsIdledOut uint64 // our paths an owner closed as idle; their slices it had not read were posted again
	// Compressed tcp data (Compression). As sender (our WRITEs, our
	// answers to READs): slices sent compressed, their bytes before and
	// after. As receiver: compressed bytes received and the bytes they
	// decoded to, blocks refused for want of decoding room (WRITEs: 256
	// MiB for all connections) and malformed blocks (a WRITE's refused; a
	// READ answer's fails its path).
	CompressedSlices    uint64
	CompressedRawOut    uint64
	CompressedOut       uint64
	CompressedIn        uint64
	CompressedRawIn     uint64
	CompressedRefused   uint64
	CompressedMalformed uint64
	// Peers, as initiator.
	PathsClosedIdle uint64 // our paths to idle peers we closed (PathIdleTimeout, IdlePaths)
	OpenPaths       int    // paths to peers open now
	Heartbeats      uint64 // pings sent to open segments

	// Same-host (shm) transport. Its owner-side bytes, refusals and
	// protocol errors count in OwnerBytesIn, OwnerBytesOut, OwnerRefused,
	// RefusedInFlight and ProtocolErrors with tcp's.
	SHMConns            int64  // accepted shm connections open now
	SHMSharedSlices     uint64 // our slices an owner copied through a view of a shared buffer
	SHMAttachSlices     uint64 // our slices an owner copied by cross-memory attach
	SHMGPUSlices        uint64 // our slices of GPU memory an owner copied through CUDA IPC
	SHMFallbackSlices   uint64 // our slices to a same-host owner sent over tcp: it could reach their memory neither way
	SHMStopsUnconfirmed uint64 // our shm paths stopped without the owner confirming it left our memory (logged as errors)

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
	DrainsRechecked     uint64 // aborted requests first ACKed cut because a broken path could not confirm their work, then ACKed drained once it did
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
	var sh shm.Stats
	if e.shm != nil {
		sh = e.shm.Stats()
	}
	c := e.plane.Stats()
	e.segMu.Lock()
	nseg := len(e.segments)
	e.segMu.Unlock()
	rs := e.reqs.Stats()
	e.abortMu.RLock()
	ntomb, nowners := e.tombCounts()
	e.abortMu.RUnlock()
	var rs2 rdma.Stats
	nics := 0
	if e.rdma != nil {
		rs2, nics = e.rdma.Stats(), len(e.rdma.NICs())
	}
	e.fenceMu.Lock()
	nfenced := e.fenceDebts.Len()
	e.fenceMu.Unlock()
	return Stats{
		AuthRefused: c.AuthRefused + t.AuthRefused,
		RDMANICs:    nics, RDMAWorkRequests: rs2.Posted, RDMAErrorWCs: rs2.ErrorCompletions,
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
		AbortsReceived: e.stats.abortsReceived.Load(), AbortAcksSent: e.stats.acksSent.Load(), DrainsRechecked: e.stats.drainRechecked.Load(), TasksAborted: e.stats.tasksAborted.Load(),
		InitiatorTombstones: ntomb, TombstoneOwners: nowners, EventsDropped: e.stats.eventsDropped.Load(),
		AbortsDropped: e.stats.abortsDropped.Load(), TombstoneOwnersForgotten: e.stats.tombOwnersForgotten.Load(),
		Notifications: e.stats.notifications.Load(), CanceledDropped: e.stats.canceledDropped.Load(),
		StagingInUse: e.stats.stagingInUse.Load(), StagingRefused: e.stats.ownerStageRefused.Load(), Stagers: e.stats.stagers.Load(),
		BytesWritten: e.stats.bytesWritten.Load(), BytesRead: e.stats.bytesRead.Load(),
		TasksCompleted: e.stats.tasksCompleted.Load(), TasksFailed: e.stats.tasksFailed.Load(),
		TasksCanceled: e.stats.tasksCanceled.Load(), TasksInFlight: e.stats.tasksInFlight.Load(),
		Retries: e.stats.retries.Load(), OwnerBytesIn: t.BytesIn + sh.BytesIn, OwnerBytesOut: t.BytesOut + sh.BytesOut,
		OwnerRefused: t.Refused + sh.Refused, RefusedInFlight: t.RefusedInFlight + sh.RefusedInFlight,
		ProtocolErrors: t.ProtocolErrors + sh.ProtocolErrors,
		SHMConns:       sh.Conns, SHMSharedSlices: sh.SharedSlices, SHMAttachSlices: sh.AttachSlices, SHMGPUSlices: sh.GPUSlices,
		SHMFallbackSlices: sh.FallbackSlices, SHMStopsUnconfirmed: sh.StopsUnconfirmed,
		DataConns: t.Conns, ConnsRefused: t.RefusedPerPeer + t.RefusedTotal, IdleClosed: t.IdleClosed,
		FrameTimeouts: t.FrameTimeouts, PathsIdledOut: t.GoAways, PathsClosedIdle: e.stats.pathsClosedIdle.Load(),
		CompressedSlices: t.CompressedSlices, CompressedRawOut: t.CompressedRawOut, CompressedOut: t.CompressedOut,
		CompressedIn: t.CompressedIn, CompressedRawIn: t.CompressedRawIn, CompressedRefused: t.CompressedRefused, CompressedMalformed: t.CompressedMalformed, OpenPaths: e.openPathCount(), Heartbeats: e.stats.heartbeats.Load(), AcceptErrors: t.AcceptErrors,
		ControlDropped: c.Malformed + e.stats.controlDropped.Load(), ControlLate: c.Unmatched, Registrations: e.reg.Len(), OpenSegments: nseg,
		ControlConns: c.Conns, ControlPeers: c.Peers, ControlConnsRefused: c.ConnsRefused, ControlConnsCut: c.ConnsCut,
		ControlOverBudget: c.OverBudget, ControlSendFails: c.SendFails,
	}
}
