// Package authtest makes identities, key files and Authorities for tests.
package authtest

import (
	"crypto/rand"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvferry/kvferry/engine/auth"
)

// NewIdentity returns a fresh key pair.
func NewIdentity(t testing.TB) auth.Identity {
	t.Helper()
	var sk auth.Key
	if _, err := rand.Read(sk[:]); err != nil {
		t.Fatal(err)
	}
	id, err := auth.IdentityFromSecret(sk)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// KeyFiles writes id's secret key file (mode 0600) and an allowlist of
// allowed into a new directory and returns their paths.
func KeyFiles(t testing.TB, id auth.Identity, allowed ...auth.Key) (secret, allowlist string) {
	t.Helper()
	dir := t.TempDir()
	secret, allowlist = filepath.Join(dir, "secret.key"), filepath.Join(dir, "allowed.keys")
	if err := os.WriteFile(secret, []byte(id.Secret.String()+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	WriteAllowlist(t, allowlist, allowed...)
	return secret, allowlist
}

// WriteAllowlist writes keys to path as an allowlist, each with a label.
func WriteAllowlist(t testing.TB, path string, keys ...auth.Key) {
	t.Helper()
	var sb strings.Builder
	for _, k := range keys {
		sb.WriteString(k.String() + " peer\n")
	}
	if err := os.WriteFile(path, []byte(sb.String()), 0o600); err != nil {
		t.Fatal(err)
	}
}

// New builds the Authority of id allowing allowed (and itself), from key
// files it writes, and returns it with its allowlist's path (to rewrite and
// reload).
func New(t testing.TB, id auth.Identity, allowed ...auth.Key) (*auth.Authority, string) {
	t.Helper()
	secret, allowlist := KeyFiles(t, id, allowed...)
	a, err := auth.New(auth.Config{SecretKeyFile: secret, AllowlistFile: allowlist})
	if err != nil {
		t.Fatalf("auth.New: %v", err)
	}
	return a, allowlist
}

// Authority is New without the allowlist's path.
func Authority(t testing.TB, id auth.Identity, allowed ...auth.Key) *auth.Authority {
	t.Helper()
	a, _ := New(t, id, allowed...)
	return a
}
