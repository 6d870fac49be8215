package main

import (
	"crypto/rand"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/kvferry/kvferry/engine/auth"
)

// runKeygen writes a new CURVE key pair: the secret key to secretPath
// (mode 0600, never over an existing file) and the public key to
// publicPath, or to w when publicPath is empty.
func runKeygen(w io.Writer, args []string) error {
	fs := flag.NewFlagSet("keygen", flag.ContinueOnError)
	secretPath := fs.String("secret", "", "file to write the secret key to (created with mode 0600; must not exist)")
	publicPath := fs.String("public", "", "file to write the public key to (default: standard output)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *secretPath == "" {
		return errors.New("keygen: --secret FILE is required")
	}
	var sk auth.Key
	if _, err := rand.Read(sk[:]); err != nil {
		return fmt.Errorf("keygen: %w", err)
	}
	id, err := auth.IdentityFromSecret(sk)
	if err != nil {
		return fmt.Errorf("keygen: %w", err)
	}
	f, err := os.OpenFile(*secretPath, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("keygen: secret key file: %w", err)
	}
	if _, err := fmt.Fprintln(f, id.Secret.String()); err != nil {
		f.Close()
		return fmt.Errorf("keygen: secret key file: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("keygen: secret key file: %w", err)
	}
	if *publicPath == "" {
		_, err = fmt.Fprintln(w, id.Public.String())
		return err
	}
	if err := os.WriteFile(*publicPath, []byte(id.Public.String()+"\n"), 0o644); err != nil {
		return fmt.Errorf("keygen: public key file: %w", err)
	}
	return nil
}

// runPubkey prints the public key of a secret key file, the line to add to
// peers' allowlists.
func runPubkey(w io.Writer, args []string) error {
	fs := flag.NewFlagSet("pubkey", flag.ContinueOnError)
	secretPath := fs.String("secret", "", "secret key file (Z85 or a czmq certificate)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *secretPath == "" {
		return errors.New("pubkey: --secret FILE is required")
	}
	id, err := auth.ReadSecretKeyFile(*secretPath)
	if err != nil {
		return fmt.Errorf("pubkey: %w", err)
	}
	_, err = fmt.Fprintln(w, id.Public.String())
	return err
}
