package tcp

import (
	"bytes"
	"context"
	"errors"
	"net"
	"testing"

	"github.com/kvferry/kvferry/engine/kvcodec"
	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
)

// readFromBadOwner posts one READ of len(mem) bytes to an owner that
// answers with what answer writes, and returns the slice's outcome and the
// initiator's stats.
func readFromBadOwner(t *testing.T, mem []byte, answer func(c net.Conn, h header)) (error, Stats) {
	t.Helper()
	addr := badOwner(t, answer)
	regs, err := memory.NewRegistry().Register([]memory.Range{{Mem: mem}})
	if err != nil {
		t.Fatal(err)
	}
	tr := New(Options{})
	t.Cleanup(func() { tr.Close() })
	ep, err := tr.Dial(context.Background(), addr, "me:1")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	ep.Post([]*transport.Slice{{Op: transport.Read, Local: mem, LocalReg: regs[0], Done: func(_ *transport.Slice, err error) { done <- err }}})
	err = outcome(t, done)
	return err, tr.Stats()
}

// kvLike is n bytes of 2-byte elements whose high bytes repeat: a block of
// it shrinks under the byte-plane codec.
func kvLike(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		if i%2 == 1 {
			b[i] = 0x3f
		} else {
			b[i] = byte(i * 7)
		}
	}
	return b
}

// An initiator takes a READ_DATA_Z block only when it decodes to exactly
// the slice it asked for: a valid block lands; garbage, a block larger than
// the slice, one declaring more or fewer bytes than the slice, and a block
// for a slice larger than any sent compressed fail the path (the owner
// broke the protocol) with the slice's memory untouched, and each is
// counted as malformed.
func TestCompressedReadAnswersAreCheckedBeforeTheyLand(t *testing.T) {
	const size = 64 << 10
	enc, _ := kvcodec.NewEncoder(kvcodec.CodecHuff0)
	want := kvLike(size)
	valid, _ := enc.Encode(nil, want, 2)
	if len(valid) >= size {
		t.Fatalf("the test's data does not shrink (%d bytes)", len(valid))
	}
	short, _ := enc.Encode(nil, want[:size/2], 2)
	answerWith := func(block []byte) func(c net.Conn, h header) {
		return func(c net.Conn, h header) {
			f := append(frameOf(header{typ: frameReadDataZ, seq: h.seq, length: uint32(len(block))}), block...)
			f = append(f, frameOf(header{typ: frameReadDone, seq: h.seq, done: uint64(h.length)})...)
			_, _ = c.Write(f)
		}
	}
	t.Run("valid", func(t *testing.T) {
		mem := make([]byte, size)
		err, st := readFromBadOwner(t, mem, answerWith(valid))
		if err != nil {
			t.Fatalf("a valid READ_DATA_Z: %v", err)
		}
		if !bytes.Equal(mem, want) {
			t.Fatal("a valid READ_DATA_Z did not land as encoded")
		}
		if st.CompressedIn != uint64(len(valid)) {
			t.Fatalf("CompressedIn %d, want %d", st.CompressedIn, len(valid))
		}
	})
	for _, c := range []struct {
		what      string
		size      int
		block     []byte
		malformed bool
	}{
		{"garbage", size, bytes.Repeat([]byte{0xEE}, 100), true},
		{"a block declaring half the slice", size, short, true},
		{"a block declaring more than the slice", len(valid), valid, true},
		{"a block larger than the slice", 1024, valid, true},
		{"a slice larger than any sent compressed", MaxCompressedSlice + 2, valid, true},
	} {
		t.Run(c.what, func(t *testing.T) {
			mem := bytes.Repeat([]byte{0x77}, c.size)
			err, st := readFromBadOwner(t, mem, answerWith(c.block))
			if !errors.Is(err, transport.ErrConnection) {
				t.Fatalf("ended with %v, want the path failed", err)
			}
			if i := bytes.IndexFunc(mem, func(r rune) bool { return r != 0x77 }); i >= 0 {
				t.Fatalf("slice memory written at %d", i)
			}
			if got := st.CompressedMalformed == 1; got != c.malformed {
				t.Fatalf("CompressedMalformed %d, want malformed=%v", st.CompressedMalformed, c.malformed)
			}
		})
	}
}
