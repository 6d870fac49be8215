package shm

// Fuzz targets for the same-host transport's frames, alone and as a stream
// an owner reads from a peer. Fuzz them on their own:
//
//	go test ./engine/transport/shm -run='^$' -fuzz='^FuzzFrameDecode$' -fuzztime=10s
//	go test ./engine/transport/shm -run='^$' -fuzz='^FuzzOwnerStream$' -fuzztime=20000x
//
// A plain `go test` runs the f.Add seeds.

import (
	"bytes"
	"errors"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
)

func frame(h header) []byte {
	b := make([]byte, FrameSize)
	h.encode(b)
	return b
}

func frameSeeds() [][]byte {
	w := frame(header{typ: frameWrite, status: reachShared, seq: 1, requestID: 7, length: 4096, key: 5, addr: 0x1000, local: 1, offset: 64})
	return [][]byte{
		w,
		frame(header{typ: frameRead, status: reachAttach, seq: 2, length: MaxSliceLength, local: 0x7f0000000000}),
		frame(header{typ: frameRead, status: reachGPU, seq: 2, length: 1, local: gpuIDBit | 1}),
		frame(header{typ: frameHello, length: 9, local: 0x1234, offset: 99}),
		frame(header{typ: frameShare, local: 3, offset: 1 << 20}),
		frame(header{typ: frameShareGPU, local: gpuIDBit | 3, offset: 1 << 20, length: IPCHandleSize + 12}),
		frame(header{typ: frameUnshare, local: 3}),
		frame(header{typ: frameAnswer, status: statusAborted, seq: 1, epoch: 100}),
		append(w[:3:3], 9),
		w[:FrameSize-1],
		nil,
	}
}

// FuzzFrameDecode: decode never panics, and a frame it accepts encodes back
// to the same bytes and obeys the limits the owner relies on.
func FuzzFrameDecode(f *testing.F) {
	for _, s := range frameSeeds() {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var h header
		err := h.decode(b)
		if err != nil {
			if !errors.Is(err, errBadFrame) || !errors.Is(err, transport.ErrProtocol) {
				t.Fatalf("decode error %v does not match errBadFrame and transport.ErrProtocol", err)
			}
			return
		}
		if !bytes.Equal(frame(h), b[:FrameSize]) {
			t.Fatalf("accepted frame %x encodes back as %x", b[:FrameSize], frame(h))
		}
		switch h.typ {
		case frameWrite, frameRead:
			if h.length == 0 || h.length > MaxSliceLength {
				t.Fatalf("accepted a slice of %d bytes", h.length)
			}
			if h.status != reachShared && h.status != reachAttach && h.status != reachGPU {
				t.Fatalf("accepted reach mode %d", h.status)
			}
		case frameHello:
			if h.length == 0 || h.length > maxName {
				t.Fatalf("accepted a HELLO name of %d bytes", h.length)
			}
		case frameShareGPU:
			if h.length <= IPCHandleSize || h.length > IPCHandleSize+maxBusID {
				t.Fatalf("accepted a SHARE_GPU payload of %d bytes", h.length)
			}
		default:
			if h.length != 0 || h.status > maxKnownStatus {
				t.Fatalf("accepted type %d with length %d status %d", h.typ, h.length, h.status)
			}
		}
	})
}

// streamRig is an owner serving a registered buffer surrounded by guard
// bytes; fuzzed streams come from a raw peer that said HELLO properly.
type streamRig struct {
	owner *Transport
	addr  string
	all   []byte // guard, registered, guard
	reg   *memory.Region
}

const streamGuard = 4096

func newStreamRig(f *testing.F) *streamRig {
	all, _, err := memory.Alloc(64<<10 + 2*streamGuard)
	if err != nil {
		f.Fatal(err)
	}
	for i := range all {
		all[i] = 0xee
	}
	f.Cleanup(func() { _ = memory.Free(all) }) // after the owner closed
	t, addr, reg := serveBuffer(f, Options{HandshakeTimeout: time.Second, IOTimeout: time.Second}, all[streamGuard:len(all)-streamGuard])
	return &streamRig{owner: t, addr: addr, all: all, reg: reg}
}

// FuzzOwnerStream: whatever a peer of the same user sends after a proper
// HELLO (frames in any order, SHAREs without descriptors, slices naming
// shares and addresses it never had), the owner never crashes, never
// writes outside registered memory, and ends the connection by the time
// the peer closes its side.
func FuzzOwnerStream(f *testing.F) {
	rig := newStreamRig(f)
	for _, s := range frameSeeds() {
		f.Add(s)
	}
	key := rig.reg.Key
	f.Add(frame(header{typ: frameWrite, status: reachAttach, seq: 1, length: 4096, key: key, addr: rig.reg.Addr, local: 0x10}))
	f.Add(frame(header{typ: frameRead, status: reachShared, seq: 1, length: 4096, key: key, addr: rig.reg.Addr, local: 1}))
	f.Add(append(frame(header{typ: frameShare, local: 1, offset: 4096}), frame(header{typ: frameWrite, status: reachShared, seq: 1, length: 64, key: key, addr: rig.reg.Addr, local: 1})...))
	_, name, _ := splitAddr(rig.addr)
	f.Fuzz(func(t *testing.T, stream []byte) {
		c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: name, Net: "unix"})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		l, fd, err := newLease()
		if err != nil {
			t.Fatal(err)
		}
		defer l.unmap()
		hello := frame(header{typ: frameHello, length: 4})
		_, _, err = c.WriteMsgUnix(append(hello, "fuzz"...), unix.UnixRights(fd), nil)
		_ = unix.Close(fd)
		if err != nil {
			t.Fatal(err)
		}
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		var ack [FrameSize]byte
		if err := readFull(c, ack[:]); err != nil {
			t.Fatalf("no HELLO_ACK: %v", err)
		}
		if _, err := c.Write(stream); err != nil {
			return // the owner already closed: it refused the stream
		}
		_ = c.CloseWrite()
		// The owner answers what it served and closes its side once it
		// read our end: a read that ends (EOF or reset) shows it did.
		buf := make([]byte, 4096)
		for {
			if _, err := c.Read(buf); err != nil {
				if isTimeout(err) {
					t.Fatal("the owner did not end the connection after the peer closed its side")
				}
				break
			}
		}
		for i := 0; i < streamGuard; i++ {
			if rig.all[i] != 0xee || rig.all[len(rig.all)-1-i] != 0xee {
				t.Fatalf("a guard byte around the registered buffer changed")
			}
		}
	})
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
