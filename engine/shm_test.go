package engine_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvferry/kvferry/engine"
	"github.com/kvferry/kvferry/engine/control"
)

// logLines is a slog handler that keeps the messages and attributes it is
// given, one line each, for tests that check what the engine says.
type logLines struct {
	mu    sync.Mutex
	lines []string
}

func (l *logLines) Enabled(context.Context, slog.Level) bool { return true }
func (l *logLines) Handle(_ context.Context, r slog.Record) error {
	var b strings.Builder
	b.WriteString(r.Message)
	r.Attrs(func(a slog.Attr) bool {
		b.WriteString(" " + a.Key + "=" + a.Value.String())
		return true
	})
	l.mu.Lock()
	l.lines = append(l.lines, b.String())
	l.mu.Unlock()
	return nil
}
func (l *logLines) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logLines) WithGroup(string) slog.Handler      { return l }

// find returns the first line holding every one of parts.
func (l *logLines) find(parts ...string) (string, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, line := range l.lines {
		ok := true
		for _, p := range parts {
			ok = ok && strings.Contains(line, p)
		}
		if ok {
			return line, true
		}
	}
	return "", false
}

// privateBuffer maps n bytes of private memory (not from AllocBuffer) and
// registers it at e: memory a same-host owner reaches by cross-memory
// attach only.
func privateBuffer(t *testing.T, e *engine.Engine, n int) []byte {
	t.Helper()
	mem, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.RegisterMemory(mem, "cpu"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = e.UnregisterMemory(engine.AddrOf(mem))
		_ = unix.Munmap(mem)
	})
	return mem
}

// TestSameHostPeersTalkOverSHM: two engines of this host with the default
// protocol choose shm, say so in the log, and move engine buffers (through
// views of them) and other memory (by cross-memory attach) both ways, byte
// for byte.
func TestSameHostPeersTalkOverSHM(t *testing.T) {
	logs := &logLines{}
	owner := newEngineWith(t, engine.Options{Protocol: "auto"})
	init := newEngineWith(t, engine.Options{Protocol: "auto", Logger: slog.New(logs)})
	const n = 8 << 20
	dst := alloc(t, owner, n)
	seg := openSegment(t, init, owner.Name())
	for _, kind := range []string{"engine buffer", "private memory"} {
		src := alloc(t, init, n)
		back := alloc(t, init, n)
		if kind == "private memory" {
			src, back = privateBuffer(t, init, n), privateBuffer(t, init, n)
		}
		fillPattern(src, 11)
		transfer(t, init, 30*time.Second, write(src, seg, engine.AddrOf(dst), n))
		requireEqual(t, kind+" written", dst, src)
		transfer(t, init, 30*time.Second, read(back, seg, engine.AddrOf(dst), n))
		requireEqual(t, kind+" read back", back, src)
	}
	if line, ok := logs.find("transport chosen", "transport=shm", "same host"); !ok {
		t.Errorf("no log line says shm was chosen for a peer on this host")
	} else {
		t.Log(line)
	}
	st := init.Stats()
	if st.SHMSharedSlices == 0 || st.SHMAttachSlices == 0 || st.SHMFallbackSlices != 0 {
		t.Errorf("slices through shared buffers %d, by cross-memory attach %d, over tcp %d; want both ways and none over tcp",
			st.SHMSharedSlices, st.SHMAttachSlices, st.SHMFallbackSlices)
	}
	if ost := owner.Stats(); ost.OwnerBytesIn < 2*n || ost.OwnerBytesOut < 2*n || ost.SHMConns == 0 {
		t.Errorf("owner counted %d bytes in, %d out, %d shm connections; want %d both ways over shm", ost.OwnerBytesIn, ost.OwnerBytesOut, ost.SHMConns, 2*n)
	}
}

// otherHost is a Resolver that hands out a peer's descriptor as if the peer
// ran on another host: its shm address names another boot id.
type otherHost struct{ peer *engine.Engine }

func (r otherHost) Resolve(context.Context, string) (*control.Descriptor, error) {
	d := r.peer.Descriptor()
	d.Transports = append([]control.TransportAddr(nil), d.Transports...)
	for i, tr := range d.Transports {
		if tr.Name == "shm" {
			_, name, _ := strings.Cut(tr.Addr, "@")
			d.Transports[i].Addr = "00000000-0000-0000-0000-000000000000@" + name
		}
	}
	return d, nil
}

// TestAPeerOnAnotherHostGoesOverTCP: a peer whose shm address names
// another boot id is taken over tcp with the default protocol, and refused
// with shm forced.
func TestAPeerOnAnotherHostGoesOverTCP(t *testing.T) {
	owner := newEngineWith(t, engine.Options{Protocol: "auto"})
	dst := alloc(t, owner, 1<<20)

	logs := &logLines{}
	auto := newEngineWith(t, engine.Options{Protocol: "auto", Resolver: otherHost{owner}, Logger: slog.New(logs)})
	src := alloc(t, auto, 1<<20)
	fillPattern(src, 3)
	transfer(t, auto, 30*time.Second, write(src, openSegment(t, auto, owner.Name()), engine.AddrOf(dst), 1<<20))
	requireEqual(t, "written over tcp", dst, src)
	if _, ok := logs.find("transport chosen", "transport=tcp"); !ok {
		t.Errorf("no log line says tcp was chosen for a peer on another host")
	}
	if st := auto.Stats(); st.SHMSharedSlices+st.SHMAttachSlices+st.SHMFallbackSlices != 0 {
		t.Errorf("shm carried slices to a peer on another host: %+v", st)
	}

	forced := newEngineWith(t, engine.Options{Protocol: "shm", Resolver: otherHost{owner}})
	_, err := forced.OpenSegment(testCtx(t, 10*time.Second), owner.Name())
	if !errors.Is(err, engine.ErrUnsupported) {
		t.Fatalf("open a peer on another host with shm forced: %v; want ErrUnsupported", err)
	}
}

// TestSHMIsOfferedOnlyWhereItApplies: an engine with protocol tcp, and one
// that authenticates, offer no shm transport (a peer on this host takes
// tcp); shm forced with authentication is refused at New.
func TestSHMIsOfferedOnlyWhereItApplies(t *testing.T) {
	has := func(e *engine.Engine) bool {
		_, ok := e.Descriptor().Transport("shm")
		return ok
	}
	if e := newEngineWith(t, engine.Options{Protocol: "auto"}); !has(e) {
		t.Errorf("an engine with the default protocol offers no shm")
	}
	if e := newEngineWith(t, engine.Options{Protocol: "tcp"}); has(e) {
		t.Errorf("an engine with protocol tcp offers shm")
	}
	secret := t.TempDir() + "/cluster.secret"
	if err := os.WriteFile(secret, []byte("a cluster secret of at least sixteen bytes\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if e := newEngineWith(t, engine.Options{Protocol: "auto", ClusterSecretFile: secret}); has(e) {
		t.Errorf("an engine that authenticates offers shm")
	}
	if e, err := engine.New(engine.Options{IgnoreEnv: true, Protocol: "shm", ClusterSecretFile: secret}); !errors.Is(err, engine.ErrUnsupported) {
		if e != nil {
			_ = e.Close()
		}
		t.Errorf("New with shm forced and authentication: %v; want ErrUnsupported", err)
	}
}

// kvferryViews counts this process's mappings of engine buffers (memfds
// named kvferry-buffer): an engine's own, and the views its shm owner side
// holds of peers' buffers.
func kvferryViews(t *testing.T) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	return bytes.Count(b, []byte("memfd:kvferry-buffer"))
}

// TestAFreedBufferIsUnmappedByItsSameHostOwner: a buffer an initiator
// shared with a same-host owner is unmapped there once the initiator frees
// it, so freed buffers do not pile up in the owner's address space.
func TestAFreedBufferIsUnmappedByItsSameHostOwner(t *testing.T) {
	owner := newEngineWith(t, engine.Options{Protocol: "shm"})
	init := newEngineWith(t, engine.Options{Protocol: "shm", PathsPerPeer: 1})
	dst := alloc(t, owner, 1<<20)
	seg := openSegment(t, init, owner.Name())
	before := kvferryViews(t)
	src, err := init.AllocBuffer(1<<20, "cpu")
	if err != nil {
		t.Fatal(err)
	}
	fillPattern(src, 5)
	transfer(t, init, 30*time.Second, write(src, seg, engine.AddrOf(dst), 1<<20))
	if got := kvferryViews(t); got != before+2 {
		t.Fatalf("%d mappings of engine buffers after sharing one, %d before; want 2 more (ours and the owner's view)", got, before)
	}
	if err := init.FreeBuffer(engine.AddrOf(src)); err != nil {
		t.Fatal(err)
	}
	// The owner unmaps its view when it reads the initiator's next frame;
	// a transfer from another buffer is one.
	other := alloc(t, init, 1<<20)
	transfer(t, init, 30*time.Second, write(other, seg, engine.AddrOf(dst), 1<<20))
	waitFor(t, 10*time.Second, "the owner's view of the freed buffer unmapped", func() bool { return kvferryViews(t) == before+2 })
}
