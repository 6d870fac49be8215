// Package shm is kvferry's same-host transport: an initiator and an owner
// on one host talk over a unix socket, and the owner copies every byte
// itself, straight between its memory and the initiator's.
//
// The owner reaches the initiator's memory in one of two ways, chosen per
// slice by the initiator:
//   - a view of a buffer the engine allocated as shareable memory (a
//     sealed memfd, memory.AllocShared), whose descriptor the initiator
//     sends once per connection: a plain memcpy;
//   - cross-memory attach (process_vm_readv/writev) for other memory,
//     where the kernel allows it (same user, Yama's ptrace_scope), which
//     the owner checks at the handshake by reading a probe the initiator
//     announced.
//
// Slices neither way reaches go to the tcp path given to DialVia.
//
// Because the owner's own code copies every byte, chunk by chunk under the
// guard it takes for any access, its refusal of an aborted or fenced
// request is a fence on its own (transport.OwnerCopier), exactly as on
// tcp: a paused or killed initiator cannot put a byte into the owner's
// memory after Abort or Fence returned Safe, and no mapping of the owner's
// memory is ever given to a peer. The initiator keeps charge of its own
// memory with a lease (see lease.go): stopping a path revokes it and waits
// for the owner's chunk in progress.
package shm

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/internal/defaults"
	"github.com/kvferry/kvferry/internal/ratelog"
)

// Options configure a same-host transport. Zero fields take the defaults.
type Options struct {
	// HandshakeTimeout bounds the HELLO exchange. Default 5 s.
	HandshakeTimeout time.Duration
	// IOTimeout bounds one socket write (frames are small: a peer that
	// stops reading is cut by it). Default 30 s.
	IOTimeout time.Duration
	// MaxConns caps the connections accepted and open at once. Default 1024.
	MaxConns int
	// StopBound bounds how long stopping a path waits for the owner's chunk
	// in progress in our memory (one chunk: microseconds, unless the owner
	// was stopped in the middle of one). Default 2 s.
	StopBound time.Duration
	// Logger receives connection-level events. Default slog.Default().
	Logger *slog.Logger
	// ApplyDelay is for tests only: the owner sleeps this long after
	// admitting each slice and before copying it.
	ApplyDelay time.Duration
	// NoAttach is for tests only: the initiator announces no probe, so the
	// owner never uses cross-memory attach with it.
	NoAttach bool
	// GPU, when set, moves GPU memory of both ends through CUDA IPC: the
	// owner opens the initiator's allocations by their IPC handles and
	// copies with the driver, device to device where its own memory is
	// GPU memory too. Nil: the engine stages GPU memory through host
	// memory, as for tcp.
	GPU GPU
	// UnsafeIgnoreLease is for tests only: the owner copies into and out
	// of initiators' memory without their lease, so a stopped path can
	// still be written after its Abort returned (the row that shows the
	// lease matters).
	UnsafeIgnoreLease bool
}

func (o *Options) fill() {
	defaults.Fill(&o.HandshakeTimeout, 5*time.Second)
	defaults.Fill(&o.IOTimeout, 30*time.Second)
	defaults.Fill(&o.MaxConns, 1024)
	defaults.Fill(&o.StopBound, 2*time.Second)
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
}

// GPU is what the transport needs of the CUDA driver (the engine's).
type GPU interface {
	// Available reports whether the driver is loaded and lists a GPU; it
	// may load it.
	Available() bool
	// Export returns the IPC handle of the allocation holding
	// [addr, addr+n) of device memory, the allocation's base and size, and
	// the PCI bus id of its device.
	Export(addr, n uint64) (h [IPCHandleSize]byte, base, size uint64, bus string, err error)
	// Import opens a handle another process exported, on the device with
	// PCI bus id bus (another one where none has it), and returns that
	// device, the allocation's address here, and its size.
	Import(h [IPCHandleSize]byte, bus string) (ordinal int, addr, size uint64, err error)
	// Close unmaps what Import mapped.
	Close(ordinal int, addr uint64)
	// Copy copies n bytes on ordinal's context and returns once they were
	// copied: kind 1 host to device, 2 device to host, 3 device to device.
	Copy(ordinal, kind int, dst, src, n uint64) error
}

// Copy directions of GPU.Copy.
const (
	copyHtoD = 1
	copyDtoH = 2
	copyDtoD = 3
)

// Stats are the transport's counters.
type Stats struct {
	BytesIn          uint64 // bytes written into owner memory by peers
	BytesOut         uint64 // bytes read from owner memory by peers
	Refused          uint64 // accesses refused by the owner
	RefusedInFlight  uint64 // refusals that struck after some bytes had moved
	ProtocolErrors   uint64 // connections dropped for a malformed frame
	RefusedPeers     uint64 // connections refused: another user, or over MaxConns
	Conns            int64  // accepted connections open now
	SharedSlices     uint64 // our slices the owner copied through a shared buffer's view
	AttachSlices     uint64 // our slices the owner copied by cross-memory attach
	GPUSlices        uint64 // our slices of GPU memory the owner copied through CUDA IPC
	FallbackSlices   uint64 // our slices sent over tcp: neither way reached their memory
	StopsUnconfirmed uint64 // our paths stopped without the owner confirming it left our memory
}

type counters struct {
	bytesIn, bytesOut, refused, refusedInFlight, protocolErrors, refusedPeers atomic.Uint64
	shared, attach, fallback, unconfirmed, gpu                                atomic.Uint64
	conns                                                                     atomic.Int64
}

// Transport is the same-host transport. It is safe for concurrent use.
type Transport struct {
	opts   Options
	owner  transport.Owner
	ln     *net.UnixListener
	bootID string
	wg     sync.WaitGroup
	stats  counters
	warn   *ratelog.Limiter

	shareBytes atomic.Uint64 // bytes of initiators' buffers mapped by our owner side

	// GPU allocations exported to owners, by base (see gpuShare).
	gpuMu     sync.Mutex
	gpuShares []*gpuExport
	gpuNext   uint64

	mu        sync.Mutex
	closing   bool
	conns     map[*net.UnixConn]struct{}
	endpoints map[*endpoint]struct{}
	unhook    func()
}

// New returns a same-host transport. It fails where the host cannot tell
// its boot id (not Linux).
func New(opts Options) (*Transport, error) {
	opts.fill()
	id, err := BootID()
	if err != nil {
		return nil, fmt.Errorf("shm: %w", err)
	}
	t := &Transport{opts: opts, bootID: id, warn: ratelog.New(opts.Logger),
		conns: map[*net.UnixConn]struct{}{}, endpoints: map[*endpoint]struct{}{}}
	t.unhook = memory.OnSharedFree(t.sharedFreed)
	return t, nil
}

// Name returns "shm".
func (t *Transport) Name() string { return "shm" }

// OwnerCopies reports true: the owner's own code copies every byte, so its
// refusal is a fence (transport.OwnerCopier).
func (t *Transport) OwnerCopies() bool { return true }

// BootID is the boot id of this host, the first part of our address.
func (t *Transport) BootID() string { return t.bootID }

// Listen starts serving peers on an abstract unix socket and returns the
// address peers dial: "bootid@name". Only processes on this host (same
// boot id) and in this network namespace can reach it.
func (t *Transport) Listen(owner transport.Owner) (string, error) {
	if t.ln != nil {
		return "", errors.New("shm: already listening")
	}
	var r [8]byte
	_, _ = rand.Read(r[:])
	name := "@kvferry-shm-" + hex.EncodeToString(r[:])
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: name, Net: "unix"})
	if err != nil {
		return "", fmt.Errorf("shm: listen on %s: %w", name, err)
	}
	t.owner = owner
	t.ln = ln
	t.wg.Add(1)
	go t.accept()
	return t.bootID + name, nil
}

// maxShareTotal bounds the views of initiators' buffers our owner side maps
// at once, in bytes of address space.
const maxShareTotal = 32 << 40

// takeShareBytes reserves n bytes of the views' bound.
func (t *Transport) takeShareBytes(n uint64) bool {
	for {
		cur := t.shareBytes.Load()
		if cur+n > maxShareTotal {
			return false
		}
		if t.shareBytes.CompareAndSwap(cur, cur+n) {
			return true
		}
	}
}

func (t *Transport) releaseShareBytes(n uint64) { t.shareBytes.Add(-n) }

// SameHost reports whether addr, a peer's shm address, names this host.
func (t *Transport) SameHost(addr string) bool {
	boot, _, err := splitAddr(addr)
	return err == nil && boot == t.bootID
}

// splitAddr parses "bootid@name".
func splitAddr(addr string) (boot, name string, err error) {
	i := strings.IndexByte(addr, '@')
	if i <= 0 || i == len(addr)-1 || len(addr) > 256 {
		return "", "", fmt.Errorf("shm: address %q: want bootid@name", addr)
	}
	return addr[:i], addr[i:], nil
}

func (t *Transport) accept() {
	defer t.wg.Done()
	for {
		c, err := t.ln.AcceptUnix()
		if err != nil {
			t.mu.Lock()
			closing := t.closing
			t.mu.Unlock()
			if closing || errors.Is(err, net.ErrClosed) {
				return
			}
			t.opts.Logger.Warn("shm: accept failed", "err", err)
			time.Sleep(10 * time.Millisecond)
			continue
		}
		// Abstract sockets have no permissions: any user of the network
		// namespace can connect. Another user's connection is closed
		// before it takes a slot, so it cannot crowd ours out.
		if uid, err := peerUID(c); err != nil || uid != uint32(unix.Geteuid()) {
			_ = c.Close()
			t.stats.refusedPeers.Add(1)
			t.warn.Warn("other-user", "shm: refusing a connection of another user", "uid", uid, "err", err)
			continue
		}
		t.mu.Lock()
		if t.closing || len(t.conns) >= t.opts.MaxConns {
			closing := t.closing
			t.mu.Unlock()
			_ = c.Close()
			if !closing {
				t.stats.refusedPeers.Add(1)
				t.warn.Warn("conn-cap", "shm: refusing a connection: too many open", "max_conns", t.opts.MaxConns)
			}
			continue
		}
		t.conns[c] = struct{}{}
		t.stats.conns.Add(1)
		t.wg.Add(1)
		t.mu.Unlock()
		go func() {
			defer t.wg.Done()
			t.serve(c)
			t.mu.Lock()
			delete(t.conns, c)
			t.mu.Unlock()
			t.stats.conns.Add(-1)
		}()
	}
}

// protoErr logs (rate-limited) and counts a connection that broke the
// protocol; it is then closed.
func (t *Transport) protoErr(c *ownerConn, err error) {
	t.mu.Lock()
	closing := t.closing
	t.mu.Unlock()
	if closing || errors.Is(err, net.ErrClosed) {
		return
	}
	t.stats.protocolErrors.Add(1)
	t.warn.Warn("protocol", "shm: dropping connection", "peer", c.name, "pid", c.peer.pid, "err", err)
}

// connEnded reports why an owner-side connection ended.
func (t *Transport) connEnded(c *ownerConn, err error) {
	if errors.Is(err, errBadFrame) {
		t.protoErr(c, err)
		return
	}
	t.opts.Logger.Debug("shm: owner connection ended", "peer", c.name, "err", err)
}

// Dial opens one path to a peer's shm address. Slices whose memory the
// owner cannot reach fail; DialVia gives them a tcp path instead.
func (t *Transport) Dial(ctx context.Context, addr, self string) (transport.Endpoint, error) {
	return t.DialVia(ctx, addr, self, nil)
}

// FallbackDialer opens the tcp path a same-host path sends the slices the
// owner cannot reach by itself (memory neither shared nor reachable by
// cross-memory attach).
type FallbackDialer func(ctx context.Context) (transport.Endpoint, error)

// DialVia opens one path to a peer's shm address, with fallback for the
// slices the owner cannot reach (nil: they fail).
func (t *Transport) DialVia(ctx context.Context, addr, self string, fallback FallbackDialer) (transport.Endpoint, error) {
	boot, name, err := splitAddr(addr)
	if err != nil {
		return nil, err
	}
	if boot != t.bootID {
		return nil, fmt.Errorf("shm: dial %s: %w: another host (boot id %s, ours %s)", addr, transport.ErrConnection, boot, t.bootID)
	}
	if len(self) == 0 || len(self) > maxName {
		return nil, fmt.Errorf("shm: dial %s: our name %q must be 1 to %d bytes", addr, self, maxName)
	}
	t.mu.Lock()
	closing := t.closing
	t.mu.Unlock()
	if closing {
		return nil, transport.ErrClosed
	}
	deadline := time.Now().Add(t.opts.HandshakeTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	d := net.Dialer{Deadline: deadline}
	nc, err := d.DialContext(ctx, "unix", name)
	if err != nil {
		return nil, fmt.Errorf("shm: dial %s: %w: %w", addr, transport.ErrConnection, err)
	}
	conn := nc.(*net.UnixConn)
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Unix(1, 0)) })
	ep, err := newEndpoint(t, conn, self, deadline, fallback)
	if !stop() && err == nil {
		err = ctx.Err()
		ep.Abort(err)
	}
	if err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("shm: handshake with %s: %w: %w", addr, transport.ErrConnection, err)
	}
	t.mu.Lock()
	if t.closing {
		t.mu.Unlock()
		ep.Abort(transport.ErrClosed)
		return nil, transport.ErrClosed
	}
	t.endpoints[ep] = struct{}{}
	t.mu.Unlock()
	return ep, nil
}

func (t *Transport) forget(ep *endpoint) {
	t.mu.Lock()
	delete(t.endpoints, ep)
	t.mu.Unlock()
}

func (t *Transport) liveEndpoints() []*endpoint {
	t.mu.Lock()
	defer t.mu.Unlock()
	eps := make([]*endpoint, 0, len(t.endpoints))
	for ep := range t.endpoints {
		eps = append(eps, ep)
	}
	return eps
}

// sharedFreed tells every path that shared a freed buffer to have its
// owner unmap it.
func (t *Transport) sharedFreed(id uint64) {
	for _, ep := range t.liveEndpoints() {
		ep.unshare(id)
	}
}

// gpuExport is an allocation of our GPU memory exported by its IPC handle.
type gpuExport struct {
	id, base, size uint64
	handle         [IPCHandleSize]byte
	bus            string
}

// gpuIDBit marks the share ids of GPU allocations, so they never meet the
// ids of shareable host buffers (memory.Shared) in an owner's tables.
const gpuIDBit = 1 << 63

// gpuShare returns the export of the allocation holding [addr, addr+n),
// exporting it on first use.
func (t *Transport) gpuShare(addr, n uint64) (*gpuExport, error) {
	t.gpuMu.Lock()
	defer t.gpuMu.Unlock()
	for _, g := range t.gpuShares {
		if addr >= g.base && n <= g.size && addr-g.base <= g.size-n {
			return g, nil
		}
	}
	h, base, size, bus, err := t.opts.GPU.Export(addr, n)
	if err != nil {
		return nil, err
	}
	if len(bus) > maxBusID || addr < base || addr+n > base+size {
		return nil, fmt.Errorf("export of [%#x, +%d): allocation [%#x, +%d) on %q", addr, n, base, size, bus)
	}
	t.gpuNext++
	g := &gpuExport{id: gpuIDBit | t.gpuNext, base: base, size: size, handle: h, bus: bus}
	t.gpuShares = append(t.gpuShares, g)
	return g, nil
}

// gpuUnregistered forgets the exports of allocations that regions of GPU
// memory lay in, and has every owner that opened them close them: the
// allocation may be freed next. A later slice exports it again.
func (t *Transport) gpuUnregistered(regs []*memory.Region) {
	var gone []uint64
	t.gpuMu.Lock()
	kept := t.gpuShares[:0]
	for _, g := range t.gpuShares {
		hit := false
		for _, r := range regs {
			hit = hit || (isGPU(r) && r.Addr < g.base+g.size && g.base < r.End())
		}
		if hit {
			gone = append(gone, g.id)
		} else {
			kept = append(kept, g)
		}
	}
	t.gpuShares = kept
	t.gpuMu.Unlock()
	for _, id := range gone {
		t.sharedFreed(id)
	}
}

// Registered implements memory.Watcher; nothing to do.
func (t *Transport) Registered([]*memory.Region) error { return nil }

// Unregistered implements memory.Watcher: owners may be copying into or out
// of the regions for our slices in flight, so each path with such slices is
// stopped, which returns once its owner left our memory. A path whose owner
// did not confirm that within StopBound makes it an error wrapping
// transport.ErrInUse: the memory must not be reused.
func (t *Transport) Unregistered(regs []*memory.Region) error {
	defer t.gpuUnregistered(regs)
	var wg sync.WaitGroup
	var unconfirmed atomic.Int32
	for _, ep := range t.liveEndpoints() {
		if ep.touches(regs) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if !ep.stop(fmt.Errorf("%w: local memory unregistered", transport.ErrCanceled)) {
					unconfirmed.Add(1)
				}
			}()
		}
	}
	wg.Wait()
	if n := unconfirmed.Load(); n > 0 {
		return fmt.Errorf("shm: %w: %d same-host owners did not confirm within %v that they left the memory (stopped mid-copy?)",
			transport.ErrInUse, n, t.opts.StopBound)
	}
	return nil
}

// Close stops listening, cuts every connection, fails outstanding slices,
// and returns once no goroutine of the transport runs.
func (t *Transport) Close() error {
	t.mu.Lock()
	if t.closing {
		t.mu.Unlock()
		return nil
	}
	t.closing = true
	conns := t.conns
	t.conns = map[*net.UnixConn]struct{}{}
	eps := t.endpoints
	t.endpoints = map[*endpoint]struct{}{}
	t.mu.Unlock()
	if t.ln != nil {
		_ = t.ln.Close()
	}
	for c := range conns {
		_ = c.Close()
	}
	unconfirmed := 0
	for ep := range eps {
		if !ep.stop(transport.ErrClosed) {
			unconfirmed++
		}
	}
	t.wg.Wait()
	t.unhook()
	if unconfirmed > 0 {
		return fmt.Errorf("shm: close: %w: %d same-host owners did not confirm within %v that they left our memory (stopped mid-copy?)",
			transport.ErrInUse, unconfirmed, t.opts.StopBound)
	}
	return nil
}

// Stats returns a snapshot of the counters.
func (t *Transport) Stats() Stats {
	return Stats{
		BytesIn: t.stats.bytesIn.Load(), BytesOut: t.stats.bytesOut.Load(),
		Refused: t.stats.refused.Load(), RefusedInFlight: t.stats.refusedInFlight.Load(),
		ProtocolErrors: t.stats.protocolErrors.Load(), RefusedPeers: t.stats.refusedPeers.Load(),
		Conns: t.stats.conns.Load(), SharedSlices: t.stats.shared.Load(), AttachSlices: t.stats.attach.Load(),
		FallbackSlices: t.stats.fallback.Load(), StopsUnconfirmed: t.stats.unconfirmed.Load(), GPUSlices: t.stats.gpu.Load(),
	}
}
