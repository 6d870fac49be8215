package engine

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/kvferry/kvferry/engine/control"
	"github.com/kvferry/kvferry/engine/metadata"
)

// etcdResolver finds segments in the cluster's metadata store. An entry
// too large for the store sends us to the segment itself.
type etcdResolver struct {
	store *metadata.Etcd
	p2p   p2pResolver
}

func (r etcdResolver) Resolve(ctx context.Context, name string) (*control.Descriptor, error) {
	d, err := r.store.Resolve(ctx, name)
	if errors.Is(err, metadata.ErrTooLarge) {
		return r.p2p.Resolve(ctx, name)
	}
	if err != nil {
		if _, ok := ctx.Deadline(); ok && ctx.Err() != nil {
			return nil, fmt.Errorf("resolve %q through the metadata store by its deadline: %w", name, err)
		}
		return nil, fmt.Errorf("resolve %q through the metadata store: %w", name, err)
	}
	return d, nil
}

// metadataConfig parses Options.Metadata: "" and "p2p" keep the P2P
// handshake (ok false).
func metadataConfig(url string) (cfg metadata.Config, ok bool, err error) {
	switch strings.ToLower(url) {
	case "", "p2p", "p2phandshake":
		return metadata.Config{}, false, nil
	}
	cfg, err = metadata.ParseURL(url)
	if err != nil {
		return cfg, false, fmt.Errorf("metadata: %w (redis and http stores are not supported)", err)
	}
	return cfg, true, nil
}

// startMetadata opens the cluster's store, publishes our descriptor (within
// min(DefaultTimeout, 10 s): a store that is not there fails New, saying
// where it looked) and watches the other engines' entries.
func (e *Engine) startMetadata() error {
	cfg, ok, err := metadataConfig(e.opts.Metadata)
	if err != nil || !ok {
		return err
	}
	cfg.LeaseTTL = e.opts.MetadataTTL
	cfg.Logger = e.log
	store, err := metadata.Open(cfg)
	if err != nil {
		return fmt.Errorf("metadata: %w", err)
	}
	ctx, cancel := context.WithTimeout(e.closeCtx, min(e.opts.DefaultTimeout, 10*time.Second))
	defer cancel()
	if err := store.Publish(ctx, e.Name(), e.Descriptor); err != nil {
		_ = store.Close()
		return fmt.Errorf("metadata: %w", err)
	}
	e.meta = store
	e.resolver = etcdResolver{store: store, p2p: p2pResolver{e.plane}}
	store.Watch(e.onMetadata)
	return nil
}

// descriptorChanged records a change of our registrations: peers see it in
// descriptors fetched from now on, and the store gets it soon.
func (e *Engine) descriptorChanged() {
	e.epoch.Add(1)
	if e.meta != nil {
		e.meta.Changed()
	}
}

// onMetadata takes a change of another engine's entry in the store as a
// hint, never as a descriptor for an open segment: whoever can write to the
// store could otherwise point our paths elsewhere or make us stamp
// transfers with a fence epoch the owner never issued. An entry that names
// a new incarnation (its tcp address changed) or registrations newer than
// ours makes us ask the segment itself now, in the background, so that
// paths to a restarted peer are cut before they fail; what is older than
// our copy is ignored. An entry that went (the engine closed, or its lease
// ran out) makes the next heartbeat ping the segment however idle it is.
func (e *Engine) onMetadata(name string, d *control.Descriptor, deleted bool) {
	if e.closing.Load() || name == e.Name() {
		return
	}
	e.segMu.Lock()
	s := e.segments[name]
	e.segMu.Unlock()
	if s == nil || s.self {
		return
	}
	if deleted || d == nil {
		s.lastPing.Store(0)
		return
	}
	old := s.desc.Load()
	if old == nil {
		return
	}
	oldAddr, _ := old.Transport("tcp")
	newAddr, _ := d.Transport("tcp")
	if newAddr == oldAddr && d.Epoch <= old.Epoch {
		return
	}
	// One fetch at a time; when one is under way it brings news anyway.
	if len(s.refreshing) > 0 || !e.startBackground() {
		return
	}
	go func() {
		defer e.bg.Done()
		ctx, cancel := context.WithTimeout(e.closeCtx, max(2*e.opts.HeartbeatInterval, 2*time.Second))
		defer cancel()
		if err := s.refresh(ctx); err != nil {
			e.log.Debug("kvferry: metadata store: a peer's entry changed, but the peer did not answer", "segment", name, "err", err)
		}
	}()
}
