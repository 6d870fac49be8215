package transporttest

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
)

// Owner is a transport.Owner backed by a memory.Registry, as the engine's
// Admit is: the key must be current and the range inside its region, and the
// returned Target enters and leaves the region itself. It adds what tests
// need to steer a transport: a gate that holds accesses at admission, counters,
// and a hook run inside each chunk's guard.
type Owner struct {
	Registry *memory.Registry

	// Admits counts Admit calls, Waiting those held at the gate right now,
	// Enters the chunks a transport entered, and Refused the accesses
	// refused at admission.
	Admits, Waiting, Enters, Refused atomic.Int64

	// Initiator is the registry of the initiator's memory, for transports
	// that must register it with hardware too (they Watch it).
	Initiator *memory.Registry
	// Progress, when set, counts the work a transport whose owner-side
	// code is not on the data path (rdma: work requests completed) has
	// done; the suite uses it where it would count Enters or Admits.
	Progress func() int64
	// Concurrent says that the endpoint runs the slices posted to it on
	// several paths at once (rdma: NIC pairs), so two slices may complete
	// in either order; without it the suite holds the endpoint to the
	// order of Post.
	Concurrent bool

	mu      sync.Mutex
	gate    chan struct{}
	onEnter atomic.Pointer[func()]
}

// NewOwner returns an owner for reg.
func NewOwner(reg *memory.Registry) *Owner { return &Owner{Registry: reg} }

// errBadOp is the owner's answer to an access that is neither READ nor WRITE.
var errBadOp = errors.New("transporttest: access is neither READ nor WRITE")

// Admit implements transport.Owner.
func (o *Owner) Admit(a transport.Access) (transport.Target, error) {
	o.Admits.Add(1)
	o.mu.Lock()
	g := o.gate
	o.mu.Unlock()
	if g != nil {
		o.Waiting.Add(1)
		<-g
		o.Waiting.Add(-1)
	}
	if a.Op != transport.Read && a.Op != transport.Write {
		o.Refused.Add(1)
		return transport.Target{}, fmt.Errorf("%w: %v", errBadOp, a.Op)
	}
	r, err := o.Registry.Lookup(a.Key, a.Addr, a.Length)
	if err != nil {
		o.Refused.Add(1)
		return transport.Target{}, err
	}
	return transport.Target{Guard: &target{o: o, r: r}, Mem: r.Bytes(a.Addr, a.Length)}, nil
}

// Hold makes every Admit from now on wait until release is called (which
// may be called more than once). Nothing is admitted meanwhile, so a
// transport with work for this owner stalls: tcp stops being read, local
// stops copying.
func (o *Owner) Hold() (release func()) {
	g := make(chan struct{})
	o.mu.Lock()
	o.gate = g
	o.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			o.mu.Lock()
			if o.gate == g {
				o.gate = nil
			}
			o.mu.Unlock()
			close(g)
		})
	}
}

// OnEnter sets a function run after each successful Enter, inside the
// chunk's guard (nil clears it). It stands for the scheduler pausing a copy
// right after it pinned owner memory.
func (o *Owner) OnEnter(f func()) {
	if f == nil {
		o.onEnter.Store(nil)
		return
	}
	o.onEnter.Store(&f)
}

// target is owner memory admitted for one access: the region's guard and
// the admitted bytes.
type target struct {
	o *Owner
	r *memory.Region
}

func (t *target) Enter() error {
	if err := t.r.Enter(); err != nil {
		return err
	}
	t.o.Enters.Add(1)
	if f := t.o.onEnter.Load(); f != nil {
		(*f)()
	}
	return nil
}

func (t *target) Leave() { t.r.Leave() }

func (o *Owner) progress() int64 {
	if o.Progress == nil {
		return 0
	}
	return o.Progress()
}
