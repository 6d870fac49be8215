package engine_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/engine/control"
	"github.com/kvferry/kvferry/engine/metadata"
	"github.com/kvferry/kvferry/engine/metadata/etcdtest"
)

// storeEntry reads name's entry straight from the store.
func storeEntry(t *testing.T, srv *etcdtest.Server, prefix, name string) (*control.Descriptor, error) {
	t.Helper()
	cfg, err := metadata.ParseURL(srv.URL(prefix))
	if err != nil {
		t.Fatal(err)
	}
	st, err := metadata.Open(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return st.Resolve(ctx, name)
}

// waitStore waits, up to 20 s, for name's entry to satisfy ok.
func waitStore(t *testing.T, srv *etcdtest.Server, prefix, name, what string, ok func(*control.Descriptor, error) bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		d, err := storeEntry(t, srv, prefix, name)
		if ok(d, err) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: entry of %s never did (last: %+v, %v)", what, name, d, err)
		}
		time.Sleep(20 * time.Millisecond) // polling the store: the condition itself is awaited
	}
}

func TestEnginesSharingOnlyAnEtcdStoreFindEachOtherAndMoveData(t *testing.T) {
	srv := etcdtest.Start(t)
	url := srv.URL("pair")
	owner := newEngineWith(t, engine.Options{Metadata: url})
	init := newEngineWith(t, engine.Options{Metadata: url})
	// Registered after New: the entry is written again.
	dst := alloc(t, owner, 4<<20)
	waitStore(t, srv, "pair", owner.Name(), "registration published", func(d *control.Descriptor, err error) bool {
		return err == nil && len(d.Buffers) == 1 && d.Buffers[0].Addr == engine.AddrOf(dst)
	})
	seg := openSegment(t, init, owner.Name())
	src := alloc(t, init, 4<<20)
	fillPattern(src, 1)
	transfer(t, init, 10*time.Second, write(src, seg, engine.AddrOf(dst), len(src)))
	requireEqual(t, "written through a segment found in the store", dst, src)

	// A segment under another prefix is not found, though it listens: the
	// name is resolved through the store, not asked of the peer.
	other := newEngineWith(t, engine.Options{Metadata: srv.URL("elsewhere")})
	_, err := init.OpenSegment(testCtx(t, 5*time.Second), other.Name())
	if !errors.Is(err, engine.ErrSegmentUnknown) || !errors.Is(err, metadata.ErrNotPublished) {
		t.Fatalf("open a segment published under another prefix: %v; want ErrSegmentUnknown and ErrNotPublished", err)
	}

	// An engine that closes takes its entry with it at once.
	name := owner.Name()
	if err := owner.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := storeEntry(t, srv, "pair", name); !errors.Is(err, metadata.ErrNotPublished) {
		t.Fatalf("entry of a closed engine: %v; want ErrNotPublished", err)
	}
}

func TestResolvedPeersKeepMovingDataWhileTheEtcdStoreIsDown(t *testing.T) {
	srv := etcdtest.Start(t)
	url := srv.URL("outage")
	owner := newEngineWith(t, engine.Options{Metadata: url})
	init := newEngineWith(t, engine.Options{Metadata: url})
	late := newEngineWith(t, engine.Options{Metadata: url})
	dst := alloc(t, owner, 1<<20)
	waitStore(t, srv, "outage", owner.Name(), "registration published", func(d *control.Descriptor, err error) bool {
		return err == nil && len(d.Buffers) == 1
	})
	seg := openSegment(t, init, owner.Name())
	src := alloc(t, init, 1<<20)
	fillPattern(src, 2)
	transfer(t, init, 10*time.Second, write(src, seg, engine.AddrOf(dst), len(src)))

	srv.Kill()
	// Data keeps moving to the resolved peer, memory it registers while
	// the store is away included (the peer itself is asked).
	fillPattern(src, 3)
	transfer(t, init, 10*time.Second, write(src, seg, engine.AddrOf(dst), len(src)))
	requireEqual(t, "written while the store is down", dst, src)
	more := alloc(t, owner, 1<<20)
	transfer(t, init, 10*time.Second, write(src, seg, engine.AddrOf(more), len(src)))
	requireEqual(t, "written to memory registered while the store is down", more, src)

	// A new resolution fails by its deadline, saying why.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	_, err := init.OpenSegment(ctx, late.Name())
	cancel()
	if !errors.Is(err, engine.ErrSegmentUnknown) || !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "metadata store") {
		t.Fatalf("open a new segment while the store is down: %v; want ErrSegmentUnknown, DeadlineExceeded and the store named", err)
	}

	// The store comes back: resolutions work again, without a restart of
	// the engines.
	srv.Restart()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		seg2, err := init.OpenSegment(ctx, late.Name())
		cancel()
		if err == nil {
			buf := alloc(t, late, 1<<20)
			// Its registration reached the peer (the store may
			// lag it; the peer is asked when the range is missing).
			transfer(t, init, 10*time.Second, write(src, seg2, engine.AddrOf(buf), len(src)))
			requireEqual(t, "written to a peer found after the store came back", buf, src)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("store back, but the segment is still not found: %v", err)
		}
	}
}

func TestNewFailsClearlyWithoutItsEtcdStore(t *testing.T) {
	// A port nothing listens on: the store never answers.
	srv := etcdtest.Start(t)
	url := srv.URL("gone")
	srv.Kill()
	_, err := engine.New(engine.Options{IgnoreEnv: true, Protocol: "tcp", Metadata: url, DefaultTimeout: time.Second})
	if err == nil || !strings.Contains(err.Error(), srv.Endpoint()) {
		t.Fatalf("New with its store down: %v; want an error naming the store", err)
	}
}

func TestMetadataOptionIsValidated(t *testing.T) {
	for _, bad := range []string{"redis://127.0.0.1:6379", "http://127.0.0.1:8080/metadata", "etcd://", "etcd://nohost", "etcd://h:1/pre fix"} {
		if _, err := engine.New(engine.Options{IgnoreEnv: true, Protocol: "tcp", Metadata: bad}); !errors.Is(err, engine.ErrInvalidArg) {
			t.Errorf("Metadata %q: %v; want ErrInvalidArg", bad, err)
		}
	}
}
