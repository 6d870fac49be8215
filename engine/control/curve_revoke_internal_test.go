package control

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvferry/kvferry/engine/auth"
	"github.com/kvferry/kvferry/engine/auth/authtest"
)

// A server whose key leaves our allowlist while our handshake with it is
// under way is not trusted when the handshake ends. Revoke skips
// connections whose handshake is not done (it cuts only open ones), so the
// session itself must check the server's key again when it opens: else an
// outbound connection that was mid-handshake when ReloadAllowlist returned
// opens afterwards and carries our queued messages to the removed peer,
// and its replies to our handlers.
func TestCurveClientRefusesAServerRemovedDuringTheHandshake(t *testing.T) {
	clientID, serverID := authtest.NewIdentity(t), authtest.NewIdentity(t)
	dir := t.TempDir()
	c := auth.Config{SecretKeyFile: filepath.Join(dir, "secret"), AllowlistFile: filepath.Join(dir, "allow")}
	if err := os.WriteFile(c.SecretKeyFile, []byte(clientID.Secret.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(c.AllowlistFile, []byte(serverID.Public.String()+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	ca, err := auth.New(c)
	if err != nil {
		t.Fatal(err)
	}
	cl, err := newCurveSession(ca, false)
	if err != nil {
		t.Fatal(err)
	}
	cl.identity = "client:1"
	srv, err := newCurveSession(authtest.Authority(t, serverID, clientID.Public), true)
	if err != nil {
		t.Fatal(err)
	}
	var toSrv, toCl []byte
	sendSrv := func(b []byte) { toSrv = append(toSrv, b...) }
	sendCl := func(b []byte) { toCl = append(toCl, b...) }
	noPlain := func([]byte) error { return nil }

	// The client reads the server's greeting (the server's key is allowed)
	// and says HELLO.
	if err := cl.feed(srv.greeting(), sendSrv, noPlain); err != nil {
		t.Fatalf("greeting: %v", err)
	}
	if cl.stage != curveWelcome {
		t.Fatalf("client stage %d after the greeting, want WELCOME", cl.stage)
	}

	// The allowlist is reloaded without the server's key.
	if err := os.WriteFile(c.AllowlistFile, []byte("# nobody\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if removed, err := ca.Reload(); err != nil || len(removed) != 1 {
		t.Fatalf("Reload = %v, %v", removed, err)
	}

	// The handshake goes on.
	var errCl error
	for i := 0; i < 8 && (len(toSrv) > 0 || len(toCl) > 0) && errCl == nil; i++ {
		in := append(cl.greeting(), toSrv...)
		if i > 0 {
			in = toSrv
		}
		toSrv = nil
		if err := srv.feed(in, sendCl, noPlain); err != nil {
			t.Fatalf("server: %v", err)
		}
		in, toCl = toCl, nil
		errCl = cl.feed(in, sendSrv, noPlain)
	}
	var r *curveRefusal
	if cl.stage == curveOpen || !errors.As(errCl, &r) || !errors.Is(errCl, ErrUnauthenticated) {
		t.Fatalf("client stage %d, err %v: it opened to a server whose key left the allowlist", cl.stage, errCl)
	}
}
