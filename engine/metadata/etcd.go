package metadata

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kvferry/kvferry/engine/control"
)

// Config says where the store is and how an engine's entry lives there.
type Config struct {
	// Endpoints are the etcd members, "host:port".
	Endpoints []string
	// Prefix is the cluster's key prefix: engines that share it find each
	// other. Keys are "/<Prefix>/segments/<segment name>".
	Prefix string
	// LeaseTTL is how long an engine's entry outlives its last keepalive:
	// an engine that dies (or loses the store) is gone from the store
	// that much later.
	LeaseTTL time.Duration
	// OpTimeout bounds one store operation made in the background
	// (publishing, keepalive setup) and the lease revocation at Close.
	OpTimeout time.Duration
	Logger    *slog.Logger
}

// DefaultPrefix is the key prefix of a URL without a path.
const DefaultPrefix = "kvferry"

// ParseURL parses "etcd://host:port[,host:port...][/prefix]".
func ParseURL(s string) (Config, error) {
	rest, ok := strings.CutPrefix(s, "etcd://")
	if !ok {
		return Config{}, fmt.Errorf("metadata %q: want etcd://host:port[,host:port]/prefix", s)
	}
	hosts, prefix, _ := strings.Cut(rest, "/")
	prefix = strings.Trim(prefix, "/")
	if prefix == "" {
		prefix = DefaultPrefix
	}
	if len(prefix) > 128 {
		return Config{}, fmt.Errorf("metadata %q: prefix longer than 128 bytes", s)
	}
	for _, r := range prefix {
		if r <= ' ' || r == 0x7f || r > 0x7e {
			return Config{}, fmt.Errorf("metadata %q: prefix holds %q (printable ASCII only)", s, r)
		}
	}
	var eps []string
	for _, h := range strings.Split(hosts, ",") {
		host, port, err := net.SplitHostPort(h)
		if err != nil || host == "" || port == "" {
			return Config{}, fmt.Errorf("metadata %q: endpoint %q: want host:port", s, h)
		}
		eps = append(eps, h)
	}
	if len(eps) > 16 {
		return Config{}, fmt.Errorf("metadata %q: %d endpoints, at most 16", s, len(eps))
	}
	return Config{Endpoints: eps, Prefix: prefix}, nil
}

// String is the URL the configuration was parsed from.
func (c Config) String() string {
	return "etcd://" + strings.Join(c.Endpoints, ",") + "/" + c.Prefix
}

// Stats counts what the store did for one engine.
type Stats struct {
	Publishes       uint64 // descriptors written
	PublishFailures uint64 // writes (or lease grants) that failed; each is retried
	LeasesLost      uint64 // leases that expired while the store was away; the entry was written again
	WatchEvents     uint64 // changes of other segments' entries seen
	Malformed       uint64 // entries under the prefix that did not decode (ignored)
}

// Etcd keeps this engine's descriptor in etcd under a lease and finds
// other engines' there. Its background goroutines (publishing, keepalive,
// watching) end at Close.
type Etcd struct {
	cfg  Config
	cli  *clientv3.Client
	keys string // "/<prefix>/segments/"
	log  *slog.Logger

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	kick  chan struct{}
	lease atomic.Int64
	own   atomic.Pointer[string] // the name Publish keeps, once called

	lastMalformedLog atomic.Int64 // UnixNano of the last malformed-entry warning
	watchOnce        sync.Once

	publishes, publishFailures, leasesLost, watchEvents, malformed atomic.Uint64
}

// Open makes a client of the store. It does not wait for the store: the
// first operation does, up to its context's deadline.
func Open(cfg Config) (*Etcd, error) {
	if len(cfg.Endpoints) == 0 {
		return nil, errors.New("etcd: no endpoints")
	}
	if cfg.LeaseTTL < 2*time.Second {
		cfg.LeaseTTL = 10 * time.Second
	}
	if cfg.OpTimeout <= 0 {
		cfg.OpTimeout = 5 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   cfg.Endpoints,
		DialTimeout: cfg.OpTimeout,
		// A store that vanishes without closing its connections (a
		// host cut off) is noticed within seconds, not at TCP's pace.
		DialKeepAliveTime:    2 * time.Second,
		DialKeepAliveTimeout: 2 * time.Second,
		PermitWithoutStream:  true,
		// The client's own logger writes to stderr: the host process's
		// stderr is not ours to fill.
		Logger: zap.NewNop(),
	})
	if err != nil {
		return nil, fmt.Errorf("etcd %s: %w", strings.Join(cfg.Endpoints, ","), err)
	}
	s := &Etcd{cfg: cfg, cli: cli, keys: "/" + cfg.Prefix + "/segments/", log: cfg.Logger, kick: make(chan struct{}, 1)}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	return s, nil
}

// Config returns the store's configuration.
func (s *Etcd) Config() Config { return s.cfg }

// Key is the key of the named segment's entry.
func (s *Etcd) Key(name string) string { return s.keys + name }

// Stats returns the counters.
func (s *Etcd) Stats() Stats {
	return Stats{
		Publishes: s.publishes.Load(), PublishFailures: s.publishFailures.Load(), LeasesLost: s.leasesLost.Load(),
		WatchEvents: s.watchEvents.Load(), Malformed: s.malformed.Load(),
	}
}

func (s *Etcd) where() string { return "etcd " + strings.Join(s.cfg.Endpoints, ",") }

// Resolve reads the named segment's descriptor. ErrNotPublished: no entry;
// ErrTooLarge: the entry sends us to the segment itself; an unreachable
// store fails at ctx's deadline.
func (s *Etcd) Resolve(ctx context.Context, name string) (*control.Descriptor, error) {
	resp, err := s.cli.Get(ctx, s.Key(name))
	if err != nil {
		if ctx.Err() != nil {
			err = fmt.Errorf("%w (the store did not answer: %w)", ctx.Err(), err)
		}
		return nil, fmt.Errorf("%s: get %s: %w", s.where(), s.Key(name), err)
	}
	if len(resp.Kvs) == 0 {
		return nil, fmt.Errorf("%s: %w: no entry %s (no engine of that name is alive under prefix %q)", s.where(), ErrNotPublished, s.Key(name), s.cfg.Prefix)
	}
	d, stored, err := DecodeValue(resp.Kvs[0].Value)
	if err != nil {
		if !errors.Is(err, ErrTooLarge) {
			s.malformed.Add(1)
		}
		return nil, fmt.Errorf("%s: entry %s: %w", s.where(), s.Key(name), err)
	}
	if stored != name {
		s.malformed.Add(1)
		return nil, fmt.Errorf("%s: entry %s: %w: it describes segment %q", s.where(), s.Key(name), ErrMalformed, stored)
	}
	return d, nil
}

// Publish writes name's entry from current() once, within ctx, and then
// keeps it: under a lease kept alive in the background, written again after
// each Changed and whenever the lease was lost (the store was away longer
// than LeaseTTL). It is called once.
func (s *Etcd) Publish(ctx context.Context, name string, current func() *control.Descriptor) error {
	lease, err := s.grant(ctx)
	if err == nil {
		err = s.put(ctx, name, current(), lease)
	}
	if err != nil {
		return fmt.Errorf("%s: publish segment %q: %w", s.where(), name, err)
	}
	s.own.Store(&name)
	s.wg.Add(1)
	go s.keep(name, current, lease)
	return nil
}

// changeDelay is how long a change waits for others before it is written.
const changeDelay = 50 * time.Millisecond

// Changed says the descriptor changed: it is written again within about
// changeDelay. It never blocks.
func (s *Etcd) Changed() {
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

func (s *Etcd) grant(ctx context.Context) (clientv3.LeaseID, error) {
	g, err := s.cli.Grant(ctx, int64((s.cfg.LeaseTTL+time.Second-1)/time.Second))
	if err != nil {
		return 0, fmt.Errorf("grant lease: %w", err)
	}
	return g.ID, nil
}

func (s *Etcd) put(ctx context.Context, name string, d *control.Descriptor, lease clientv3.LeaseID) error {
	if _, err := s.cli.Put(ctx, s.Key(name), string(EncodeValue(d)), clientv3.WithLease(lease)); err != nil {
		return fmt.Errorf("put %s: %w", s.Key(name), err)
	}
	s.lease.Store(int64(lease))
	s.publishes.Add(1)
	return nil
}

// keep runs the lease's keepalive and writes the entry again when it
// changed or the lease was lost, retrying failures with a backoff.
func (s *Etcd) keep(name string, current func() *control.Descriptor, lease clientv3.LeaseID) {
	defer s.wg.Done()
	var alive <-chan *clientv3.LeaseKeepAliveResponse
	dirty, failing := false, false
	backoff := 100 * time.Millisecond
	retry := time.NewTimer(0)
	<-retry.C
	for {
		if lease != 0 && alive == nil {
			ch, err := s.cli.KeepAlive(s.ctx, lease)
			if err == nil {
				alive = ch
			} else {
				lease = 0
			}
		}
		var err error
		if lease == 0 {
			ctx, cancel := context.WithTimeout(s.ctx, s.cfg.OpTimeout)
			lease, err = s.grant(ctx)
			cancel()
			dirty = err == nil
		}
		if err == nil && dirty {
			ctx, cancel := context.WithTimeout(s.ctx, s.cfg.OpTimeout)
			err = s.put(ctx, name, current(), lease)
			cancel()
			dirty = err != nil
		}
		if err != nil && s.ctx.Err() == nil {
			// One warning per outage, not one per retry.
			if s.publishFailures.Add(1); !failing {
				s.log.Warn("kvferry: metadata store: cannot publish our descriptor; retrying", "store", s.where(), "segment", name, "err", err)
			} else {
				s.log.Debug("kvferry: metadata store: publish failed again", "store", s.where(), "segment", name, "retry_in", backoff, "err", err)
			}
			failing = true
			retry.Reset(backoff)
			backoff = min(2*backoff, 5*time.Second)
		} else if err == nil {
			if failing && !dirty {
				s.log.Info("kvferry: metadata store: our descriptor is published again", "store", s.where(), "segment", name)
				failing = false
			}
			backoff = 100 * time.Millisecond
		}
		select {
		case <-s.ctx.Done():
			return
		case <-s.kick:
			dirty = true
			// Registrations come in bursts (a model's layers, one
			// after another): one write for the burst, not one each.
			select {
			case <-s.ctx.Done():
				return
			case <-time.After(changeDelay):
			}
			select {
			case <-s.kick:
			default:
			}
		case <-retry.C:
		case _, ok := <-alive:
			if !ok {
				// The lease expired (the store was away longer than
				// LeaseTTL) or the store forgot it: our entry is gone.
				if s.ctx.Err() != nil {
					return
				}
				s.leasesLost.Add(1)
				s.log.Warn("kvferry: metadata store: our lease was lost; publishing again", "store", s.where(), "segment", name)
				lease, alive, dirty = 0, nil, true
			}
		}
	}
}

// Watch calls fn for every change of another entry under the prefix, from
// one goroutine, until Close: the new descriptor, or deleted when the
// entry went (its engine closed or its lease expired). A watch the store
// breaks is set up again. Entries that do not decode are counted and
// skipped; one too large for the store comes with a nil descriptor and
// deleted false (ask the segment). Watch is called at most once.
func (s *Etcd) Watch(fn func(name string, d *control.Descriptor, deleted bool)) {
	s.watchOnce.Do(func() {
		s.wg.Add(1)
		go s.watch(fn)
	})
}

func (s *Etcd) watch(fn func(name string, d *control.Descriptor, deleted bool)) {
	defer s.wg.Done()
	var rev int64
	for s.ctx.Err() == nil {
		if rev > 0 {
			// A store that lost its data (a member rebuilt) counts
			// revisions from 1 again: watching from our old revision
			// would wait for a future that never brings our events.
			ctx, cancel := context.WithTimeout(s.ctx, s.cfg.OpTimeout)
			cur, err := s.cli.Get(ctx, s.keys, clientv3.WithPrefix(), clientv3.WithCountOnly())
			cancel()
			if err == nil && cur.Header.Revision < rev {
				rev = 0
			}
		}
		opts := []clientv3.OpOption{clientv3.WithPrefix()}
		if rev > 0 {
			opts = append(opts, clientv3.WithRev(rev+1))
		}
		// RequireLeader: a member cut off from its cluster ends the
		// watch instead of leaving it silent.
		for resp := range s.cli.Watch(clientv3.WithRequireLeader(s.ctx), s.keys, opts...) {
			if err := resp.Err(); err != nil {
				if resp.CompactRevision > 0 {
					rev = resp.CompactRevision - 1
				}
				s.log.Debug("kvferry: metadata store: watch ended; watching again", "store", s.where(), "err", err)
				break
			}
			for _, ev := range resp.Events {
				name := strings.TrimPrefix(string(ev.Kv.Key), s.keys)
				s.watchEvents.Add(1)
				if own := s.own.Load(); own != nil && name == *own {
					// Our entry was deleted or overwritten by someone
					// else (an operator, a stale writer): ours is
					// written again. Our own writes come back here too;
					// writing them again costs one put, and the kick
					// channel folds bursts.
					if ev.Type == clientv3.EventTypeDelete || ev.Kv.Lease != s.lease.Load() {
						s.Changed()
					}
					continue
				}
				if ev.Type == clientv3.EventTypeDelete {
					fn(name, nil, true)
					continue
				}
				d, stored, err := DecodeValue(ev.Kv.Value)
				switch {
				case errors.Is(err, ErrTooLarge) && stored == name:
					fn(name, nil, false)
				case err != nil || stored != name:
					s.malformed.Add(1)
					// Whoever writes garbage under the prefix must not
					// fill every engine's log: one line per 10 s.
					if now := time.Now().UnixNano(); now-s.lastMalformedLog.Load() >= int64(10*time.Second) {
						s.lastMalformedLog.Store(now)
						s.log.Warn("kvferry: metadata store: ignored a malformed entry (more are counted, not logged, for 10 s)",
							"store", s.where(), "key", string(ev.Kv.Key), "malformed_so_far", s.malformed.Load(), "err", err)
					}
				default:
					fn(name, d, false)
				}
			}
			rev = resp.Header.Revision
		}
		select {
		case <-s.ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

// Close stops the background work, removes our entry (revoking its lease,
// within OpTimeout, so peers watching see it go at once rather than after
// LeaseTTL) and closes the client.
func (s *Etcd) Close() error {
	s.cancel()
	s.wg.Wait()
	if lease := clientv3.LeaseID(s.lease.Load()); lease != 0 {
		ctx, cancel := context.WithTimeout(context.Background(), min(s.cfg.OpTimeout, time.Second))
		_, _ = s.cli.Revoke(ctx, lease)
		cancel()
	}
	return s.cli.Close()
}
