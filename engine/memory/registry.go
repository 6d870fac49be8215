// Package memory keeps an engine's registered memory: which address ranges
// peers and local transfers may touch, under which buffer key, and a pin that
// lets unregistration wait for copies already under way.
//
// Lookups by address are O(log n) (a sorted slice searched by binary search)
// and lookups by key are O(1). A range registered again gets a new key, so a
// transfer planned against the old registration can never land in memory that
// changed hands.
package memory

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"unsafe"
)

// Key names one registration: an engine-lifetime tag chosen at random (in
// the high 32 bits) plus a 64-bit count of registrations, so keys are never
// reused within an engine (the count does not wrap in any lifetime: 2^64
// registrations) and almost never across restarts of one.
type Key uint64

// Errors returned by the registry; match them with errors.Is.
var (
	ErrOverlap       = errors.New("range overlaps a registered range")
	ErrNotRegistered = errors.New("range is not registered")
	ErrStaleKey      = errors.New("buffer key is stale (range unregistered or registered again)")
	ErrOutOfBounds   = errors.New("access outside the registered range")
	// ErrInvalidArg is the root of every invalid-argument error of kvferry;
	// the engine re-exports it.
	ErrInvalidArg   = errors.New("invalid argument")
	ErrInvalidRange = fmt.Errorf("%w: invalid memory range", ErrInvalidArg)
	ErrUnregistered = errors.New("memory was unregistered during the access")
)

// Region is one registered range. Its fields never change after
// registration; only the pin state does.
type Region struct {
	Addr     uint64 // first byte, as an address in this process
	Len      uint64
	Key      Key
	Location string // "cpu:0", later "cuda:N"

	base unsafe.Pointer
	keep []byte // holds Go-visible memory alive for as long as it is registered

	// active counts copies in progress (Enter without Leave yet). Enter
	// never blocks, so a copy may hold several regions (or one region
	// twice) at once without risking a deadlock with an Unregister.
	active atomic.Int64
	dead   atomic.Bool
	idleMu sync.Mutex
	idle   *sync.Cond // signalled when active drops to 0 after dead is set
}

// End returns the first address past the region.
func (r *Region) End() uint64 { return r.Addr + r.Len }

// Contains reports whether [addr, addr+n) lies inside the region.
func (r *Region) Contains(addr, n uint64) bool {
	return addr >= r.Addr && n <= r.Len && addr-r.Addr <= r.Len-n
}

// Bytes returns the region's memory from addr for n bytes. The caller must
// have checked Contains and must touch the bytes only while pinned.
func (r *Region) Bytes(addr, n uint64) []byte {
	return unsafe.Slice((*byte)(unsafe.Add(r.base, addr-r.Addr)), n)
}

// Enter keeps the region registered until Leave; it fails once Unregister
// has begun. It never blocks. Hold it only around a copy that cannot block
// for long (a non-blocking syscall, a memcpy).
func (r *Region) Enter() error {
	r.active.Add(1)
	if r.dead.Load() {
		r.Leave()
		return ErrUnregistered
	}
	return nil
}

// Leave ends an Enter.
func (r *Region) Leave() {
	if r.active.Add(-1) == 0 && r.dead.Load() {
		r.idleMu.Lock()
		r.idle.Broadcast()
		r.idleMu.Unlock()
	}
}

// retire refuses new copies and waits for those in progress. Go's atomics
// are sequentially consistent: either an Enter sees dead, or this sees its
// count.
func (r *Region) retire() {
	r.dead.Store(true)
	r.idleMu.Lock()
	for r.active.Load() != 0 {
		r.idle.Wait()
	}
	r.idleMu.Unlock()
}

// Dead reports whether the region was unregistered.
func (r *Region) Dead() bool { return r.dead.Load() }

// MaxRegions caps the registrations of one registry, so that its segment
// descriptor always fits one control message.
const MaxRegions = 1 << 18

// ErrTooMany is returned when a registration would pass MaxRegions.
var ErrTooMany = errors.New("too many registrations")

// Range describes memory to register.
type Range struct {
	Mem      []byte
	Location string
}

// Registry holds the registered regions of one engine. It is safe for
// concurrent use.
type Registry struct {
	mu     sync.RWMutex
	byAddr []*Region // sorted by Addr, non-overlapping
	byKey  map[Key]*Region
	tag    uint64
	next   atomic.Uint64 // registrations so far: the count part of keys

	watchMu  sync.RWMutex
	watchers []Watcher
}

// Watcher is told of registrations: transports whose hardware reaches
// memory without the owner's code (RDMA) must register it with the device
// too, and deregister it before Unregister returns.
type Watcher interface {
	// Registered is called once regions are in the registry; an error
	// undoes the whole registration.
	Registered(regs []*Region) error
	// Unregistered is called once regions left the registry and copies
	// into them stopped; it must return only when the hardware (or a
	// peer process copying them itself) no longer reaches them, or with
	// an error saying that it could not confirm so within its bound: the
	// memory may then still be touched, and must not be reused.
	Unregistered(regs []*Region) error
}

// Watch adds a watcher; registrations made before it are not replayed.
func (g *Registry) Watch(w Watcher) {
	g.watchMu.Lock()
	g.watchers = append(g.watchers, w)
	g.watchMu.Unlock()
}

func (g *Registry) watching() []Watcher {
	g.watchMu.RLock()
	defer g.watchMu.RUnlock()
	return g.watchers
}

// notifyRegistered tells the watchers of regs, undoing the registration
// when one refuses.
func (g *Registry) notifyRegistered(regs []*Region) error {
	ws := g.watching()
	for i, w := range ws {
		if err := w.Registered(regs); err != nil {
			for _, done := range ws[:i] {
				_ = done.Unregistered(regs) // nothing reached memory registered a moment ago
			}
			addrs := make([]uint64, len(regs))
			for k, r := range regs {
				addrs[k] = r.Addr
			}
			g.remove(addrs)
			return err
		}
	}
	return nil
}

// notifyUnregistered tells every watcher, and returns their errors: memory
// a watcher could not confirm free.
func (g *Registry) notifyUnregistered(regs []*Region) error {
	if len(regs) == 0 {
		return nil
	}
	var errs []error
	for _, w := range g.watching() {
		if err := w.Unregistered(regs); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// NewRegistry returns an empty registry.
func NewRegistry() *Registry {
	var b [4]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(fmt.Sprintf("memory: no randomness for key tag: %v", err))
	}
	return &Registry{byKey: make(map[Key]*Region), tag: uint64(binary.LittleEndian.Uint32(b[:])|1) << 32}
}

// AddrOf returns the address of b's first byte (0 for an empty slice).
func AddrOf(b []byte) uint64 {
	if len(b) == 0 {
		return 0
	}
	return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b))))
}

// Register adds all ranges or none. Ranges must be non-empty, must not wrap
// around the address space and must overlap neither each other nor anything
// registered.
func (g *Registry) Register(ranges []Range) ([]*Region, error) {
	regs := make([]*Region, len(ranges))
	for i, rg := range ranges {
		if len(rg.Mem) == 0 {
			return nil, fmt.Errorf("range %d: %w: empty", i, ErrInvalidRange)
		}
		addr := AddrOf(rg.Mem)
		if addr+uint64(len(rg.Mem)) < addr {
			return nil, fmt.Errorf("range %d: %w: wraps the address space", i, ErrInvalidRange)
		}
		regs[i] = &Region{
			Addr: addr, Len: uint64(len(rg.Mem)), Location: rg.Location,
			base: unsafe.Pointer(unsafe.SliceData(rg.Mem)), keep: rg.Mem,
		}
		regs[i].idle = sync.NewCond(&regs[i].idleMu)
	}
	sorted := append([]*Region(nil), regs...)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i].Addr < sorted[j].Addr })
	for i := 1; i < len(sorted); i++ {
		if sorted[i].Addr < sorted[i-1].End() {
			return nil, fmt.Errorf("%w: [%#x, %#x) and [%#x, %#x) in the same call", ErrOverlap,
				sorted[i-1].Addr, sorted[i-1].End(), sorted[i].Addr, sorted[i].End())
		}
	}
	g.mu.Lock()
	if len(g.byAddr)+len(regs) > MaxRegions {
		g.mu.Unlock()
		return nil, fmt.Errorf("%w: %d registered, %d more asked, at most %d", ErrTooMany, len(g.byAddr), len(regs), MaxRegions)
	}
	for _, r := range sorted {
		if o := g.overlapLocked(r.Addr, r.Len); o != nil {
			g.mu.Unlock()
			return nil, fmt.Errorf("%w: [%#x, %#x) overlaps registered [%#x, %#x)", ErrOverlap,
				r.Addr, r.End(), o.Addr, o.End())
		}
	}
	for _, r := range regs {
		r.Key = Key(g.tag + g.next.Add(1))
		g.byKey[r.Key] = r
	}
	merged := make([]*Region, 0, len(g.byAddr)+len(sorted))
	i, j := 0, 0
	for i < len(g.byAddr) || j < len(sorted) {
		if j == len(sorted) || (i < len(g.byAddr) && g.byAddr[i].Addr < sorted[j].Addr) {
			merged = append(merged, g.byAddr[i])
			i++
		} else {
			merged = append(merged, sorted[j])
			j++
		}
	}
	g.byAddr = merged
	g.mu.Unlock()
	if err := g.notifyRegistered(regs); err != nil {
		return nil, err
	}
	return regs, nil
}

// overlapLocked returns a registered region overlapping [addr, addr+n), if any.
func (g *Registry) overlapLocked(addr, n uint64) *Region {
	i := sort.Search(len(g.byAddr), func(i int) bool { return g.byAddr[i].End() > addr })
	if i < len(g.byAddr) && g.byAddr[i].Addr < addr+n {
		return g.byAddr[i]
	}
	return nil
}

// Unregister removes the regions starting at the given addresses, all or
// none. It returns after every copy in progress into or out of them ended;
// no copy starts afterwards. When a watcher could not confirm that
// nothing reaches them any more, the regions are gone all the same and the
// watcher's error is returned with them: the memory must not be reused.
func (g *Registry) Unregister(addrs []uint64) ([]*Region, error) {
	regs, err := g.remove(addrs)
	if err != nil {
		return nil, err
	}
	if err := g.notifyUnregistered(regs); err != nil {
		return regs, fmt.Errorf("unregister: %w", err)
	}
	return regs, nil
}

// remove takes regions out and waits for their copies, without telling
// the watchers.
func (g *Registry) remove(addrs []uint64) ([]*Region, error) {
	g.mu.Lock()
	regs := make([]*Region, len(addrs))
	seen := make(map[uint64]bool, len(addrs))
	for i, a := range addrs {
		r := g.findLocked(a)
		if r == nil || r.Addr != a {
			g.mu.Unlock()
			return nil, fmt.Errorf("unregister %#x: %w", a, ErrNotRegistered)
		}
		if seen[a] {
			g.mu.Unlock()
			return nil, fmt.Errorf("unregister %#x: %w: named twice", a, ErrInvalidRange)
		}
		seen[a] = true
		regs[i] = r
	}
	for _, r := range regs {
		delete(g.byKey, r.Key)
	}
	kept := g.byAddr[:0:0]
	for _, r := range g.byAddr {
		if !seen[r.Addr] {
			kept = append(kept, r)
		}
	}
	g.byAddr = kept
	g.mu.Unlock()
	for _, r := range regs {
		r.retire()
		r.keep = nil
	}
	return regs, nil
}

// UnregisterOverlapping removes every region overlapping [addr, addr+n),
// waiting for copies in progress like Unregister, and returns them, with
// the watchers' errors as Unregister does.
func (g *Registry) UnregisterOverlapping(addr, n uint64) ([]*Region, error) {
	g.mu.Lock()
	var regs []*Region
	kept := g.byAddr[:0:0]
	for _, r := range g.byAddr {
		if r.Addr < addr+n && addr < r.End() {
			regs = append(regs, r)
			delete(g.byKey, r.Key)
		} else {
			kept = append(kept, r)
		}
	}
	if len(regs) > 0 {
		g.byAddr = kept
	}
	g.mu.Unlock()
	for _, r := range regs {
		r.retire()
		r.keep = nil
	}
	if err := g.notifyUnregistered(regs); err != nil {
		return regs, fmt.Errorf("unregister: %w", err)
	}
	return regs, nil
}

func (g *Registry) findLocked(addr uint64) *Region {
	i := sort.Search(len(g.byAddr), func(i int) bool { return g.byAddr[i].End() > addr })
	if i < len(g.byAddr) && g.byAddr[i].Addr <= addr {
		return g.byAddr[i]
	}
	return nil
}

// Find returns the region holding all of [addr, addr+n).
func (g *Registry) Find(addr, n uint64) (*Region, error) {
	if n == 0 || addr+n < addr {
		return nil, fmt.Errorf("%w: [%#x, +%d)", ErrInvalidRange, addr, n)
	}
	g.mu.RLock()
	r := g.findLocked(addr)
	g.mu.RUnlock()
	if r == nil {
		return nil, fmt.Errorf("[%#x, +%d): %w", addr, n, ErrNotRegistered)
	}
	if !r.Contains(addr, n) {
		return nil, fmt.Errorf("[%#x, +%d) runs past registered [%#x, %#x): %w", addr, n, r.Addr, r.End(), ErrOutOfBounds)
	}
	return r, nil
}

// Lookup checks an access named by key: the key must be current and
// [addr, addr+n) inside its region.
func (g *Registry) Lookup(key Key, addr, n uint64) (*Region, error) {
	if n == 0 || addr+n < addr {
		return nil, fmt.Errorf("%w: [%#x, +%d)", ErrInvalidRange, addr, n)
	}
	g.mu.RLock()
	r := g.byKey[key]
	g.mu.RUnlock()
	if r == nil {
		return nil, fmt.Errorf("key %#x: %w", uint64(key), ErrStaleKey)
	}
	if !r.Contains(addr, n) {
		return nil, fmt.Errorf("[%#x, +%d) outside key %#x's [%#x, %#x): %w", addr, n, uint64(key), r.Addr, r.End(), ErrOutOfBounds)
	}
	return r, nil
}

// Regions returns a snapshot of the registered regions in address order.
func (g *Registry) Regions() []*Region {
	g.mu.RLock()
	defer g.mu.RUnlock()
	return append([]*Region(nil), g.byAddr...)
}

// Len returns the number of registered regions.
func (g *Registry) Len() int {
	g.mu.RLock()
	defer g.mu.RUnlock()
	return len(g.byAddr)
}
