package tcp_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport/tcp"
	"github.com/kvferry/kvferry/engine/transport/transporttest"
)

// rawFrame builds a request frame in the layout of wire.go.
func rawFrame(typ uint8, seq uint64, length uint32, key memory.Key, addr uint64) []byte {
	b := make([]byte, tcp.HeaderSize)
	binary.LittleEndian.PutUint16(b[0:], 0x464b)
	b[2], b[3] = 1, typ
	binary.LittleEndian.PutUint64(b[8:], seq)
	binary.LittleEndian.PutUint32(b[28:], length)
	binary.LittleEndian.PutUint64(b[32:], uint64(key))
	binary.LittleEndian.PutUint64(b[40:], addr)
	return b
}

// The owner answers READs read ahead in one gathered write. When their
// memory is unregistered while that write is parked on a full socket, no
// byte of the memory goes out after UnregisterMemory returned: the owner
// stops and closes the connection (the frame is torn; an initiator retries
// and is refused at admission). Remove the guard from writevGuards and the
// 0xEE bytes written after the unregistration reach the initiator.
func TestGatheredReadsStopAtAnUnregistrationMidWrite(t *testing.T) {
	const reads, size = 16, 512 << 10
	mem, _, err := memory.Alloc(reads * size)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = memory.Free(mem) })
	for i := range mem {
		mem[i] = 0x5a
	}
	reg := memory.NewRegistry()
	regs, err := reg.Register([]memory.Range{{Mem: mem}})
	if err != nil {
		t.Fatal(err)
	}
	owner := transporttest.NewOwner(reg)
	tr := tcp.New(tcp.Options{})
	t.Cleanup(func() { _ = tr.Close() })
	addr, err := tr.Listen(owner)
	if err != nil {
		t.Fatal(err)
	}

	// A bare initiator with a small receive buffer that reads nothing yet,
	// so the owner's gathered write parks on a full socket.
	nc, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	c := nc.(*net.TCPConn)
	t.Cleanup(func() { _ = c.Close() })
	_ = c.SetReadBuffer(32 << 10)
	name := []byte("reader:1")
	var req []byte
	req = append(req, rawFrame(1, 0, uint32(len(name)), 0, 0)...)
	req = append(req, name...)
	release := owner.Hold() // every READ frame arrives before the first is admitted
	for i := 0; i < reads; i++ {
		req = append(req, rawFrame(5, uint64(i+1), size, regs[0].Key, memory.AddrOf(mem)+uint64(i*size))...)
	}
	if _, err := c.Write(req); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	release()
	time.Sleep(200 * time.Millisecond) // the owner writes until the socket is full

	if _, err := reg.Unregister([]uint64{memory.AddrOf(mem)}); err != nil {
		t.Fatal(err)
	}
	for i := range mem { // what would leak if the owner kept reading the memory
		mem[i] = 0xee
	}
	// Read until the owner closes the connection or every answer arrived.
	all := tcp.HeaderSize + reads*(size+2*tcp.HeaderSize)
	got := make([]byte, 0, all)
	buf := make([]byte, 64<<10)
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	for len(got) < all {
		n, err := c.Read(buf)
		got = append(got, buf[:n]...)
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				t.Fatalf("the owner neither finished nor closed the connection (read %d bytes)", len(got))
			}
			break // closed by the owner
		}
	}
	if i := bytes.IndexByte(got, 0xee); i >= 0 {
		t.Fatalf("byte %d of the answers came from memory after it was unregistered", i)
	}
	if len(got) >= all {
		t.Fatalf("all %d bytes of answers arrived: the unregistration did not strike mid-write", len(got))
	}
	t.Logf("%d of %d bytes arrived before the owner stopped", len(got), all)
}
