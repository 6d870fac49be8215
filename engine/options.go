package engine

import (
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"time"

	"github.com/kvferry/kvferry/engine/transport/tcp"
)

// Options configure an Engine. Zero fields take the defaults in the table
// below; KVFERRY_* environment variables, read by New, override fields. In a
// process that loaded libkvferry.so, the environment is the one the process
// was started with (the Go runtime takes the initial environment when the
// library loads; setenv calls made before that are not seen).
//
//	field              variable                     default
//	Host               KVFERRY_HOST                 127.0.0.1
//	Port               KVFERRY_PORT                 0 (the kernel picks)
//	AdvertiseHost      KVFERRY_ADVERTISE_HOST       "" (Host; for a wildcard Host, this machine's name or first address)
//	SecretKeyFile      KVFERRY_SECRET_KEY_FILE      "" (no authentication)
//	AllowlistFile      KVFERRY_ALLOWLIST_FILE       ""
//	ClusterSecretFile  KVFERRY_CLUSTER_SECRET_FILE  "" (instead of the two above)
//	Protocol           KVFERRY_PROTOCOL             auto (shm with a peer on this host, rdma when both ends have it, else tcp)
//	RDMALibrary        KVFERRY_IBVERBS_LIBRARY      libibverbs.so.1
//	RDMADevices        KVFERRY_RDMA_DEVICES         "" (every active port)
//	RDMANoFence        KVFERRY_RDMA_FENCE=0         false (the owner-side QP fence is on)
//	RDMARetryCount     KVFERRY_RDMA_RETRY_COUNT     6 (at most 6)
//	RDMACompletionTimeout KVFERRY_RDMA_COMPLETION_TIMEOUT_MS 10000 (at least 10)
//	RDMAFenceGrace     KVFERRY_RDMA_FENCE_GRACE_MS  10 (0: fence at once)
//	FenceGrace         KVFERRY_FENCE_GRACE_MS       50 (how long Fence waits for planners' FENCE_ACKs)
//	CUDALibrary        KVFERRY_CUDA_LIBRARY         libcuda.so.1 (loaded on first use of GPU memory)
//	SliceSize          KVFERRY_SLICE_SIZE           1 MiB
//	PathsPerPeer       KVFERRY_PATHS_PER_PEER       4
//	MaxRetries         KVFERRY_MAX_RETRIES          2
//	DefaultTimeout     KVFERRY_TIMEOUT_MS           30000
//	IOTimeout          KVFERRY_IO_TIMEOUT_MS        30000
//	TCPMaxConnsPerPeer KVFERRY_TCP_MAX_CONNS_PER_PEER 1024
//	TCPMaxConns        KVFERRY_TCP_MAX_CONNS        8192
//	TCPIdleTimeout     KVFERRY_TCP_IDLE_TIMEOUT_MS  120000 (2 minutes)
//	TCPFrameTimeout    KVFERRY_TCP_FRAME_TIMEOUT_MS 10000
//	TCPMinRate         KVFERRY_TCP_MIN_RATE         1048576 (bytes per second)
//	HeartbeatInterval  KVFERRY_HEARTBEAT_MS         1000
//	HeartbeatMisses    KVFERRY_HEARTBEAT_MISSES     5
//	AbortDrainTimeout  KVFERRY_ABORT_DRAIN_MS       5000
//	MaxTombstones      KVFERRY_TOMBSTONES           65536
//	TombstoneTTL       KVFERRY_TOMBSTONE_TTL_MS     600000 (10 minutes)
//	EventQueue         KVFERRY_EVENT_QUEUE          4096
//	ControlMaxConns    KVFERRY_CONTROL_MAX_CONNS    1024 (control connections peers open to us)
//	ControlMaxConnsPerHost KVFERRY_CONTROL_MAX_CONNS_PER_HOST 256
//	ControlBufferMiB   KVFERRY_CONTROL_BUFFER_MB    128 (partly received control messages, all peers)
//	LogLevel           KVFERRY_LOG_LEVEL            info (debug, info, warn, error; the C API and Python default to warn)
//	TraceRequest       KVFERRY_TRACE_REQUEST        0 (none; with LogLevel debug, logs one request id's path)
//	MetricsAddr        KVFERRY_METRICS_ADDR         "" (no listener; "host:port" serves http://host:port/metrics)
//	MetricsPeers       KVFERRY_METRICS_PEERS        32 (peers with a label of their own; the rest count as "other")
//	MetricsOff         KVFERRY_METRICS=0            false (per-peer counts and latency histograms are kept)
//	Metadata           KVFERRY_METADATA             "" (P2P handshake; "etcd://host:port[,host:port]/prefix" for a cluster store)
//	MetadataTTL        KVFERRY_METADATA_TTL_MS      10000 (lease of our entry in the store; at least 2000)
//	PathIdleTimeout    KVFERRY_PATH_IDLE_MS         60000 (paths to a peer unused this long are closed)
//	IdlePaths          KVFERRY_IDLE_PATHS           256 (paths kept open to peers with nothing in flight; least recently used closed first)
//	IdleHeartbeatInterval KVFERRY_IDLE_HEARTBEAT_MS 15000 (how often a peer unused for that long is pinged)
//	Compression        KVFERRY_COMPRESSION          off (auto: huff0 where it pays, per path; huff0, s2, zstd: always)
type Options struct {
	// Host is the address the control plane and the data plane listen
	// on, and the host part of the segment name. An IPv6 address is given
	// bare ("::1"); the name then reads "[::1]:port". A host name
	// ("localhost", the machine's name) is resolved by New, to its first
	// IPv4 address or else its first, and stays the segment name's host.
	Host string
	// Port is the control plane's port; 0 picks a free one, reported by
	// Engine.Name.
	Port int
	// AdvertiseHost is the host peers reach this engine at, when it is
	// not the one it binds (Host): a container's or NAT's outside
	// address, one name of a multi-homed host. It becomes the host part
	// of the segment name and of the data-plane addresses in the
	// descriptor. With a wildcard Host ("0.0.0.0", "::") and no
	// AdvertiseHost, New advertises this machine's name when it resolves
	// to one of its addresses, else its first non-loopback address.
	AdvertiseHost string
	// SecretKeyFile holds this engine's CURVE secret key (40 Z85
	// characters, or a czmq certificate; see `kvferry keygen`); with
	// AllowlistFile it turns authentication on: every peer, on the
	// control plane and on tcp data connections, must prove a key the
	// allowlist holds, and this engine talks to no peer that does not.
	// The file must not be readable by group or others.
	SecretKeyFile string
	// AllowlistFile lists the public keys of the peers let in, one Z85
	// key per line ('#' starts a comment). Engine.ReloadAllowlist reads it
	// again and cuts the peers whose keys it no longer lists.
	AllowlistFile string
	// ClusterSecretFile turns authentication on for simple deployments:
	// every engine holding the same secret (at least 16 bytes) derives the
	// same key pair and accepts only it. It replaces SecretKeyFile and
	// AllowlistFile.
	ClusterSecretFile string
	// Protocol is the data-plane transport for remote segments: "auto"
	// uses shm with peers on this host (same boot id, reachable on an
	// abstract unix socket), rdma with other peers that offer it when this
	// engine has an RDMA device, tcp otherwise (the choice is logged once
	// per peer); "tcp" uses neither shm nor RDMA; "rdma" makes New fail
	// without an RDMA device and refuses peers that lack it; "shm" refuses
	// peers that are not on this host. shm is off with authentication (a
	// peer on this host is then taken over authenticated tcp).
	Protocol string
	// RDMALibrary is the libibverbs file loaded at run time.
	RDMALibrary string
	// RDMADevices keeps some RDMA devices or ports: "mlx5_0,mlx5_1:1"
	// (prefixes), "=mlx5_0" (exact names), "^mlx5_2" (all but), as
	// NCCL_IB_HCA reads.
	RDMADevices string
	// RDMANoFence turns the owner-side fence off: an abort of a request
	// written over rdma is then Safe only once every named initiator sent
	// a drained ABORT_ACK. With the fence (the default) the owner moves
	// the initiators' QPs to the error state and needs no ACK.
	RDMANoFence bool
	// RDMARetryCount is the RC transport retry count of rdma QPs: how often
	// a NIC resends a packet the peer did not acknowledge before it fails
	// the work request (retry exceeded) and kvferry moves the work to
	// another NIC path. 1 to 6; 0 takes 6. 7 is refused: the verbs
	// specification allows it, but soft-RoCE (rxe) reads it as "retry
	// for ever", so a fenced or dead peer would never fail the request.
	RDMARetryCount int
	// RDMACompletionTimeout bounds how long an rdma NIC path may hold
	// work requests without a single completion: past it the path is
	// declared broken (its QP goes to the error state, which flushes what
	// was posted) and its work moves to another path, so that a peer
	// that never answers cannot make a wait last for ever (a path whose
	// broken QP is not flushed either is aborted 5 s later; a work request
	// the NIC never completes at all keeps its slice unfinished). 10 s
	// when zero, at least 10 ms: below DefaultTimeout's 30 s, so that a
	// synchronous transfer is rescued rather than timed out, and far
	// above what a healthy NIC takes between two completions (its own
	// retries end a work request in well under 2 s). A single work
	// request slower than this (a 64 MiB slice on a link of a few MB/s)
	// needs it raised.
	RDMACompletionTimeout time.Duration
	// RDMAFenceGrace is how long an Abort waits, with the fence on, for
	// the drained ABORT_ACKs of the initiators that hold rkeys for the
	// request (or were named) before it fences those that did not answer.
	// An initiator that answers in time is not fenced, so its other
	// requests go on undisturbed; one paused, partitioned or slow is
	// fenced, and Abort stays bounded by its deadline either way. 10 ms
	// when zero; negative fences every one at once, ACK or not (through
	// the environment: 0).
	RDMAFenceGrace time.Duration
	// FenceGrace is how long Fence waits, once the ranges are safe, for
	// the FENCE_ACKs of the peers that may plan transfers to us, so that
	// their next transfers carry the new epoch. Safety never waits for
	// them: a paused or partitioned peer costs a Fence this long, no
	// more. 50 ms when zero.
	FenceGrace time.Duration
	// CUDALibrary is the CUDA driver loaded, at run time, the first time
	// GPU memory is registered ("cuda:N", or "*" to detect).
	CUDALibrary string
	// SliceSize is the largest piece a request is cut into; slices of
	// one request travel on several paths at once.
	SliceSize int
	// PathsPerPeer is how many connections carry slices to one peer.
	PathsPerPeer int
	// MaxRetries is how often a slice that failed on a broken path is
	// posted again on another path before its task fails; 0 takes the
	// default (2), -1 turns retries off.
	MaxRetries int
	// DefaultTimeout bounds synchronous transfers whose context carries no
	// deadline.
	DefaultTimeout time.Duration
	// IOTimeout bounds the socket write of one frame (a gathered write, or
	// one READ answer), plus its length at TCPMinRate, so a writer never
	// cuts a frame its reader would accept; the connection is closed when
	// it runs out.
	IOTimeout time.Duration
	// TCPMaxConnsPerPeer caps the tcp data connections accepted from one
	// IP address and open at once (from the accept, before the handshake:
	// names are unauthenticated, the address is what the kernel
	// connected); TCPMaxConns caps them all together. A connection past
	// either is closed at once and counted (Stats.ConnsRefused). An
	// initiator engine opens PathsPerPeer connections to each owner, so
	// the default 1024 per address leaves room for sixteen engines on one
	// host at the largest PathsPerPeer (64).
	TCPMaxConnsPerPeer int
	TCPMaxConns        int
	// TCPIdleTimeout closes an accepted tcp data connection with no
	// request in progress for this long (Stats.IdleClosed). The
	// initiator is told which requests were read and posts the others
	// again on a new connection, so no transfer fails for it.
	TCPIdleTimeout time.Duration
	// TCPFrameTimeout and TCPMinRate (bytes per second) bound how long
	// one frame arriving on an accepted tcp data connection may take:
	// TCPFrameTimeout plus its length at TCPMinRate; the connection is
	// closed when it is late (Stats.FrameTimeouts). A link slower than
	// TCPMinRate per connection needs it lowered.
	TCPFrameTimeout time.Duration
	TCPMinRate      int
	// HeartbeatInterval is how often open segments are pinged; a segment
	// that misses HeartbeatMisses pings in a row is declared dead and its
	// in-flight transfers fail.
	HeartbeatInterval time.Duration
	HeartbeatMisses   int
	// AbortDrainTimeout bounds how long this engine, as an initiator told
	// by an owner to abort a request, waits for the request's slices in
	// flight to end before it cuts their paths; the ABORT_ACK follows
	// either way.
	AbortDrainTimeout time.Duration
	// MaxTombstones caps the aborted request ids remembered, on each side:
	// as owner (accesses of them are refused; request ids whose grants were
	// all revoked count too) and as initiator, per owner (submits of them
	// end ABORTED; at most 64 per owner that no open segment is known as,
	// and at most MaxTombstoneOwners owners). Past the cap an owner forgets
	// down to 7/8 of it, those acknowledged first, oldest first; an
	// initiator forgets that owner's oldest whose drain finished and whose
	// ACK was sent, never one still draining or owed. On rdma a submit of a
	// forgotten request id still ends ABORTED: the owner refuses its rkeys.
	MaxTombstones int
	// TombstoneTTL is how long an aborted request id is remembered. An
	// owner forgets one only once every initiator named acknowledged the
	// abort (or at the cap).
	TombstoneTTL time.Duration
	// EventQueue is how many events (aborts learned, notifications
	// received) wait for the application. When it is full, notifications
	// are refused to their sender with ErrBusy (backpressure) and abort
	// events are dropped and counted (the tasks still end ABORTED).
	EventQueue int
	// ControlMaxConns caps the control-plane connections peers open to
	// this engine; each engine that opened our segment holds one. Past it,
	// and past ControlMaxConnsPerHost from one address, a new connection is
	// closed at once (counted in Stats.ControlConnsRefused).
	ControlMaxConns        int
	ControlMaxConnsPerHost int
	// ControlBufferMiB caps the memory held for control messages still
	// arriving, for all peers' connections to us together; a message that
	// would pass it is dropped unread (Stats.ControlOverBudget) and its
	// sender's request times out. Replies on our connections to peers have
	// a budget of the same size of their own.
	ControlBufferMiB int
	// Logger receives the engine's logs; default: slog's default handler
	// at LogLevel.
	Logger *slog.Logger
	// LogLevel applies when Logger is nil.
	LogLevel slog.Level
	// TraceRequest names a request id whose way through the engine is
	// logged at debug level, on both sides: submitted, each peer access
	// admitted or refused, ended (status, time, cause), aborted, ACKed.
	// Other requests are not traced: a busy engine's debug log stays
	// readable. 0 traces none.
	TraceRequest uint64
	// MetricsAddr, when set ("127.0.0.1:9400", ":0" for a free port),
	// serves the engine's metrics over HTTP at /metrics, in the Prometheus
	// text format. Engines of one process asking for the same address
	// share its listener. A listener that cannot start (port in use) is
	// logged as a warning; the engine starts anyway, and MetricsText and
	// Collector still give the metrics.
	MetricsAddr string
	// MetricsPeers is how many peers have a label of their own in the
	// per-peer metrics; the others count under peer="other", so that
	// thousands of peers make at most MetricsPeers+1 label values. A peer
	// idle for 30 s gives its label up to the busiest of the others.
	// Default 32, at most 4096.
	MetricsPeers int
	// MetricsOff leaves out what the metrics count on the data path (per
	// peer bytes and transfers, latency histograms, refusals by reason):
	// the metrics then carry the engine's Stats alone. It is there to
	// measure what counting costs.
	MetricsOff bool
	// Resolver finds segment descriptors; default: ask the segment's own
	// control endpoint (P2P handshake), or the store Metadata names.
	Resolver Resolver
	// Metadata names a cluster store for segment descriptors:
	// "etcd://host:port[,host:port...][/prefix]" (prefix "kvferry" when
	// left out). The engine publishes its descriptor there under a lease
	// (it goes MetadataTTL after the engine dies; at once when it closes),
	// writes it again when registrations change, finds segments there and
	// watches them: a peer's new incarnation is taken when the store sees
	// it. Once a segment is open it is asked itself, so transfers to it go
	// on while the store is away; opening a segment then fails by its
	// deadline, saying so. New fails when the store cannot take our entry
	// within DefaultTimeout (at most 10 s). "" or "p2p": the P2P
	// handshake. Not with Resolver.
	Metadata string
	// MetadataTTL is the lease of our entry in the store: how long it
	// outlives the engine's last keepalive. 10 s when zero, at least 2 s.
	MetadataTTL time.Duration
	// PathIdleTimeout closes the paths to a peer with nothing in flight
	// and nothing submitted for this long (the next transfer dials again);
	// IdlePaths caps the paths kept open to such peers together, closing
	// the least recently used peers' paths first. Both act at heartbeat
	// ticks. They bound what an engine holds open (file descriptors,
	// buffers, goroutines) for many peers used now and then. Defaults 60 s
	// and 256; IdlePaths -1 closes every idle path at the next tick.
	PathIdleTimeout time.Duration
	IdlePaths       int
	// IdleHeartbeatInterval is how often a peer with nothing in flight and
	// nothing submitted for that long is pinged: idle peers cost little
	// heartbeat traffic however many there are. Peers in use are pinged
	// every HeartbeatInterval. 15 s when zero; never below
	// HeartbeatInterval, nor above 60 s (the pings keep our control
	// connection, over which the owner tells us of its fences, open).
	IdleHeartbeatInterval time.Duration
	// Compression compresses the KV data this engine sends over tcp
	// (never rdma or shm): its WRITEs as initiator and its answers to
	// READs as owner, with a KV-cache codec (engine/kvcodec: 2-byte
	// elements split into byte planes): "huff0" (the planes
	// entropy-coded; what bf16 and fp16 caches shrink with), "s2" or
	// "zstd" (for data with repeated strings). Only slices of 16 KiB to
	// 4 MiB in host memory, only to peers that say in the handshake that
	// they decode (this version's always do, whatever their own setting),
	// and only when the block comes out smaller. It pays on links slower
	// than the codec (about 1 GB/s a core for huff0); on a fast link it
	// costs throughput: "auto" uses huff0 only while it pays, connection
	// by connection: the kernel's pace of the link (TCP_INFO) against the
	// encoder's measured pace and ratio, the encoder measured again every
	// 5 s while it is off. "off" (or empty): none.
	Compression string
	// IgnoreEnv makes New skip the KVFERRY_* variables.
	IgnoreEnv bool
	// Testing holds switches for tests only; never set them in production.
	Testing Testing
}

// Testing switches let tests show what the protections prevent. They have
// no environment variable on purpose.
type Testing struct {
	// UnsafeAbort turns the abort protection off, as SGLang's ABORT does
	// today: as owner, Abort neither refuses the aborted request's
	// accesses nor waits for copies in progress, and reports Safe once
	// every initiator acknowledged; as initiator, the ABORT_ACK is sent
	// when the ABORT is heard, before anything is drained.
	UnsafeAbort bool
	// UnsafeFence turns the fence by memory range off: Fence reports
	// Safe at once and refuses nothing, as a Mooncake-based decode that
	// frees its pages is protected today.
	UnsafeFence bool
	// ApplyDelay makes the owner's tcp transport sleep this long after
	// admitting each WRITE and before applying it (and each READ it
	// answers compressed, before reading it), so that frames are
	// certainly in flight when a test aborts.
	ApplyDelay time.Duration
	// LocalChunkDelay makes the local transport wait this long before
	// each chunk it copies (1 MiB), so that a test can fence or abort a
	// transfer to the engine itself in the middle of it.
	LocalChunkDelay time.Duration
}

// Defaults of Options.
const (
	DefaultSliceSize    = 1 << 20
	DefaultPathsPerPeer = 4
	MaxSliceSize        = 64 << 20
	MaxPathsPerPeer     = 64
)

func (o *Options) applyEnv() error {
	str := func(name string, dst *string) {
		if v, ok := os.LookupEnv(name); ok && v != "" {
			*dst = v
		}
	}
	num := func(name string, dst *int) error {
		v, ok := os.LookupEnv(name)
		if !ok || v == "" {
			return nil
		}
		n, err := strconv.Atoi(v)
		if err != nil {
			return fmt.Errorf("%s=%q: not an integer", name, v)
		}
		*dst = n
		return nil
	}
	ms := func(name string, dst *time.Duration) error {
		n := -1
		if err := num(name, &n); err != nil || n < 0 {
			return err
		}
		*dst = time.Duration(n) * time.Millisecond
		return nil
	}
	str("KVFERRY_HOST", &o.Host)
	str("KVFERRY_ADVERTISE_HOST", &o.AdvertiseHost)
	str("KVFERRY_SECRET_KEY_FILE", &o.SecretKeyFile)
	str("KVFERRY_ALLOWLIST_FILE", &o.AllowlistFile)
	str("KVFERRY_CLUSTER_SECRET_FILE", &o.ClusterSecretFile)
	str("KVFERRY_PROTOCOL", &o.Protocol)
	str("KVFERRY_IBVERBS_LIBRARY", &o.RDMALibrary)
	str("KVFERRY_RDMA_DEVICES", &o.RDMADevices)
	str("KVFERRY_CUDA_LIBRARY", &o.CUDALibrary)
	str("KVFERRY_METRICS_ADDR", &o.MetricsAddr)
	str("KVFERRY_METADATA", &o.Metadata)
	str("KVFERRY_COMPRESSION", &o.Compression)
	if v, ok := os.LookupEnv("KVFERRY_METRICS"); ok && v != "" {
		switch v {
		case "0":
			o.MetricsOff = true
		case "1":
			o.MetricsOff = false
		default:
			return fmt.Errorf("KVFERRY_METRICS=%q: want 1 or 0", v)
		}
	}
	if v, ok := os.LookupEnv("KVFERRY_TRACE_REQUEST"); ok && v != "" {
		id, err := strconv.ParseUint(v, 0, 64)
		if err != nil {
			return fmt.Errorf("KVFERRY_TRACE_REQUEST=%q: %w", v, err)
		}
		o.TraceRequest = id
	}
	if v, ok := os.LookupEnv("KVFERRY_RDMA_FENCE"); ok && v != "" {
		on, err := strconv.ParseBool(v)
		if err != nil {
			return fmt.Errorf("KVFERRY_RDMA_FENCE=%q: want 1 or 0", v)
		}
		o.RDMANoFence = !on
	}
	for _, f := range []struct {
		name string
		dst  *int
	}{
		{"KVFERRY_PORT", &o.Port}, {"KVFERRY_SLICE_SIZE", &o.SliceSize}, {"KVFERRY_PATHS_PER_PEER", &o.PathsPerPeer},
		{"KVFERRY_MAX_RETRIES", &o.MaxRetries}, {"KVFERRY_HEARTBEAT_MISSES", &o.HeartbeatMisses},
		{"KVFERRY_TOMBSTONES", &o.MaxTombstones}, {"KVFERRY_EVENT_QUEUE", &o.EventQueue},
		{"KVFERRY_RDMA_RETRY_COUNT", &o.RDMARetryCount},
		{"KVFERRY_CONTROL_MAX_CONNS", &o.ControlMaxConns}, {"KVFERRY_CONTROL_MAX_CONNS_PER_HOST", &o.ControlMaxConnsPerHost},
		{"KVFERRY_CONTROL_BUFFER_MB", &o.ControlBufferMiB},
		{"KVFERRY_TCP_MAX_CONNS_PER_PEER", &o.TCPMaxConnsPerPeer}, {"KVFERRY_TCP_MAX_CONNS", &o.TCPMaxConns},
		{"KVFERRY_TCP_MIN_RATE", &o.TCPMinRate}, {"KVFERRY_METRICS_PEERS", &o.MetricsPeers},
		{"KVFERRY_IDLE_PATHS", &o.IdlePaths},
	} {
		if err := num(f.name, f.dst); err != nil {
			return err
		}
	}
	for _, f := range []struct {
		name string
		dst  *time.Duration
	}{
		{"KVFERRY_TIMEOUT_MS", &o.DefaultTimeout}, {"KVFERRY_IO_TIMEOUT_MS", &o.IOTimeout},
		{"KVFERRY_HEARTBEAT_MS", &o.HeartbeatInterval}, {"KVFERRY_ABORT_DRAIN_MS", &o.AbortDrainTimeout},
		{"KVFERRY_TOMBSTONE_TTL_MS", &o.TombstoneTTL}, {"KVFERRY_RDMA_COMPLETION_TIMEOUT_MS", &o.RDMACompletionTimeout},
		{"KVFERRY_RDMA_FENCE_GRACE_MS", &o.RDMAFenceGrace}, {"KVFERRY_FENCE_GRACE_MS", &o.FenceGrace},
		{"KVFERRY_TCP_IDLE_TIMEOUT_MS", &o.TCPIdleTimeout}, {"KVFERRY_TCP_FRAME_TIMEOUT_MS", &o.TCPFrameTimeout},
		{"KVFERRY_METADATA_TTL_MS", &o.MetadataTTL}, {"KVFERRY_PATH_IDLE_MS", &o.PathIdleTimeout},
		{"KVFERRY_IDLE_HEARTBEAT_MS", &o.IdleHeartbeatInterval},
	} {
		if err := ms(f.name, f.dst); err != nil {
			return err
		}
	}
	if v := os.Getenv("KVFERRY_RDMA_FENCE_GRACE_MS"); v != "" && o.RDMAFenceGrace == 0 {
		o.RDMAFenceGrace = -1 // 0 in the environment: fence at once
	}
	if v, ok := os.LookupEnv("KVFERRY_LOG_LEVEL"); ok && v != "" {
		if err := o.LogLevel.UnmarshalText([]byte(v)); err != nil {
			return fmt.Errorf("KVFERRY_LOG_LEVEL=%q: %w", v, err)
		}
	}
	return nil
}

// fill sets defaults and checks ranges.
func (o *Options) fill() error {
	if o.Host == "" {
		o.Host = "127.0.0.1"
	}
	if o.Protocol == "" {
		o.Protocol = "auto"
	}
	if o.Protocol != "tcp" && o.Protocol != "rdma" && o.Protocol != "shm" && o.Protocol != "auto" {
		return fmt.Errorf("protocol %q: %w (want auto, tcp, rdma or shm)", o.Protocol, ErrUnsupported)
	}
	if o.Port < 0 || o.Port > 65535 {
		return fmt.Errorf("port %d out of range", o.Port)
	}
	if o.SliceSize == 0 {
		o.SliceSize = DefaultSliceSize
	}
	if o.SliceSize < 4096 || o.SliceSize > MaxSliceSize {
		return fmt.Errorf("slice size %d: want 4 KiB to %d MiB", o.SliceSize, MaxSliceSize>>20)
	}
	if o.PathsPerPeer == 0 {
		o.PathsPerPeer = DefaultPathsPerPeer
	}
	if o.PathsPerPeer < 1 || o.PathsPerPeer > MaxPathsPerPeer {
		return fmt.Errorf("paths per peer %d: want 1 to %d", o.PathsPerPeer, MaxPathsPerPeer)
	}
	switch {
	case o.MaxRetries < -1:
		return fmt.Errorf("max retries %d: want -1 (none), 0 (default: 2) or more", o.MaxRetries)
	case o.MaxRetries == 0:
		o.MaxRetries = 2
	case o.MaxRetries == -1:
		o.MaxRetries = 0
	}
	def := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	def(&o.DefaultTimeout, 30*time.Second)
	def(&o.IOTimeout, 30*time.Second)
	def(&o.HeartbeatInterval, time.Second)
	if o.HeartbeatMisses <= 0 {
		o.HeartbeatMisses = 5
	}
	def(&o.AbortDrainTimeout, 5*time.Second)
	if o.TCPMaxConnsPerPeer < 0 || o.TCPMaxConns < 0 || o.TCPMinRate < 0 {
		return fmt.Errorf("tcp connection caps %d per peer, %d in all, min rate %d: want 0 (default) or more",
			o.TCPMaxConnsPerPeer, o.TCPMaxConns, o.TCPMinRate)
	}
	if o.TCPMaxConnsPerPeer == 0 {
		o.TCPMaxConnsPerPeer = tcp.DefaultMaxConnsPerPeer
	}
	if o.TCPMaxConns == 0 {
		o.TCPMaxConns = tcp.DefaultMaxConns
	}
	if o.TCPMinRate == 0 {
		o.TCPMinRate = tcp.DefaultMinRate
	}
	def(&o.TCPIdleTimeout, tcp.DefaultIdleTimeout)
	def(&o.TCPFrameTimeout, tcp.DefaultFrameTimeout)
	def(&o.RDMACompletionTimeout, 10*time.Second)
	if o.RDMAFenceGrace == 0 {
		o.RDMAFenceGrace = 10 * time.Millisecond
	}
	def(&o.FenceGrace, 50*time.Millisecond)
	if o.RDMACompletionTimeout < 10*time.Millisecond {
		return fmt.Errorf("rdma completion timeout %v: want at least 10ms", o.RDMACompletionTimeout)
	}
	if o.RDMARetryCount == 0 {
		o.RDMARetryCount = 6
	}
	if o.RDMARetryCount < 1 || o.RDMARetryCount > 6 {
		return fmt.Errorf("rdma retry count %d: want 1 to 6 (7 means \"for ever\" to some providers)", o.RDMARetryCount)
	}
	def(&o.TombstoneTTL, 10*time.Minute)
	if o.MaxTombstones <= 0 {
		o.MaxTombstones = 1 << 16
	}
	if o.EventQueue <= 0 {
		o.EventQueue = 4096
	}
	if o.ControlMaxConns < 0 || o.ControlMaxConnsPerHost < 0 || o.ControlBufferMiB < 0 || o.ControlBufferMiB > 1<<20 {
		return fmt.Errorf("control limits %d connections, %d per host, %d MiB: want 0 (the default) or positive, at most %d MiB",
			o.ControlMaxConns, o.ControlMaxConnsPerHost, o.ControlBufferMiB, 1<<20)
	}
	if o.EventQueue > 1<<20 || o.MaxTombstones > 1<<24 {
		return fmt.Errorf("event queue %d or tombstones %d too large (at most %d and %d)", o.EventQueue, o.MaxTombstones, 1<<20, 1<<24)
	}
	if o.MetricsPeers == 0 {
		o.MetricsPeers = 32
	}
	if o.MetricsPeers < 0 || o.MetricsPeers > 4096 {
		return fmt.Errorf("metrics peers %d: want 1 to 4096 (0: the default, 32)", o.MetricsPeers)
	}
	if _, _, err := metadataConfig(o.Metadata); err != nil {
		return err
	}
	if o.Resolver != nil {
		if _, store, _ := metadataConfig(o.Metadata); store {
			return fmt.Errorf("metadata %q and a Resolver: give one", o.Metadata)
		}
	}
	def(&o.MetadataTTL, 10*time.Second)
	if o.MetadataTTL < 2*time.Second {
		return fmt.Errorf("metadata TTL %v: want at least 2s", o.MetadataTTL)
	}
	def(&o.PathIdleTimeout, time.Minute)
	if o.IdlePaths == 0 {
		o.IdlePaths = 256
	}
	if o.IdlePaths < -1 {
		return fmt.Errorf("idle paths %d: want -1 (none kept), 0 (default: 256) or more", o.IdlePaths)
	}
	if o.IdlePaths == -1 {
		o.IdlePaths = 0
	}
	switch o.Compression {
	case "", "off", "auto", "huff0", "s2", "zstd":
	default:
		return fmt.Errorf("compression %q: want off, auto, huff0, s2 or zstd", o.Compression)
	}
	def(&o.IdleHeartbeatInterval, 15*time.Second)
	// An owner tells of its fences only the planners whose control
	// connection is up, and ours to a peer closes after two idle minutes:
	// idle pings keep it up.
	o.IdleHeartbeatInterval = min(max(o.IdleHeartbeatInterval, o.HeartbeatInterval), time.Minute)
	if o.Logger == nil {
		o.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: o.LogLevel})).With("lib", "kvferry")
	}
	return nil
}
