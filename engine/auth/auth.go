// Package auth holds an engine's identity and the peers it lets in.
//
// An identity is a static Curve25519 key pair, the same keys ZeroMQ's CURVE
// mechanism uses (40-character Z85 text). An Authority is this engine's
// identity plus the public keys it accepts: an allowlist file, reloadable
// while the engine runs, or, for simple deployments, a cluster secret from
// which every engine derives the same key pair and accepts only it.
//
// The control plane authenticates peers with CURVE against the Authority;
// the tcp data plane proves, on each new connection, that both ends hold
// secret keys the other's Authority accepts (DataKey). An engine without an
// Authority (nil) authenticates nobody, as Mooncake does.
package auth

import (
	"bufio"
	"bytes"
	"crypto/ecdh"
	"crypto/hmac"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"sync/atomic"
)

// KeySize is the size of a public or secret key in bytes.
const KeySize = 32

// Key is a Curve25519 public or secret key.
type Key [KeySize]byte

// String returns the key as 40 characters of Z85, the text form ZeroMQ's
// tools (zmq_curve_keypair, czmq's zcert) read and write.
func (k Key) String() string { return Z85Encode(k[:]) }

// ParseKey reads a key from its 40-character Z85 form.
func ParseKey(s string) (Key, error) {
	var k Key
	b, err := Z85Decode(strings.TrimSpace(s))
	if err != nil {
		return k, err
	}
	if len(b) != KeySize {
		return k, fmt.Errorf("%w: a key is %d bytes (40 Z85 characters), got %d", ErrBadKey, KeySize, len(b))
	}
	copy(k[:], b)
	return k, nil
}

// Errors of the package; match them with errors.Is.
var (
	// ErrBadKey: a key's text or bytes are not a usable Curve25519 key.
	ErrBadKey = errors.New("auth: bad key")
	// ErrConfig: the identity or allowlist configuration is unusable (a
	// missing, unreadable, empty or too widely readable file, or
	// options that contradict each other).
	ErrConfig = errors.New("auth: bad configuration")
	// ErrNotAllowed: a peer's key is not on the allowlist.
	ErrNotAllowed = errors.New("auth: peer key not allowed")
	// ErrNoAllowlist: Reload on an Authority that has no allowlist file
	// (one built from a cluster secret).
	ErrNoAllowlist = errors.New("auth: no allowlist file to reload")
	// ErrUnauthenticated: a peer did not prove an identity the allowlist
	// accepts, or would not accept ours. The control plane and the data
	// plane both wrap it.
	ErrUnauthenticated = errors.New("peer not authenticated")
)

// Identity is a key pair.
type Identity struct {
	Public Key
	Secret Key
}

// IdentityFromSecret completes a key pair from its secret key.
func IdentityFromSecret(secret Key) (Identity, error) {
	priv, err := ecdh.X25519().NewPrivateKey(secret[:])
	if err != nil {
		return Identity{}, fmt.Errorf("%w: %v", ErrBadKey, err)
	}
	id := Identity{Secret: secret}
	copy(id.Public[:], priv.PublicKey().Bytes())
	return id, nil
}

// minClusterSecret is the shortest cluster secret accepted: shorter ones
// can be guessed offline from one recorded handshake.
const minClusterSecret = 16

// IdentityFromClusterSecret derives the key pair every engine of a cluster
// sharing secret has. The secret must be at least 16 bytes (after trimming
// surrounding white space).
func IdentityFromClusterSecret(secret []byte) (Identity, error) {
	secret = bytes.TrimSpace(secret)
	if len(secret) < minClusterSecret {
		return Identity{}, fmt.Errorf("%w: a cluster secret needs at least %d bytes, got %d", ErrConfig, minClusterSecret, len(secret))
	}
	h := sha256.New()
	h.Write([]byte("kvferry cluster secret v1\x00"))
	h.Write(secret)
	var k Key
	copy(k[:], h.Sum(nil))
	return IdentityFromSecret(k)
}

// Config says where an Authority's keys come from. Either SecretKeyFile
// with AllowlistFile, or ClusterSecretFile alone; all empty means no
// authentication.
type Config struct {
	// SecretKeyFile holds this engine's secret key: 40 Z85 characters on
	// their own, or a czmq certificate's `secret-key = "..."` line. It
	// must not be readable by group or others.
	SecretKeyFile string
	// AllowlistFile lists the public keys of the peers let in, one Z85
	// key per line (anything after the key on its line is a label; lines
	// starting with '#' are comments). Our own public key is always let
	// in. Read again by Authority.Reload.
	AllowlistFile string
	// ClusterSecretFile holds a secret shared by every engine of the
	// cluster (at least 16 bytes); it must not be readable by group or
	// others.
	ClusterSecretFile string
}

// Enabled reports whether c asks for authentication.
func (c Config) Enabled() bool {
	return c.SecretKeyFile != "" || c.AllowlistFile != "" || c.ClusterSecretFile != ""
}

// Authority is this engine's identity and the set of peer keys it accepts.
// Its methods are safe for concurrent use; Allowed takes no lock.
type Authority struct {
	self      Identity
	allowFile string
	reloadMu  sync.Mutex
	allowed   atomic.Pointer[map[Key]struct{}]
}

// New builds the Authority c describes; it returns nil, nil when c asks for
// no authentication.
func New(c Config) (*Authority, error) {
	if !c.Enabled() {
		return nil, nil
	}
	a := &Authority{allowFile: c.AllowlistFile}
	switch {
	case c.ClusterSecretFile != "" && (c.SecretKeyFile != "" || c.AllowlistFile != ""):
		return nil, fmt.Errorf("%w: a cluster secret replaces the secret key and allowlist files; give one or the other", ErrConfig)
	case c.ClusterSecretFile != "":
		secret, err := readPrivateFile(c.ClusterSecretFile, "cluster secret")
		if err != nil {
			return nil, err
		}
		if a.self, err = IdentityFromClusterSecret(secret); err != nil {
			return nil, fmt.Errorf("cluster secret file %q: %w", c.ClusterSecretFile, err)
		}
		set := map[Key]struct{}{a.self.Public: {}}
		a.allowed.Store(&set)
		return a, nil
	case c.SecretKeyFile == "":
		return nil, fmt.Errorf("%w: an allowlist needs this engine's secret key file too", ErrConfig)
	case c.AllowlistFile == "":
		return nil, fmt.Errorf("%w: a secret key needs an allowlist file (or use a cluster secret)", ErrConfig)
	}
	var err error
	if a.self, err = ReadSecretKeyFile(c.SecretKeyFile); err != nil {
		return nil, err
	}
	if _, err := a.Reload(); err != nil {
		return nil, err
	}
	return a, nil
}

// ReadSecretKeyFile reads a secret key file (Z85, or a czmq certificate)
// and completes its key pair. The file must not be readable by group or
// others.
func ReadSecretKeyFile(path string) (Identity, error) {
	text, err := readPrivateFile(path, "secret key")
	if err != nil {
		return Identity{}, err
	}
	secret, err := parseSecretKeyText(text)
	if err != nil {
		return Identity{}, fmt.Errorf("secret key file %q: %w", path, err)
	}
	id, err := IdentityFromSecret(secret)
	if err != nil {
		return Identity{}, fmt.Errorf("secret key file %q: %w", path, err)
	}
	return id, nil
}

// Public is this engine's public key.
func (a *Authority) Public() Key { return a.self.Public }

// Identity is this engine's key pair.
func (a *Authority) Identity() Identity { return a.self }

// Allowed reports whether a peer holding the secret key of k may connect.
func (a *Authority) Allowed(k Key) bool {
	_, ok := (*a.allowed.Load())[k]
	return ok
}

// Len is the number of keys let in, our own included.
func (a *Authority) Len() int { return len(*a.allowed.Load()) }

// FindByPrefix returns the allowed key starting with prefix, when exactly
// one does. The control plane's greeting carries the first 31 bytes of the
// server's key, so a client with an allowlist knows which key to expect.
func (a *Authority) FindByPrefix(prefix []byte) (Key, bool) {
	var found Key
	n := 0
	for k := range *a.allowed.Load() {
		if bytes.HasPrefix(k[:], prefix) {
			found = k
			n++
		}
	}
	return found, n == 1
}

// Reload reads the allowlist file again and returns the keys that were
// allowed and no longer are. On error the allowlist in force is unchanged.
// Callers cut the removed peers' connections themselves.
func (a *Authority) Reload() (removed []Key, err error) {
	if a.allowFile == "" {
		return nil, ErrNoAllowlist
	}
	a.reloadMu.Lock()
	defer a.reloadMu.Unlock()
	set, err := readAllowlist(a.allowFile)
	if err != nil {
		return nil, fmt.Errorf("allowlist file %q: %w", a.allowFile, err)
	}
	set[a.self.Public] = struct{}{}
	if old := a.allowed.Load(); old != nil {
		for k := range *old {
			if _, ok := set[k]; !ok {
				removed = append(removed, k)
			}
		}
	}
	a.allowed.Store(&set)
	return removed, nil
}

// DataKey is the key both ends of a tcp data connection derive from their
// static keys (X25519 of our secret and the peer's public key), for label.
// A peer's key of low order, which would give a predictable secret, is
// refused.
func (a *Authority) DataKey(peer Key, label string) (Key, error) {
	priv, err := ecdh.X25519().NewPrivateKey(a.self.Secret[:])
	if err != nil {
		return Key{}, fmt.Errorf("%w: %v", ErrBadKey, err)
	}
	pub, err := ecdh.X25519().NewPublicKey(peer[:])
	if err != nil {
		return Key{}, fmt.Errorf("%w: %v", ErrBadKey, err)
	}
	shared, err := priv.ECDH(pub)
	if err != nil {
		return Key{}, fmt.Errorf("%w: %v", ErrBadKey, err)
	}
	m := hmac.New(sha256.New, shared)
	m.Write([]byte("kvferry data key v1\x00"))
	m.Write([]byte(label))
	var k Key
	copy(k[:], m.Sum(nil))
	return k, nil
}

// readPrivateFile reads a file that holds a secret, refusing one that group
// or others may read (as ssh does with private keys).
func readPrivateFile(path, what string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("%w: %s file: %v", ErrConfig, what, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("%w: %s file %q: %v", ErrConfig, what, path, err)
	}
	if st.Mode().Perm()&0o077 != 0 {
		return nil, fmt.Errorf("%w: %s file %q is readable by others (mode %#o); chmod 600 it", ErrConfig, what, path, st.Mode().Perm())
	}
	b, err := readLimited(f, 64<<10)
	if err != nil {
		return nil, fmt.Errorf("%w: %s file %q: %v", ErrConfig, what, path, err)
	}
	return b, nil
}

func readLimited(f *os.File, limit int64) ([]byte, error) {
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > limit {
		return nil, fmt.Errorf("larger than %d bytes", limit)
	}
	return b, nil
}

// parseSecretKeyText reads a secret key file: 40 Z85 characters alone, or
// a czmq certificate with a `secret-key = "..."` line.
func parseSecretKeyText(text []byte) (Key, error) {
	s := strings.TrimSpace(string(text))
	if len(s) == 40 && !strings.ContainsAny(s, " \t\r\n") {
		return ParseKey(s)
	}
	sc := bufio.NewScanner(bytes.NewReader(text))
	for sc.Scan() {
		if value, ok := czmqProperty(sc.Text(), "secret-key"); ok {
			return ParseKey(value)
		}
	}
	return Key{}, fmt.Errorf("%w: want 40 Z85 characters or a czmq certificate's secret-key line", ErrBadKey)
}

// maxAllowlist bounds the keys an allowlist file may hold.
const maxAllowlist = 1 << 16

// readAllowlist reads an allowlist file: one Z85 public key per line, the
// rest of the line a label, '#' comments. A czmq public certificate's
// `public-key = "..."` line is read too.
func readAllowlist(path string) (map[Key]struct{}, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrConfig, err)
	}
	defer f.Close()
	text, err := readLimited(f, 8<<20)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrConfig, err)
	}
	set := map[Key]struct{}{}
	sc := bufio.NewScanner(bytes.NewReader(text))
	for lineNo := 1; sc.Scan(); lineNo++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		tok := strings.Fields(line)[0]
		if value, ok := czmqProperty(line, "public-key"); ok {
			tok = value
		} else if tok == "curve" || tok == "metadata" || strings.Contains(line, " = ") {
			continue // other lines of a czmq certificate
		}
		k, err := ParseKey(tok)
		if err != nil {
			return nil, fmt.Errorf("line %d: %w", lineNo, err)
		}
		if len(set) >= maxAllowlist {
			return nil, fmt.Errorf("%w: more than %d keys", ErrConfig, maxAllowlist)
		}
		set[k] = struct{}{}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrConfig, err)
	}
	return set, nil
}

// czmqProperty reads `name = "value"`, a line of a czmq certificate. Z85
// keys may hold '=', so the separator is " = ".
func czmqProperty(line, name string) (string, bool) {
	n, value, ok := strings.Cut(strings.TrimSpace(line), " = ")
	if !ok || strings.TrimSpace(n) != name {
		return "", false
	}
	return strings.Trim(strings.TrimSpace(value), `"`), true
}
