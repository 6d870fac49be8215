package engine_test

// The event queue: its file descriptor wakes event loops, and notifications
// are backpressured.

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvferry/kvferry/engine"
)

// pollIn reports whether fd is readable within ms milliseconds (0: now), as
// the event loops the EventFD exists for (epoll, asyncio) would see it.
func pollIn(t *testing.T, fd, ms int) bool {
	t.Helper()
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	for {
		n, err := unix.Poll(fds, ms)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			t.Fatalf("poll: %v", err)
		}
		return n > 0 && fds[0].Revents&unix.POLLIN != 0
	}
}

// The EventFD is readable while events wait and TakeEvents resets it once it
// took them all; notifications over 64 bytes are invalid; a full queue
// answers ErrBusy until the application takes an event; Close closes
// Events() and the engine refuses TakeEvents and EventFD afterwards.
func TestEventFDAndNotifyBackpressure(t *testing.T) {
	recv := newEngineWith(t, engine.Options{EventQueue: 2})
	send := newEngineWith(t, engine.Options{})
	seg := openSegment(t, send, recv.Name())
	ctx := testCtx(t, 30*time.Second)
	fd, err := recv.EventFD()
	if err != nil {
		t.Fatal(err)
	}
	if fd2, err := recv.EventFD(); err != nil || fd2 != fd {
		t.Errorf("second EventFD = %d, %v; want the same fd %d", fd2, err, fd)
	}
	if pollIn(t, fd, 0) {
		t.Fatal("event fd readable with no event")
	}
	notify := func(rid uint64, data string) error { return send.Notify(ctx, seg, rid, []byte(data)) }
	if err := notify(1, "a"); err != nil {
		t.Fatal(err)
	}
	if !pollIn(t, fd, 5000) {
		t.Fatal("event fd not readable after a notification")
	}
	if err := notify(2, "b"); err != nil {
		t.Fatal(err)
	}
	if err := notify(3, "c"); !errors.Is(err, engine.ErrBusy) {
		t.Fatalf("third notification into a queue of 2: %v, want ErrBusy", err)
	}
	var out [4]engine.Event
	if n, err := recv.TakeEvents(ctx, out[:1]); n != 1 || err != nil || out[0].RequestID != 1 || string(out[0].Data) != "a" {
		t.Fatalf("TakeEvents(1) = %d, %v, %+v", n, err, out[0])
	}
	if !pollIn(t, fd, 0) {
		t.Error("event fd not readable with an event left")
	}
	if err := notify(4, "d"); err != nil {
		t.Fatalf("notification after the queue drained one: %v", err)
	}
	n, err := recv.TakeEvents(ctx, out[:])
	if n != 2 || err != nil || out[0].RequestID != 2 || out[1].RequestID != 4 || out[0].Kind != engine.EventNotify || out[1].Peer != send.Name() {
		t.Fatalf("TakeEvents = %d, %v, %+v", n, err, out[:n])
	}
	if pollIn(t, fd, 0) {
		t.Error("event fd readable after TakeEvents took every event")
	}
	if st := recv.Stats(); st.Notifications != 3 {
		t.Errorf("%d notifications counted, want 3", st.Notifications)
	}

	if err := send.Notify(ctx, seg, 5, make([]byte, engine.MaxNotifyData+1)); !errors.Is(err, engine.ErrInvalidArg) {
		t.Errorf("notification of %d bytes: %v, want ErrInvalidArg", engine.MaxNotifyData+1, err)
	}
	full := bytes.Repeat([]byte{7}, engine.MaxNotifyData)
	if err := send.Notify(ctx, seg, 6, full); err != nil {
		t.Fatalf("notification of %d bytes: %v", len(full), err)
	}
	if n, err := recv.TakeEvents(ctx, out[:]); n != 1 || err != nil || !bytes.Equal(out[0].Data, full) {
		t.Fatalf("TakeEvents = %d, %v, %+v", n, err, out[0])
	}
	// Nothing waiting: TakeEvents waits until its context ends.
	short, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	n, err = recv.TakeEvents(short, out[:])
	cancel()
	if n != 0 || err != nil {
		t.Errorf("TakeEvents with nothing waiting = %d, %v; want 0, nil at the deadline", n, err)
	}

	if err := notify(7, "left for Close"); err != nil {
		t.Fatal(err)
	}
	if err := recv.Close(); err != nil {
		t.Fatal(err)
	}
	within(t, 5*time.Second, "Events() after Close", func() {
		for range recv.Events() {
		}
	})
	if _, err := recv.TakeEvents(ctx, out[:]); !errors.Is(err, engine.ErrClosed) {
		t.Errorf("TakeEvents after Close: %v, want ErrClosed", err)
	}
	if _, err := recv.EventFD(); !errors.Is(err, engine.ErrClosed) {
		t.Errorf("EventFD after Close: %v, want ErrClosed", err)
	}
	took := within(t, 10*time.Second, "Notify to a closed engine", func() {
		if err := send.Notify(testCtx(t, time.Second), seg, 8, nil); err == nil {
			t.Error("notification to a closed engine succeeded")
		}
	})
	t.Logf("Notify to a closed engine failed after %v", took)
}
