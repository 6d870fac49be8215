package engine_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/engine/auth"
	"github.com/kvferry/kvferry/engine/auth/authtest"
	"github.com/kvferry/kvferry/internal/childproc"
	"github.com/kvferry/kvferry/internal/fakeverbs"
)

// authEngine is a tcp engine that authenticates as id and lets allowed in;
// with a nil id it does not authenticate.
func authEngine(t testing.TB, id *auth.Identity, allowed ...auth.Key) (*engine.Engine, string) {
	t.Helper()
	opts := engine.Options{}
	var allow string
	if id != nil {
		opts.SecretKeyFile, allow = authtest.KeyFiles(t, *id, allowed...)
		opts.AllowlistFile = allow
	}
	return newEngineWith(t, opts), allow
}

// recordHandshake makes, as the holder of id's secret key, a data-connection
// handshake with the owner's data port that the owner accepts, and writes
// the bytes it sent to a file for the attacker: what an eavesdropper
// recorded off the wire.
func recordHandshake(t *testing.T, id auth.Identity, ownerKey auth.Key, dataAddr, name string) string {
	t.Helper()
	secret, allow := authtest.KeyFiles(t, id, ownerKey)
	a, err := auth.New(auth.Config{SecretKeyFile: secret, AllowlistFile: allow})
	if err != nil {
		t.Fatal(err)
	}
	rec, err := authedHandshake(a, dataAddr, name)
	if err != nil {
		t.Fatalf("record a handshake: %v", err)
	}
	path := filepath.Join(t.TempDir(), "handshake.bin")
	if err := os.WriteFile(path, rec, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// runAttack starts the attacker process with plan and returns its verdicts
// by step.
func runAttack(t *testing.T, plan attackPlan) map[string]string {
	t.Helper()
	b, err := json.Marshal(plan)
	if err != nil {
		t.Fatal(err)
	}
	verdicts := map[string]string{}
	var mu sync.Mutex
	proc := childproc.Start(t, childproc.Config{Name: "attacker", KillWithParent: true,
		Env: []string{helperEnv + "=auth-attacker", attackEnv + "=" + string(b)},
		OnLine: func(line string) {
			if f := strings.Fields(line); len(f) == 3 && f[0] == "result" {
				mu.Lock()
				verdicts[f[1]] = f[2]
				mu.Unlock()
			}
		}})
	first := proc.First(t, 120*time.Second)
	if err := proc.Finish(t, 300*time.Second); err != nil {
		t.Fatalf("attacker failed: %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if f := strings.Fields(first); len(f) == 3 && f[0] == "result" {
		verdicts[f[1]] = f[2]
	}
	t.Logf("attacker: %v", verdicts)
	return verdicts
}

// victim is the engine under attack (owner) and the legitimate peer it
// serves, with a guarded buffer the attacker goes for and a grant to the
// peer.
type victim struct {
	owner, peer *engine.Engine
	target      *guarded
	src, dst    []byte // the peer's legitimate traffic: its buffer, and the owner's other one
	seg         *engine.Segment
	plan        attackPlan
	ownerID     auth.Identity
	peerID      auth.Identity
}

const attackBufSize = 64 << 10

// newVictim starts the owner and its peer: authenticating (each allowing
// the other) when on.
func newVictim(t *testing.T, on bool) *victim {
	t.Helper()
	v := &victim{ownerID: authtest.NewIdentity(t), peerID: authtest.NewIdentity(t)}
	if on {
		v.owner, _ = authEngine(t, &v.ownerID, v.peerID.Public)
		v.peer, _ = authEngine(t, &v.peerID, v.ownerID.Public)
	} else {
		v.owner, _ = authEngine(t, nil)
		v.peer, _ = authEngine(t, nil)
	}
	v.target = newGuarded(t, v.owner, attackBufSize, 7)
	g, err := v.owner.Grant(v.peer.Name(), 41, []engine.GrantRange{{Addr: engine.AddrOf(v.target.mid) + 256, Len: 256}})
	if err != nil {
		t.Fatal(err)
	}
	var key uint64
	for _, b := range v.owner.Descriptor().Buffers {
		if b.Addr == engine.AddrOf(v.target.mid) {
			key = b.Key
		}
	}
	v.plan = attackPlan{
		Target: v.owner.Name(), DataAddr: v.owner.Descriptor().Transports[0].Addr,
		// The attacker's best guess: the buffer's very address and key.
		Buffer: engine.AddrOf(v.target.mid), Key: key, Len: attackBufSize, Seed: 7,
		Grantee: v.peer.Name(), GrantRID: 41, GrantID: g.ID, GrantGen: g.Generation,
		Peer: v.peer.Name(), AbortRID: 42,
	}
	return v
}

// peerWrites has the legitimate peer write to the owner's other buffer
// under request id rid and returns the task's result.
func (v *victim) peerWrites(t *testing.T, rid uint64) engine.TaskResult {
	t.Helper()
	if v.src == nil {
		v.dst, v.src = alloc(t, v.owner, 4<<20), alloc(t, v.peer, 4<<20)
		v.seg = openSegment(t, v.peer, v.owner.Name())
	}
	fillPattern(v.src, rid)
	req := withRID(write(v.src, v.seg, engine.AddrOf(v.dst), len(v.src)), rid, 0)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res, err := v.peer.Transfer(ctx, []engine.Request{req})
	if len(res) != 1 {
		t.Errorf("the peer's transfer: %v", err)
		return engine.TaskResult{Err: err}
	}
	if res[0].Status == engine.Completed && string(v.dst) != string(v.src) {
		t.Errorf("the peer's write of request %d did not land whole", rid)
	}
	return res[0]
}

// An attacker process on the same host that knows the ports and the
// buffer's address and key reads and writes the owner's memory, writes
// under a grant by claiming the grantee's name, and aborts the peer's
// request by claiming the owner's name, when authentication is off. With
// it on, with no key, a key the owner does not allow, the peer's public
// key without its secret, or the peer's recorded handshake replayed, it
// gets no descriptor, reads and writes nothing (guards included), claims
// nothing and aborts nothing; the peer goes on.
func TestAnAttackerProcessIsShutOutByAuthenticationAndNotWithoutIt(t *testing.T) {
	t.Run("off", func(t *testing.T) {
		v := newVictim(t, false)
		verdicts := runAttack(t, v.plan)
		want := map[string]string{"descriptor": "fetched", "write": "acked", "read": "got-secret", "claim": "acked", "abort": "sent"}
		for step, w := range want {
			if verdicts[step] != w {
				t.Errorf("without authentication, %s: %q, want %q (the attack should work)", step, verdicts[step], w)
			}
		}
		// The owner counts the bytes it applied after copying them: an
		// atomic that orders the copy before the check below.
		if v.owner.Stats().OwnerBytesIn == 0 || v.target.mid[128] != attackByte {
			t.Error("without authentication the attacker's write did not land")
		}
		if r := v.peerWrites(t, 42); r.Status != engine.Aborted {
			t.Errorf("without authentication the spoofed ABORT did not abort the peer's request: %v %v", r.Status, r.Err)
		}
	})
	for _, creds := range []string{"no key", "a key the owner does not allow", "the peer's key without its secret", "the peer's handshake replayed"} {
		t.Run("on/"+creds, func(t *testing.T) {
			v := newVictim(t, true)
			plan := v.plan
			switch creds {
			case "a key the owner does not allow":
				plan.SecretKeyFile, plan.AllowlistFile = authtest.KeyFiles(t, authtest.NewIdentity(t), v.ownerID.Public)
			case "the peer's key without its secret":
				plan.ForgeKey = v.peerID.Public.String()
			case "the peer's handshake replayed":
				plan.ReplayFile = recordHandshake(t, v.peerID, v.ownerID.Public, plan.DataAddr, v.peer.Name())
			}
			verdicts := runAttack(t, plan)
			steps := []string{"descriptor", "write", "write-outside", "read", "claim", "abort"}
			switch creds {
			case "a key the owner does not allow":
				steps = append(steps, "own-key")
			case "the peer's key without its secret":
				steps = append(steps, "forge")
			case "the peer's handshake replayed":
				steps = append(steps, "replay")
			}
			for _, step := range steps {
				if verdicts[step] != "refused" {
					t.Errorf("%s: %q, want refused", step, verdicts[step])
				}
			}
			v.target.check(t, "after the attack", pattern(attackBufSize, 7))
			if r := v.peerWrites(t, 42); r.Status != engine.Completed {
				t.Errorf("the peer's request after the attack: %v %v", r.Status, r.Err)
			}
			if n := v.peer.Stats().AbortsReceived; n != 0 {
				t.Errorf("the peer took %d ABORTs", n)
			}
			if v.owner.Stats().AuthRefused == 0 {
				t.Error("the owner counted no refusal")
			}
		})
	}
}

// A peer whose key is removed from the allowlist while it is connected is
// cut by ReloadAllowlist, over tcp and over rdma (its responder QPs
// destroyed): its next write fails and lands nothing, its key cannot open
// the segment again, and the other peer goes on.
func TestAPeerWhoseKeyIsRemovedAtRunTimeIsCutAndRefused(t *testing.T) {
	for _, proto := range []string{"tcp", "rdma"} {
		t.Run(proto, func(t *testing.T) { testPeerKeyRemoved(t, proto) })
	}
}

func testPeerKeyRemoved(t *testing.T, proto string) {
	opts := func(secret, allow string) engine.Options {
		o := engine.Options{Protocol: proto, SecretKeyFile: secret, AllowlistFile: allow}
		if proto == "rdma" {
			o.RDMALibrary = fakeverbs.Path(t)
		}
		return o
	}
	ownerID, aID, bID := authtest.NewIdentity(t), authtest.NewIdentity(t), authtest.NewIdentity(t)
	oSecret, allow := authtest.KeyFiles(t, ownerID, aID.Public, bID.Public)
	owner := newEngineWith(t, opts(oSecret, allow))
	aSecret, aAllow := authtest.KeyFiles(t, aID, ownerID.Public)
	a := newEngineWith(t, opts(aSecret, aAllow))
	b := newEngineWith(t, opts(authtest.KeyFiles(t, bID, ownerID.Public)))
	dst := newGuarded(t, owner, 4<<20, 3)
	remote := engine.AddrOf(dst.mid)
	srcA, srcB := alloc(t, a, 4<<20), alloc(t, b, 4<<20)
	fillPattern(srcA, 5)
	fillPattern(srcB, 6)
	segA, segB := openSegment(t, a, owner.Name()), openSegment(t, b, owner.Name())
	// Every path of a is up, so its writes after the reload go over
	// connections made while it was allowed.
	warmPaths(t, a, segA, srcA, remote)
	transfer(t, b, 30*time.Second, write(srcB[:4096], segB, remote+4096, 4096))

	if err := os.WriteFile(allow, []byte(bID.Public.String()+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := owner.ReloadAllowlist(testCtx(t, 10*time.Second)); err != nil {
		t.Fatalf("ReloadAllowlist: %v", err)
	}
	want := append([]byte(nil), dst.mid...)
	res, err := a.Transfer(testCtx(t, 30*time.Second), []engine.Request{write(srcA, segA, remote, len(srcA))})
	if err == nil && res[0].Status == engine.Completed {
		t.Fatal("the removed peer's write completed")
	}
	dst.check(t, "after the removed peer's write", want)
	// The same key in a new engine: refused in the handshake.
	again := newEngineWith(t, opts(aSecret, aAllow))
	if _, err := again.OpenSegment(testCtx(t, 10*time.Second), owner.Name()); !errors.Is(err, engine.ErrUnauthenticated) {
		t.Fatalf("the removed peer's key opened the segment again: %v", err)
	}
	transfer(t, b, 30*time.Second, write(srcB, segB, remote, len(srcB)))
	if owner.Stats().AuthRefused == 0 {
		t.Error("the cut was not counted")
	}
	if err := a.ReloadAllowlist(testCtx(t, time.Second)); err != nil {
		t.Errorf("reloading an unchanged allowlist: %v", err)
	}
	off, _ := authEngine(t, nil)
	if err := off.ReloadAllowlist(testCtx(t, time.Second)); !errors.Is(err, engine.ErrInvalidArg) {
		t.Errorf("ReloadAllowlist without authentication: %v, want ErrInvalidArg", err)
	}
}

// Ten thousand control and ten thousand data connection attempts without
// an allowed key leave the owner with nothing held for them: every one is
// refused and counted, its connections and buffers return to what the
// legitimate peer holds, its goroutines to their number before, and the
// peer's transfers run throughout.
func TestTenThousandUnauthenticatedAttemptsLeaveTheOwnerBoundedAndServing(t *testing.T) {
	if testing.Short() {
		t.Skip("20,000 connections: not in -short")
	}
	v := newVictim(t, true)
	if r := v.peerWrites(t, 1); r.Status != engine.Completed {
		t.Fatalf("before: %v %v", r.Status, r.Err)
	}
	// Every path of the peer dialed, so the goroutines counted before are
	// those the peer's traffic needs.
	warmPaths(t, v.peer, v.seg, v.src, engine.AddrOf(v.dst))
	runtime.GC()
	var before runtime.MemStats
	runtime.ReadMemStats(&before)
	goroutines := runtime.NumGoroutine()
	stop := make(chan struct{})
	var served sync.WaitGroup
	served.Add(1)
	var rounds int
	go func() {
		defer served.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			if r := v.peerWrites(t, uint64(100+rounds)); r.Status != engine.Completed {
				t.Errorf("the peer's transfer during the flood: %v %v", r.Status, r.Err)
				return
			}
			rounds++
		}
	}()
	plan := v.plan
	plan.Flood = 10000
	verdicts := runAttack(t, plan)
	close(stop)
	served.Wait()
	if verdicts["flood"] != "done" {
		t.Fatalf("flood: %q", verdicts["flood"])
	}
	if rounds == 0 {
		t.Error("the peer moved nothing during the flood")
	}
	st := v.owner.Stats()
	if st.AuthRefused < 20000 {
		t.Errorf("AuthRefused = %d, want every one of the 20000 attempts", st.AuthRefused)
	}
	var last string
	defer func() {
		if t.Failed() && last != "" {
			t.Logf("last seen: %s", last)
		}
	}()
	waitFor(t, 30*time.Second, "the refused connections to be gone", func() bool {
		s := v.owner.Stats()
		n := runtime.NumGoroutine()
		last = fmt.Sprintf("control connections %d (want <= 1), data connections %d (want <= %d), goroutines %d (were %d)",
			s.ControlConns, s.DataConns, engine.DefaultPathsPerPeer, n, goroutines)
		return s.ControlConns <= 1 && s.DataConns <= int64(engine.DefaultPathsPerPeer) && n <= goroutines+8
	})
	runtime.GC()
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	if grew := int64(after.HeapInuse) - int64(before.HeapInuse); grew > 64<<20 {
		t.Errorf("heap in use grew by %d MiB over the flood", grew>>20)
	}
	v.target.check(t, "after the flood", pattern(attackBufSize, 7))
	t.Logf("peer transfers during the flood: %d; owner stats: AuthRefused %d, ControlConns %d, DataConns %d", rounds, st.AuthRefused, st.ControlConns, st.DataConns)
}
