package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/kvferry/kvferry/engine/auth"
)

// newAuthority builds the engine's Authority from its options; nil when
// they ask for no authentication.
func newAuthority(opts Options) (*auth.Authority, error) {
	a, err := auth.New(auth.Config{
		SecretKeyFile: opts.SecretKeyFile, AllowlistFile: opts.AllowlistFile, ClusterSecretFile: opts.ClusterSecretFile,
	})
	if err != nil {
		return nil, fmt.Errorf("authentication: %w", err)
	}
	return a, nil
}

// PublicKey returns this engine's public key in Z85 (what peers put on
// their allowlists), and false when authentication is off.
func (e *Engine) PublicKey() (string, bool) {
	if e.auth == nil {
		return "", false
	}
	return e.auth.Public().String(), true
}

// ReloadAllowlist reads the allowlist file again. Peers whose keys it no
// longer lists are cut before it returns: their control connections are
// closed, their tcp data connections closed and their serving goroutines
// ended, their rdma QPs moved to the error state and destroyed, so none of
// their bytes lands in our memory afterwards; their next connection is
// refused in its handshake. It fails with ErrInvalidArg when the engine has
// no allowlist file (authentication off, or a cluster secret) or the file
// is unusable (the allowlist in force is then unchanged), and with the
// context's error when cutting did not finish in time.
func (e *Engine) ReloadAllowlist(ctx context.Context) error {
	if e.closing.Load() {
		return ErrClosed
	}
	if e.auth == nil {
		return fmt.Errorf("kvferry: reload allowlist: %w: authentication is off", ErrInvalidArg)
	}
	e.authMu.Lock()
	defer e.authMu.Unlock()
	removed, err := e.auth.Reload()
	if err != nil {
		if errors.Is(err, auth.ErrNoAllowlist) || errors.Is(err, auth.ErrConfig) || errors.Is(err, auth.ErrBadKey) {
			return fmt.Errorf("kvferry: reload allowlist: %w: %w", ErrInvalidArg, err)
		}
		return fmt.Errorf("kvferry: reload allowlist: %w", err)
	}
	names, err := e.cutRevoked(ctx, len(removed) > 0)
	e.log.Info("kvferry: allowlist reloaded", "keys", e.auth.Len(), "removed", len(removed), "peers_cut", names)
	return err
}

// cutRevoked cuts every peer whose key the allowlist no longer holds, on
// every plane, and returns their names. Control and tcp connections carry
// the key they proved and are cut by it. A responder QP is known only by
// the name its initiator gave on the control plane, and a name is not
// bound to a key (an allowed peer may give another's), so when any key was
// removed every rdma initiator's QPs are cut: each connects again through
// the control plane's handshake, which refuses the removed keys, and its
// work in flight is posted again as after a fence.
func (e *Engine) cutRevoked(ctx context.Context, anyRemoved bool) ([]string, error) {
	var errs []error
	names, err := e.plane.Revoke(ctx)
	errs = append(errs, err)
	tcpNames, err := e.tcp.CutUnallowed(ctx)
	errs = append(errs, err)
	names = append(names, tcpNames...)
	if e.rdma != nil && anyRemoved {
		for _, ini := range e.rdma.Initiators() {
			if err := e.rdma.CutPeer(ctx, ini); err != nil {
				errs = append(errs, err)
			}
			names = append(names, ini)
		}
	}
	slices.Sort(names)
	return slices.Compact(names), errors.Join(errs...)
}
