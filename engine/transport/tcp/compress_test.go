package tcp_test

import (
	"bytes"
	"encoding/binary"
	"io"
	"net"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/kvcodec"
	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport/tcp"
	"github.com/kvferry/kvferry/engine/transport/transporttest"
)

const (
	frameWriteZ   = 11
	helloGoAway   = 1
	helloCompress = 4
)

// sayHelloCompressed sends a HELLO offering compressed WRITEs and returns
// the owner's HELLO_ACK feature bits.
func sayHelloCompressed(t *testing.T, c net.Conn, name string) uint64 {
	t.Helper()
	h := helloFrame(name)
	binary.LittleEndian.PutUint64(h[56:], helloGoAway|helloCompress)
	if _, err := c.Write(h); err != nil {
		t.Fatal(err)
	}
	return readAck(t, c, 2, 0).done
}

type ack struct {
	status uint32
	done   uint64
}

// readAck reads one answer frame of type typ for seq.
func readAck(t *testing.T, c net.Conn, typ uint8, seq uint64) ack {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	var b [tcp.HeaderSize]byte
	if _, err := io.ReadFull(c, b[:]); err != nil {
		t.Fatalf("no answer to %d: %v", seq, err)
	}
	if b[3] != typ || binary.LittleEndian.Uint64(b[8:]) != seq {
		t.Fatalf("answer %x; want type %d for seq %d", b, typ, seq)
	}
	return ack{status: binary.LittleEndian.Uint32(b[4:]), done: binary.LittleEndian.Uint64(b[56:])}
}

// A peer's WRITE_Z blocks are checked before a byte reaches owner memory:
// garbage, a block that decodes to more than the range admitted, and one
// whose plane decodes past its declared length are refused (the connection
// goes on), a block larger than the registered range is refused as out of
// bounds, and a valid block lands.
func TestCompressedWritesAreCheckedBeforeTheyLand(t *testing.T) {
	const size = 1 << 20
	mem := make([]byte, size)
	for i := range mem {
		mem[i] = 0x77
	}
	reg := memory.NewRegistry()
	regs, err := reg.Register([]memory.Range{{Mem: mem}})
	if err != nil {
		t.Fatal(err)
	}
	srv, addr := ownerWith(t, tcp.Options{}, transporttest.NewOwner(reg))
	c := dialFrom(t, addr, "")
	if bits := sayHelloCompressed(t, c, "z:1"); bits&helloCompress == 0 {
		t.Fatalf("the owner's HELLO_ACK does not take compressed WRITEs (%#x)", bits)
	}
	enc, _ := kvcodec.NewEncoder(kvcodec.CodecHuff0)
	send := func(seq uint64, block []byte) ack {
		f := append(rawFrame(frameWriteZ, seq, uint32(len(block)), regs[0].Key, memory.AddrOf(mem)), block...)
		if _, err := c.Write(f); err != nil {
			t.Fatal(err)
		}
		return readAck(t, c, 4, seq)
	}
	// Owner memory is read inside the region's guard, as the owner writes
	// it: the race detector sees no order through the socket.
	guarded := func(f func()) {
		t.Helper()
		if err := regs[0].Enter(); err != nil {
			t.Fatal(err)
		}
		defer regs[0].Leave()
		f()
	}
	untouched := func(what string) {
		t.Helper()
		guarded(func() {
			if i := bytes.IndexFunc(mem, func(r rune) bool { return r != 0x77 }); i >= 0 {
				t.Fatalf("%s: owner memory written at %d", what, i)
			}
		})
	}
	small, _ := enc.Encode(nil, make([]byte, 4096), 1)
	big, _ := enc.Encode(nil, make([]byte, size*2), 1)
	forged := append(append([]byte(nil), small[:8]...), big[8:]...) // declares 4096, its planes hold 2 MiB
	for i, c := range []struct {
		what   string
		block  []byte
		status uint32
	}{
		{"garbage", bytes.Repeat([]byte{0xEE}, 100), 5},
		{"a plane decoding past the declared length", forged, 5},
		{"more than the registered range", big, 2},
	} {
		if a := send(uint64(i+1), c.block); a.status != c.status || a.done != 0 {
			t.Fatalf("%s: answered status %d, %d bytes; want status %d, 0 bytes", c.what, a.status, a.done, c.status)
		}
		untouched(c.what)
	}
	data := bytes.Repeat([]byte{1, 2, 3, 4}, size/4)
	block, _ := enc.Encode(nil, data, 2)
	if a := send(9, block); a.status != 0 || a.done != size {
		t.Fatalf("a valid block: status %d, %d bytes", a.status, a.done)
	}
	var landed bool
	guarded(func() { landed = bytes.Equal(mem, data) })
	if !landed {
		t.Fatal("a valid block did not land as sent")
	}
	if st := srv.Stats(); st.CompressedMalformed != 2 || st.ProtocolErrors != 0 {
		t.Fatalf("stats %+v: want 2 malformed blocks counted, no connection dropped", st)
	}
}

// WRITE_Z on a connection whose HELLO did not offer it is a protocol
// error: the owner drops the connection.
func TestCompressedWriteWithoutTheHandshakesBitIsAProtocolError(t *testing.T) {
	_, addr := ownerWith(t, tcp.Options{}, nil)
	c := dialFrom(t, addr, "")
	if err := sayHello(c, "plain:1"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write(append(rawFrame(frameWriteZ, 1, 16, 1, 4096), make([]byte, 16)...)); err != nil {
		t.Fatal(err)
	}
	requireClosed(t, c, 10*time.Second, "WRITE_Z without the handshake's bit")
}

// An owner answers READs compressed only to initiators whose HELLO said
// they take READ_DATA_Z, and only when its own compression is on: the
// block decodes to the range read and READ_DONE follows with its length.
// An older initiator (no bit) and an owner not compressing get READ_DATA.
func TestCompressedReadAnswersAreNegotiated(t *testing.T) {
	const size = 256 << 10
	const helloReadZ = 8
	mem := make([]byte, size)
	for i := range mem {
		mem[i] = byte(i) & 0x0f // shrinks under any codec
	}
	enc, _ := kvcodec.NewEncoder(kvcodec.CodecHuff0)
	dec, _ := kvcodec.NewDecoder()
	for _, c := range []struct {
		what     string
		compress bool
		bits     uint64
		wantTyp  uint8
		wantAckZ bool
	}{
		{"both willing", true, helloGoAway | helloReadZ, 12, true},
		{"an initiator without the bit", true, helloGoAway, 6, false},
		{"an owner not compressing", false, helloGoAway | helloReadZ, 6, false},
	} {
		t.Run(c.what, func(t *testing.T) {
			reg := memory.NewRegistry()
			regs, err := reg.Register([]memory.Range{{Mem: mem}})
			if err != nil {
				t.Fatal(err)
			}
			opts := tcp.Options{CompressMin: 1}
			if c.compress {
				opts.Compressor = enc
			}
			srv, addr := ownerWith(t, opts, transporttest.NewOwner(reg))
			conn := dialFrom(t, addr, "")
			h := helloFrame("r:1")
			binary.LittleEndian.PutUint64(h[56:], c.bits)
			if _, err := conn.Write(h); err != nil {
				t.Fatal(err)
			}
			if ackZ := readAck(t, conn, 2, 0).done&helloReadZ != 0; ackZ != c.wantAckZ {
				t.Fatalf("HELLO_ACK says READ_DATA_Z %v, want %v", ackZ, c.wantAckZ)
			}
			if _, err := conn.Write(rawFrame(5, 1, size, regs[0].Key, memory.AddrOf(mem))); err != nil {
				t.Fatal(err)
			}
			var hb [tcp.HeaderSize]byte
			_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
			if _, err := io.ReadFull(conn, hb[:]); err != nil {
				t.Fatal(err)
			}
			n := binary.LittleEndian.Uint32(hb[28:])
			if hb[3] != c.wantTyp {
				t.Fatalf("READ answered with type %d (%d bytes), want %d", hb[3], n, c.wantTyp)
			}
			payload := make([]byte, n)
			if _, err := io.ReadFull(conn, payload); err != nil {
				t.Fatal(err)
			}
			got := payload
			if c.wantTyp == 12 {
				if n >= size {
					t.Fatalf("a compressed answer of %d bytes for %d", n, size)
				}
				got = make([]byte, size)
				if err := dec.Decode(got, payload); err != nil {
					t.Fatal(err)
				}
			}
			if !bytes.Equal(got, mem) {
				t.Fatal("the answer is not the range read")
			}
			if a := readAck(t, conn, 7, 1); a.status != 0 || a.done != size {
				t.Fatalf("READ_DONE status %d, %d bytes", a.status, a.done)
			}
			if st := srv.Stats(); (st.CompressedSlices == 1) != (c.wantTyp == 12) {
				t.Fatalf("owner counted %d slices sent compressed", st.CompressedSlices)
			}
		})
	}
}
