// Package local is the transport an engine uses for transfers to itself: a
// memcpy between two of its own registered ranges, checked by the owner like
// any peer's access and copied in chunks, each under both ranges' guards.
package local

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvferry/kvferry/engine/transport"
)

// ChunkSize is how many bytes are copied under one guard. Small enough that
// an unregistration, an Abort or a Fence waits for at most one chunk, big enough
// that the guard costs nothing next to the copy.
const ChunkSize = 1 << 20

// inlineLimit is the post size (bytes) copied in the caller's goroutine;
// larger posts run in a goroutine of their own, so Submit stays short.
const inlineLimit = 256 << 10

// Transport copies within one engine.
type Transport struct {
	owner transport.Owner
	self  string

	// ChunkDelay is for tests only: each chunk waits this long before its
	// copy (outside any guard), so that a test can fence or abort a local
	// transfer certainly in the middle of it.
	ChunkDelay time.Duration

	mu     sync.Mutex
	closed bool
	eps    map[*endpoint]struct{}
}

// New returns the local transport for an engine named self, whose accesses
// are checked by owner.
func New(owner transport.Owner, self string) *Transport {
	return &Transport{owner: owner, self: self, eps: map[*endpoint]struct{}{}}
}

// Name returns "local".
func (t *Transport) Name() string { return "local" }

// OwnerCopies reports true: this engine's own code copies every byte
// (transport.OwnerCopier).
func (t *Transport) OwnerCopies() bool { return true }

// Listen does nothing: the local transport serves only its own engine.
func (t *Transport) Listen(transport.Owner) (string, error) { return "", nil }

// Dial returns a path to this engine itself; addr is ignored.
func (t *Transport) Dial(ctx context.Context, addr, self string) (transport.Endpoint, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil, transport.ErrClosed
	}
	ep := &endpoint{t: t}
	t.eps[ep] = struct{}{}
	return ep, nil
}

// Close aborts every path and waits for their copies.
func (t *Transport) Close() error {
	t.mu.Lock()
	t.closed = true
	eps := t.eps
	t.eps = map[*endpoint]struct{}{}
	t.mu.Unlock()
	for ep := range eps {
		ep.Abort(transport.ErrClosed)
	}
	return nil
}

type endpoint struct {
	t      *Transport
	mu     sync.Mutex // orders Post's wg.Add against Abort's wg.Wait
	dead   atomic.Bool
	reason error // set before dead
	wg     sync.WaitGroup
}

// Post copies the slices, inline when they are small.
func (ep *endpoint) Post(slices []*transport.Slice) {
	ep.mu.Lock()
	if ep.dead.Load() {
		ep.mu.Unlock()
		for _, s := range slices {
			s.Finish(fmt.Errorf("local: %w: %w", transport.ErrConnection, ep.reason))
		}
		return
	}
	ep.wg.Add(1)
	ep.mu.Unlock()
	total := 0
	for _, s := range slices {
		total += len(s.Local)
	}
	if total <= inlineLimit {
		ep.run(slices)
		return
	}
	go ep.run(slices)
}

func (ep *endpoint) run(slices []*transport.Slice) {
	defer ep.wg.Done()
	for _, s := range slices {
		if !s.Advance(transport.StateQueued, transport.StateActive) {
			continue
		}
		s.Finish(ep.copy(s))
	}
}

func (ep *endpoint) copy(s *transport.Slice) error {
	a := transport.Access{
		Op: s.Op, Initiator: ep.t.self, RequestID: s.RequestID, Generation: s.Generation,
		GrantID: s.GrantID, Epoch: s.Epoch, Key: s.Key, Addr: s.Remote, Length: uint64(len(s.Local)),
	}
	tgt, err := ep.t.owner.Admit(a)
	if err != nil {
		return fmt.Errorf("%w: %w", transport.ErrRefused, err)
	}
	remote, g := tgt.Mem, tgt.Guard
	if tgt.Stage != nil {
		// GPU memory: through its host staging buffer, filled (READ) or
		// flushed (WRITE) whole inside the guard.
		defer tgt.Stage.Release()
		if s.Op == transport.Read {
			if err := transport.StageCopy(g, tgt.Stage.Fill); err != nil {
				return fmt.Errorf("%w: %w", transport.ErrRefused, err)
			}
		}
	}
	for off := 0; off < len(remote); off += ChunkSize {
		if ep.dead.Load() {
			return fmt.Errorf("local: %w: %w", transport.ErrConnection, ep.reason)
		}
		end := min(off+ChunkSize, len(remote))
		if d := ep.t.ChunkDelay; d > 0 {
			time.Sleep(d)
		}
		if err := g.Enter(); err != nil {
			return fmt.Errorf("%w: %w (%d of %d bytes moved)", transport.ErrRefused, err, off, len(remote))
		}
		if err := s.LocalReg.Enter(); err != nil {
			g.Leave()
			return fmt.Errorf("local memory: %w (%d of %d bytes moved)", err, off, len(remote))
		}
		if s.Op == transport.Write {
			copy(remote[off:end], s.Local[off:end])
		} else {
			copy(s.Local[off:end], remote[off:end])
		}
		s.LocalReg.Leave()
		g.Leave()
	}
	if tgt.Stage != nil && s.Op == transport.Write {
		if err := transport.StageCopy(g, tgt.Stage.Flush); err != nil {
			return fmt.Errorf("%w: %w", transport.ErrRefused, err)
		}
	}
	return nil
}

// Abort stops the path between chunks and waits for copies under way.
func (ep *endpoint) Abort(reason error) {
	ep.mu.Lock()
	if !ep.dead.Load() {
		ep.reason = reason
		ep.dead.Store(true)
	}
	ep.mu.Unlock()
	ep.wg.Wait()
	ep.t.mu.Lock()
	delete(ep.t.eps, ep)
	ep.t.mu.Unlock()
}

// Dead reports whether the path was aborted.
func (ep *endpoint) Dead() bool { return ep.dead.Load() }

// Close aborts the path with transport.ErrClosed.
func (ep *endpoint) Close() error {
	ep.Abort(transport.ErrClosed)
	return nil
}
