package control_test

// Tests of the ABORT, ABORT_ACK and NOTIFY bodies: the wire layout, round
// trips, and every rejection of the decoders.

import (
	"bytes"
	"encoding/binary"
	"errors"
	"reflect"
	"strconv"
	"testing"

	"github.com/kvferry/kvferry/engine/control"
)

// malformed checks that a decoder refused its input with ErrMalformed.
func malformed(t *testing.T, what string, err error) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: accepted, want ErrMalformed", what)
	} else if !errors.Is(err, control.ErrMalformed) {
		t.Errorf("%s: %v, does not wrap ErrMalformed", what, err)
	}
}

func TestAbortMsgRoundTrip(t *testing.T) {
	for _, m := range []control.AbortMsg{
		{RequestID: 1},
		{RequestID: 42, Generation: 7},
		{RequestID: 1<<64 - 1, Generation: 1<<32 - 1},
	} {
		b := m.Encode()
		if len(b) != control.AbortMsgSize {
			t.Fatalf("%+v: %d bytes, want %d", m, len(b), control.AbortMsgSize)
		}
		// The documented layout: u64 request id, u32 generation, u32 zero.
		if binary.LittleEndian.Uint64(b[0:]) != m.RequestID || binary.LittleEndian.Uint32(b[8:]) != m.Generation ||
			binary.LittleEndian.Uint32(b[12:]) != 0 {
			t.Fatalf("%+v encodes as %x", m, b)
		}
		got, err := control.DecodeAbortMsg(b)
		if err != nil || got != m {
			t.Fatalf("%+v: decoded %+v, %v", m, got, err)
		}
	}
}

func TestAbortMsgRejections(t *testing.T) {
	valid := control.AbortMsg{RequestID: 9, Generation: 3}.Encode()
	for _, n := range []int{0, 1, 8, control.AbortMsgSize - 1, control.AbortMsgSize + 1, 2 * control.AbortMsgSize, 1 << 16} {
		b := make([]byte, n)
		copy(b, valid)
		_, err := control.DecodeAbortMsg(b)
		malformed(t, "ABORT body of "+strconv.Itoa(n)+" bytes", err)
	}
	for i := 12; i < control.AbortMsgSize; i++ {
		for _, v := range []byte{1, 0x80, 0xff} {
			b := append([]byte(nil), valid...)
			b[i] = v
			_, err := control.DecodeAbortMsg(b)
			malformed(t, "ABORT with reserved byte "+strconv.Itoa(i)+" set", err)
		}
	}
	_, err := control.DecodeAbortMsg(control.AbortMsg{Generation: 3}.Encode())
	malformed(t, "ABORT of request id 0", err)
	_, err = control.DecodeAbortMsg(nil)
	malformed(t, "nil ABORT body", err)
}

func TestAbortAckRoundTrip(t *testing.T) {
	for _, m := range []control.AbortAck{
		{RequestID: 1, Outcome: control.AckDrained},
		{RequestID: 42, Generation: 7, Outcome: control.AckCut, Landed: 4096},
		{RequestID: 1<<64 - 1, Generation: 1<<32 - 1, Outcome: control.AckHeard, Landed: 1<<64 - 1},
	} {
		b := m.Encode()
		if len(b) != control.AbortAckSize {
			t.Fatalf("%+v: %d bytes, want %d", m, len(b), control.AbortAckSize)
		}
		// u64 request id, u32 generation, u8 outcome, 3 zero bytes, u64 landed.
		if binary.LittleEndian.Uint64(b[0:]) != m.RequestID || binary.LittleEndian.Uint32(b[8:]) != m.Generation ||
			b[12] != uint8(m.Outcome) || !bytes.Equal(b[13:16], []byte{0, 0, 0}) || binary.LittleEndian.Uint64(b[16:]) != m.Landed {
			t.Fatalf("%+v encodes as %x", m, b)
		}
		got, err := control.DecodeAbortAck(b)
		if err != nil || got != m {
			t.Fatalf("%+v: decoded %+v, %v", m, got, err)
		}
	}
}

func TestAbortAckRejections(t *testing.T) {
	valid := control.AbortAck{RequestID: 9, Generation: 3, Outcome: control.AckDrained, Landed: 100}.Encode()
	for _, n := range []int{0, 1, control.AbortMsgSize, control.AbortAckSize - 1, control.AbortAckSize + 1, 1 << 16} {
		b := make([]byte, n)
		copy(b, valid)
		_, err := control.DecodeAbortAck(b)
		malformed(t, "ABORT_ACK body of "+strconv.Itoa(n)+" bytes", err)
	}
	for i := 13; i < 16; i++ {
		for _, v := range []byte{1, 0xff} {
			b := append([]byte(nil), valid...)
			b[i] = v
			_, err := control.DecodeAbortAck(b)
			malformed(t, "ABORT_ACK with reserved byte "+strconv.Itoa(i)+" set", err)
		}
	}
	for _, o := range []byte{0, 4, 5, 0x80, 0xff} {
		b := append([]byte(nil), valid...)
		b[12] = o
		_, err := control.DecodeAbortAck(b)
		malformed(t, "ABORT_ACK with outcome "+strconv.Itoa(int(o)), err)
	}
	_, err := control.DecodeAbortAck(control.AbortAck{Outcome: control.AckDrained}.Encode())
	malformed(t, "ABORT_ACK of request id 0", err)
	// Every valid outcome decodes.
	for _, o := range []control.AckOutcome{control.AckDrained, control.AckCut, control.AckHeard} {
		m := control.AbortAck{RequestID: 5, Outcome: o}
		if got, err := control.DecodeAbortAck(m.Encode()); err != nil || got != m {
			t.Errorf("outcome %v: %+v, %v", o, got, err)
		}
	}
}

func TestAckOutcomeString(t *testing.T) {
	for o, want := range map[control.AckOutcome]string{control.AckDrained: "drained", control.AckCut: "cut",
		control.AckHeard: "heard", 0: "AckOutcome(0)", 9: "AckOutcome(9)"} {
		if o.String() != want {
			t.Errorf("AckOutcome(%d).String() = %q, want %q", uint8(o), o.String(), want)
		}
	}
}

func TestNotificationRoundTrip(t *testing.T) {
	full := bytes.Repeat([]byte{0xab}, control.MaxNotifyData)
	for _, n := range []control.Notification{
		{RequestID: 1},
		// Request id 0 is allowed: a notification may be about no request.
		{RequestID: 0, Data: []byte("hi")},
		{RequestID: 77, Data: []byte{0}},
		{RequestID: 1<<64 - 1, Data: full},
	} {
		b := n.Encode()
		if len(b) != 8+len(n.Data) || binary.LittleEndian.Uint64(b) != n.RequestID || !bytes.Equal(b[8:], n.Data) {
			t.Fatalf("%+v encodes as %x", n, b)
		}
		got, err := control.DecodeNotification(b)
		if err != nil || got.RequestID != n.RequestID || !bytes.Equal(got.Data, n.Data) {
			t.Fatalf("%+v: decoded %+v, %v", n, got, err)
		}
		// Data is a copy: the receive buffer may be reused.
		if len(b) > 8 {
			b[8] ^= 0xff
			if got.Data[0] == b[8] {
				t.Fatalf("decoded Data aliases the input")
			}
		}
	}
}

func TestNotificationRejections(t *testing.T) {
	for n := 0; n < 8; n++ {
		_, err := control.DecodeNotification(make([]byte, n))
		malformed(t, "NOTIFY body of "+strconv.Itoa(n)+" bytes", err)
	}
	for _, extra := range []int{control.MaxNotifyData + 1, control.MaxNotifyData + 8, 1 << 16} {
		_, err := control.DecodeNotification(make([]byte, 8+extra))
		malformed(t, "NOTIFY with "+strconv.Itoa(extra)+" bytes of data", err)
	}
	// Encode does not check the size, so a sender must: what it would
	// produce from too much data is refused by the receiver.
	over := control.Notification{RequestID: 1, Data: make([]byte, control.MaxNotifyData+1)}.Encode()
	_, err := control.DecodeNotification(over)
	malformed(t, "encoded NOTIFY with MaxNotifyData+1 bytes", err)
	if got, err := control.DecodeNotification(make([]byte, 8+control.MaxNotifyData)); err != nil || len(got.Data) != control.MaxNotifyData {
		t.Fatalf("NOTIFY with exactly MaxNotifyData bytes: %d bytes, %v", len(got.Data), err)
	}
	got, err := control.DecodeNotification(make([]byte, 8))
	if err != nil || !reflect.DeepEqual(got, control.Notification{}) {
		t.Fatalf("NOTIFY of 8 zero bytes: %+v, %v; want request 0 without data", got, err)
	}
}

func TestOneWayTypes(t *testing.T) {
	for typ := control.MsgType(0); typ < 12; typ++ {
		oneway := typ == control.MsgAbort || typ == control.MsgAbortAck || typ == control.MsgCanceled
		if typ.IsOneWay() != oneway {
			t.Errorf("%v.IsOneWay() = %v", typ, typ.IsOneWay())
		}
		if oneway && typ.IsReply() {
			t.Errorf("%v is both one-way and a reply", typ)
		}
	}
	if !control.MsgNotifyAck.IsReply() || control.MsgNotify.IsReply() {
		t.Error("NOTIFY is a request answered by NOTIFY_ACK")
	}
	for typ, want := range map[control.MsgType]string{control.MsgAbort: "ABORT", control.MsgAbortAck: "ABORT_ACK",
		control.MsgNotify: "NOTIFY", control.MsgNotifyAck: "NOTIFY_ACK", control.MsgCanceled: "CANCELED"} {
		if typ.String() != want {
			t.Errorf("%d.String() = %q, want %q", uint8(typ), typ.String(), want)
		}
	}
}
