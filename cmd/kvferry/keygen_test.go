package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvferry/kvferry/engine/auth"
)

// keygen's pair is one an Authority accepts: its secret key file loads, and
// pubkey prints the same public key keygen did.
func TestKeygenMakesAPairThatPubkeyAndAnAuthorityAccept(t *testing.T) {
	dir := t.TempDir()
	secret := filepath.Join(dir, "engine.key")
	var out bytes.Buffer
	if err := runKeygen(&out, []string{"--secret", secret}); err != nil {
		t.Fatal(err)
	}
	pub := strings.TrimSpace(out.String())
	if _, err := auth.ParseKey(pub); err != nil {
		t.Fatalf("keygen printed %q: %v", pub, err)
	}
	st, err := os.Stat(secret)
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("secret key file: %v, mode %v", err, st.Mode())
	}
	out.Reset()
	if err := runPubkey(&out, []string{"--secret", secret}); err != nil || strings.TrimSpace(out.String()) != pub {
		t.Fatalf("pubkey = %q, %v; keygen said %s", out.String(), err, pub)
	}
	allow := filepath.Join(dir, "allowed")
	if err := os.WriteFile(allow, []byte(pub+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	a, err := auth.New(auth.Config{SecretKeyFile: secret, AllowlistFile: allow})
	if err != nil || a.Public().String() != pub {
		t.Fatalf("auth.New: %v", err)
	}
	if err := runKeygen(&out, []string{"--secret", secret}); err == nil {
		t.Fatal("keygen overwrote an existing secret key file")
	}
}
