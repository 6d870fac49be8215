package auth_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvferry/kvferry/engine/auth"
)

// RFC 32's test vector.
func TestZ85MatchesTheSpecificationsExample(t *testing.T) {
	in := []byte{0x86, 0x4F, 0xD2, 0x6F, 0xB5, 0x59, 0xF7, 0x5B}
	if got := auth.Z85Encode(in); got != "HelloWorld" {
		t.Fatalf("Z85Encode = %q, want HelloWorld", got)
	}
	back, err := auth.Z85Decode("HelloWorld")
	if err != nil || string(back) != string(in) {
		t.Fatalf("Z85Decode = %x, %v", back, err)
	}
	for _, bad := range []string{"Hell", "Hello Worl", "#####", "HelloWorl\x00"} {
		if _, err := auth.Z85Decode(bad); !errors.Is(err, auth.ErrBadKey) {
			t.Errorf("Z85Decode(%q) = %v, want ErrBadKey", bad, err)
		}
	}
}

// Keys made by libzmq read back as the same pair, so users may make keys
// with ZeroMQ's own tools.
func TestKeysFromLibzmqAgreeWithOurs(t *testing.T) {
	pub, sec, err := zmq.NewCurveKeypair()
	if err != nil {
		t.Skipf("libzmq without CURVE: %v", err)
	}
	sk, err := auth.ParseKey(sec)
	if err != nil {
		t.Fatal(err)
	}
	id, err := auth.IdentityFromSecret(sk)
	if err != nil {
		t.Fatal(err)
	}
	if id.Public.String() != pub {
		t.Fatalf("public key %s, libzmq says %s", id.Public, pub)
	}
}

func writeFile(t *testing.T, name, text string, mode os.FileMode) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(text), mode); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestAllowlistReloadReportsRemovedKeys(t *testing.T) {
	pubA, secA, _ := zmq.NewCurveKeypair()
	pubB, _, _ := zmq.NewCurveKeypair()
	pubC, _, _ := zmq.NewCurveKeypair()
	if pubA == "" {
		t.Skip("libzmq without CURVE")
	}
	secFile := writeFile(t, "a.key", secA+"\n", 0o600)
	allow := writeFile(t, "allow", "# cluster\n"+pubB+" decode-1\n"+pubC+"\n", 0o644)
	a, err := auth.New(auth.Config{SecretKeyFile: secFile, AllowlistFile: allow})
	if err != nil {
		t.Fatal(err)
	}
	kA, _ := auth.ParseKey(pubA)
	kB, _ := auth.ParseKey(pubB)
	kC, _ := auth.ParseKey(pubC)
	if !a.Allowed(kA) || !a.Allowed(kB) || !a.Allowed(kC) {
		t.Fatal("own key and listed keys must be allowed")
	}
	if err := os.WriteFile(allow, []byte(pubB+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	removed, err := a.Reload()
	if err != nil {
		t.Fatal(err)
	}
	if len(removed) != 1 || removed[0] != kC || a.Allowed(kC) || !a.Allowed(kB) {
		t.Fatalf("removed %v; allowed C=%v B=%v", removed, a.Allowed(kC), a.Allowed(kB))
	}
	// A broken file leaves the list in force.
	if err := os.WriteFile(allow, []byte("not-a-key\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Reload(); err == nil || !a.Allowed(kB) {
		t.Fatalf("Reload of a broken file: %v; B allowed %v", err, a.Allowed(kB))
	}
}

func TestSecretFilesReadableByOthersAreRefused(t *testing.T) {
	_, sec, _ := zmq.NewCurveKeypair()
	if sec == "" {
		t.Skip("libzmq without CURVE")
	}
	secFile := writeFile(t, "a.key", sec, 0o644)
	allow := writeFile(t, "allow", "", 0o644)
	if _, err := auth.New(auth.Config{SecretKeyFile: secFile, AllowlistFile: allow}); !errors.Is(err, auth.ErrConfig) || !strings.Contains(err.Error(), "chmod 600") {
		t.Fatalf("New = %v, want ErrConfig naming chmod 600", err)
	}
	cs := writeFile(t, "cluster", "0123456789abcdef0123", 0o640)
	if _, err := auth.New(auth.Config{ClusterSecretFile: cs}); !errors.Is(err, auth.ErrConfig) {
		t.Fatalf("New = %v, want ErrConfig", err)
	}
}

func TestClusterSecretGivesEveryEngineTheSameKey(t *testing.T) {
	cs := writeFile(t, "cluster", "a shared secret of the cluster\n", 0o600)
	a, err := auth.New(auth.Config{ClusterSecretFile: cs})
	if err != nil {
		t.Fatal(err)
	}
	b, err := auth.New(auth.Config{ClusterSecretFile: cs})
	if err != nil {
		t.Fatal(err)
	}
	if a.Public() != b.Public() || !a.Allowed(b.Public()) || a.Len() != 1 {
		t.Fatal("engines of one cluster secret must share one allowed key")
	}
	if _, err := a.Reload(); !errors.Is(err, auth.ErrNoAllowlist) {
		t.Fatalf("Reload = %v, want ErrNoAllowlist", err)
	}
	short := writeFile(t, "short", "tooshort", 0o600)
	if _, err := auth.New(auth.Config{ClusterSecretFile: short}); !errors.Is(err, auth.ErrConfig) {
		t.Fatalf("short secret: %v, want ErrConfig", err)
	}
}

func TestDataKeyIsTheSameFromBothEnds(t *testing.T) {
	_, secA, _ := zmq.NewCurveKeypair()
	_, secB, _ := zmq.NewCurveKeypair()
	if secA == "" {
		t.Skip("libzmq without CURVE")
	}
	mk := func(sec string) *auth.Authority {
		a, err := auth.New(auth.Config{SecretKeyFile: writeFile(t, "k", sec, 0o600), AllowlistFile: writeFile(t, "l", "", 0o644)})
		if err != nil {
			t.Fatal(err)
		}
		return a
	}
	a, b := mk(secA), mk(secB)
	ka, err := a.DataKey(b.Public(), "tcp")
	if err != nil {
		t.Fatal(err)
	}
	kb, err := b.DataKey(a.Public(), "tcp")
	if err != nil || ka != kb {
		t.Fatalf("keys differ: %v", err)
	}
	if _, err := a.DataKey(auth.Key{}, "tcp"); !errors.Is(err, auth.ErrBadKey) {
		t.Fatalf("DataKey of the zero point = %v, want ErrBadKey", err)
	}
}

func FuzzParseKey(f *testing.F) {
	f.Add("HelloWorldHelloWorldHelloWorldHelloWorld")
	f.Add("")
	f.Fuzz(func(t *testing.T, s string) {
		k, err := auth.ParseKey(s)
		if err == nil && k.String() != strings.TrimSpace(s) {
			t.Fatalf("round trip %q -> %q", s, k.String())
		}
	})
}

func TestCzmqCertificatesAreRead(t *testing.T) {
	pub, sec, _ := zmq.NewCurveKeypair()
	if sec == "" {
		t.Skip("libzmq without CURVE")
	}
	cert := "#   ZeroMQ CURVE **Secret** Certificate\n\nmetadata\ncurve\n    public-key = \"" + pub + "\"\n    secret-key = \"" + sec + "\"\n"
	a, err := auth.New(auth.Config{SecretKeyFile: writeFile(t, "k", cert, 0o600),
		AllowlistFile: writeFile(t, "l", "metadata\ncurve\n    public-key = \""+pub+"\"\n", 0o644)})
	if err != nil {
		t.Fatal(err)
	}
	if a.Public().String() != pub || a.Len() != 1 {
		t.Fatalf("public %s (want %s), %d keys", a.Public(), pub, a.Len())
	}
}
