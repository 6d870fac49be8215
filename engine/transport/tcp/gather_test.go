package tcp_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
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

// answer is one READ's answer as a raw initiator reads it.
type answer struct {
	data   []byte // READ_DATA's payload; nil without READ_DATA
	status uint32 // READ_DONE's status
	done   uint64 // READ_DONE's bytes valid
}

// readAnswers reads the owner's answers to n READs, numbered 1 to n, from
// c; it fails the test when the connection ends or stalls first.
func readAnswers(t *testing.T, c net.Conn, n int) map[uint64]*answer {
	t.Helper()
	got := map[uint64]*answer{}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	defer c.SetReadDeadline(time.Time{})
	var hb [tcp.HeaderSize]byte
	for ended := 0; ended < n; {
		if _, err := io.ReadFull(c, hb[:]); err != nil {
			t.Fatalf("the connection ended after %d of %d READs were answered: %v", ended, n, err)
		}
		seq := binary.LittleEndian.Uint64(hb[8:])
		a := got[seq]
		if a == nil {
			a = &answer{}
			got[seq] = a
		}
		switch hb[3] {
		case 6: // READ_DATA
			a.data = make([]byte, binary.LittleEndian.Uint32(hb[28:]))
			if _, err := io.ReadFull(c, a.data); err != nil {
				t.Fatalf("READ %d's data was cut: %v", seq, err)
			}
		case 7: // READ_DONE
			a.status, a.done = binary.LittleEndian.Uint32(hb[4:]), binary.LittleEndian.Uint64(hb[56:])
			ended++
		default:
			t.Fatalf("unexpected frame type %d", hb[3])
		}
	}
	return got
}

// The owner answers READs it read ahead in one gathered write. When their
// memory is unregistered while that write is parked on a full socket, no
// byte of the memory goes out after UnregisterMemory returned: zeros stand
// in for the rest of each READ caught mid-write, whose READ_DONE says it
// was refused and how many bytes came from memory; the frames stay whole,
// and the connection serves the next request. Remove the guard from
// writevParts and the 0xEE bytes written after the unregistration reach the
// initiator.
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
	_, addr := ownerWith(t, tcp.Options{}, owner)

	// A bare initiator with a small receive buffer that reads nothing yet,
	// so the owner's gathered write parks on a full socket. Its HELLO and
	// READs go in one write, so the owner reads them all ahead.
	c := dialFrom(t, addr, "")
	_ = c.SetReadBuffer(32 << 10)
	req := helloFrame("reader:1")
	for i := range reads {
		req = append(req, rawFrame(5, uint64(i+1), size, regs[0].Key, memory.AddrOf(mem)+uint64(i*size))...)
	}
	// Every admission counts an Enter (the check before READ_DATA), then
	// each syscall of the write one per range it reads: once the write
	// entered a range for its bytes, it is under way.
	var wrote atomic.Bool
	owner.OnEnter(func() {
		if owner.Enters.Load() > reads {
			wrote.Store(true)
		}
	})
	if _, err := c.Write(req); err != nil {
		t.Fatal(err)
	}
	var ack [tcp.HeaderSize]byte
	if _, err := io.ReadFull(c, ack[:]); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the gathered write under way", wrote.Load)
	if _, err := reg.Unregister([]uint64{memory.AddrOf(mem)}); err != nil {
		t.Fatal(err)
	}
	owner.OnEnter(nil)
	for i := range mem { // what would leak if the owner kept reading the memory
		mem[i] = 0xee
	}
	got := readAnswers(t, c, reads)
	struck := 0
	for seq := uint64(1); seq <= reads; seq++ {
		a := got[seq]
		if i := bytes.IndexByte(a.data, 0xee); i >= 0 {
			t.Fatalf("READ %d: byte %d came from memory after it was unregistered", seq, i)
		}
		if a.status == 0 {
			continue
		}
		if a.data != nil {
			struck++
			if !bytes.Equal(a.data[a.done:], make([]byte, size-int(a.done))) {
				t.Errorf("READ %d: refused after %d bytes, but what follows them is not zeros", seq, a.done)
			}
		}
	}
	if struck == 0 {
		t.Fatal("no READ was refused mid-write: the unregistration did not strike mid-write")
	}
	// The connection goes on: a READ of what is left registered is answered.
	if _, err := c.Write(rawFrame(5, reads+1, size, regs[0].Key, memory.AddrOf(mem))); err != nil {
		t.Fatal(err)
	}
	got = readAnswers(t, c, 1)
	if a := got[reads+1]; a == nil || a.status == 0 {
		t.Fatalf("a READ of unregistered memory was answered %+v", a)
	}
	t.Logf("%d READs refused mid-write", struck)
}

// abortingOwner admits like transporttest.Owner, and aborts request victim
// as soon as the owner's gathered write starts sending its bytes: from then
// on each of its ranges refuses, as the engine's guard does after an
// Abort.
type abortingOwner struct {
	*transporttest.Owner
	victim  uint64
	aborted atomic.Bool
}

func (o *abortingOwner) Admit(a transport.Access) (transport.Target, error) {
	tgt, err := o.Owner.Admit(a)
	if err != nil || a.RequestID != o.victim {
		return tgt, err
	}
	if o.aborted.Load() {
		return transport.Target{}, fmt.Errorf("request %d: %w", a.RequestID, transport.ErrAborted)
	}
	tgt.Guard = &abortingGuard{o: o, inner: tgt.Guard}
	return tgt, nil
}

// abortingGuard is a victim's range: its first Enter is the owner's check
// at admission, its second the first bytes going out, after which the
// request is aborted.
type abortingGuard struct {
	o      *abortingOwner
	inner  transport.Guard
	enters int
}

func (g *abortingGuard) Enter() error {
	if g.o.aborted.Load() {
		return fmt.Errorf("request %d: %w", g.o.victim, transport.ErrAborted)
	}
	if err := g.inner.Enter(); err != nil {
		return err
	}
	if g.enters++; g.enters == 2 {
		g.o.aborted.Store(true)
	}
	return nil
}

func (g *abortingGuard) Leave() { g.inner.Leave() }

// An abort that strikes while the owner sends READs of several requests in
// one gathered write, on one connection, ends the aborted request's READs
// ABORTED (refused with ErrAborted) and leaves the others on the connection
// alone: they complete with their data, and the path stays up.
func TestAbortMidGatheredWriteSparesBystanders(t *testing.T) {
	const size = 1 << 20
	const victim, bystander = 7, 8
	owned, _, err := memory.Alloc(4 * size)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = memory.Free(owned) })
	for i := range owned {
		owned[i] = byte(i/size + 1)
	}
	reg := memory.NewRegistry()
	oregs, err := reg.Register([]memory.Range{{Mem: owned}})
	if err != nil {
		t.Fatal(err)
	}
	owner := &abortingOwner{Owner: transporttest.NewOwner(reg), victim: victim}
	srv, addr := ownerWith(t, tcp.Options{}, owner)

	local := make([]byte, 5*size)
	lregs, err := memory.NewRegistry().Register([]memory.Range{{Mem: local}})
	if err != nil {
		t.Fatal(err)
	}
	cli := tcp.New(tcp.Options{})
	t.Cleanup(func() { _ = cli.Close() })
	ep, err := cli.Dial(context.Background(), addr, "init:1")
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		i   int
		err error
	}
	done := make(chan result, 5)
	slice := func(i int, rid uint64) *transport.Slice {
		return &transport.Slice{Op: transport.Read, Local: local[i*size : (i+1)*size], LocalReg: lregs[0], Key: oregs[0].Key,
			Remote: memory.AddrOf(owned) + uint64(i%4*size), RequestID: rid,
			Done: func(_ *transport.Slice, err error) { done <- result{i, err} }}
	}
	// Hold admission until every READ frame is read ahead, so that the four
	// are answered in one gathered write.
	release := owner.Hold()
	rids := []uint64{victim, bystander, victim, bystander}
	var slices []*transport.Slice
	for i, rid := range rids {
		slices = append(slices, slice(i, rid))
	}
	ep.Post(slices)
	waitFor(t, 10*time.Second, "the READs sent and the first held at admission", func() bool {
		for _, s := range slices {
			if s.State() != transport.StateSent {
				return false
			}
		}
		return owner.Waiting.Load() == 1
	})
	release()
	errs := make([]error, len(rids))
	for range rids {
		select {
		case r := <-done:
			errs[r.i] = r.err
		case <-time.After(10 * time.Second):
			t.Fatal("a READ never ended")
		}
	}
	for i, rid := range rids {
		switch {
		case rid == victim && (!errors.Is(errs[i], transport.ErrAborted) || !errors.Is(errs[i], transport.ErrRefused)):
			t.Errorf("READ %d of the aborted request ended with %v, want refused as aborted", i, errs[i])
		case rid == bystander && errs[i] != nil:
			t.Errorf("READ %d of a bystander request on the same connection ended with %v, want success", i, errs[i])
		case rid == bystander && !bytes.Equal(local[i*size:(i+1)*size], owned[i*size:(i+1)*size]):
			t.Errorf("READ %d of a bystander request completed with wrong data", i)
		}
	}
	if !owner.aborted.Load() || srv.Stats().RefusedInFlight == 0 {
		t.Fatalf("the abort did not strike mid-write (stats %+v)", srv.Stats())
	}
	if ep.Dead() {
		t.Fatal("the path died for an abort")
	}
	// The path serves the next READ.
	ep.Post([]*transport.Slice{slice(4, bystander)})
	if r := <-done; r.err != nil {
		t.Fatalf("a READ after the abort, on the same path: %v", r.err)
	}
}
