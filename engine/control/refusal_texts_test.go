package control_test

// The words of every refusal and every type name, pinned: they reach logs
// and users, and each decoder checks its fields in a fixed order (length,
// reserved fields, then values), so a peer's bad message is always
// explained by the same first fault.

import (
	"fmt"
	"testing"

	"github.com/kvferry/kvferry/engine/control"
)

// errText is err's text, "" for none; it drops the decoded value.
func errText[T any](_ T, err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

func TestDecodersRefuseEachSeedWithItsOwnText(t *testing.T) {
	const m = "malformed control message: "
	for _, c := range []struct {
		what   string
		seeds  []namedSeed
		decode func([]byte) string
		want   map[string]string // by seed name; a seed not named is accepted
	}{
		{"ABORT", abortMsgSeeds(), func(b []byte) string { return errText(control.DecodeAbortMsg(b)) }, map[string]string{
			"empty":         m + "ABORT body of 0 bytes, want 16",
			"truncated":     m + "ABORT body of 15 bytes, want 16",
			"one_byte_long": m + "ABORT body of 17 bytes, want 16",
			"ack_sized":     m + "ABORT body of 24 bytes, want 16",
			"reserved_low":  m + "ABORT reserved field 0x1 is not zero",
			"reserved_high": m + "ABORT reserved field 0x80000000 is not zero",
			"request_id_0":  m + "ABORT of request id 0",
		}},
		{"ABORT_ACK", abortAckSeeds(), func(b []byte) string { return errText(control.DecodeAbortAck(b)) }, map[string]string{
			"empty":         m + "ABORT_ACK body of 0 bytes, want 24",
			"truncated":     m + "ABORT_ACK body of 23 bytes, want 24",
			"one_byte_long": m + "ABORT_ACK body of 25 bytes, want 24",
			"abort_sized":   m + "ABORT_ACK body of 16 bytes, want 24",
			"outcome_0":     m + "ABORT_ACK outcome 0",
			"outcome_4":     m + "ABORT_ACK outcome 4",
			"outcome_255":   m + "ABORT_ACK outcome 255",
			"reserved_13":   m + "ABORT_ACK reserved bytes are not zero",
			"reserved_15":   m + "ABORT_ACK reserved bytes are not zero",
			"request_id_0":  m + "ABORT_ACK of request id 0",
		}},
		{"NOTIFY", notificationSeeds(), func(b []byte) string { return errText(control.DecodeNotification(b)) }, map[string]string{
			"empty":              m + "NOTIFY body of 0 bytes, want 8 to 72",
			"truncated_id":       m + "NOTIFY body of 7 bytes, want 8 to 72",
			"data_one_byte_long": m + "NOTIFY body of 73 bytes, want 8 to 72",
			"data_1k":            m + "NOTIFY body of 1032 bytes, want 8 to 72",
		}},
		{"FENCE", fenceMsgSeeds(), func(b []byte) string { return errText(control.DecodeFenceMsg(b)) }, map[string]string{
			"empty":             m + "FENCE body of 0 bytes",
			"header_short":      m + "FENCE body of 23 bytes",
			"range_short":       m + "FENCE of 2 ranges in 55 bytes",
			"one_byte_long":     m + "FENCE of 2 ranges in 57 bytes",
			"epoch_0":           m + "FENCE epoch 0 with floor 3",
			"floor_above_epoch": m + "FENCE epoch 7 with floor 8",
			"reserved":          m + "FENCE reserved field 0x1 is not zero",
			"count_too_big":     m + "FENCE of 3 ranges in 56 bytes",
			"count_huge":        m + "FENCE of 4294967295 ranges in 56 bytes",
			"range_empty":       m + "FENCE range 0 [0x1000, +0) is empty or wraps",
			"range_wraps":       m + "FENCE range 0 [0xffffffffffffffff, +2) is empty or wraps",
			"range_wraps_to_0":  m + "FENCE range 0 [0x8000000000000000, +9223372036854775808) is empty or wraps",
		}},
		{"FENCE_ACK", fenceAckSeeds(), func(b []byte) string { return errText(control.DecodeFenceAck(b)) }, map[string]string{
			"empty":         m + "FENCE_ACK body of 0 bytes, want 16",
			"truncated":     m + "FENCE_ACK body of 15 bytes, want 16",
			"one_byte_long": m + "FENCE_ACK body of 17 bytes, want 16",
			"epoch_0":       m + "FENCE_ACK of epoch 0",
			"reserved_low":  m + "FENCE_ACK reserved field 0x1 is not zero",
			"reserved_high": m + "FENCE_ACK reserved field 0x8000000000000000 is not zero",
		}},
		{"envelope", envelopeSeeds(), func(b []byte) string { return errText(control.DecodeEnvelope(b)) }, map[string]string{
			"status_and_reserved_set": m + "reserved bytes 0x7 0xff 0xff are not zero",
			"empty":                   m + "envelope of 0 bytes, want 16",
			"truncated":               m + "envelope of 15 bytes, want 16",
			"one_byte_long":           m + "envelope of 17 bytes, want 16",
			"bad_magic":               m + "magic 0x4b43",
			"bad_version_0":           m + "protocol version 0, want 1",
			"bad_version_2":           m + "protocol version 2, want 1",
			"type_0":                  m + "type 0",
			"type_255":                m + "type 255",
			"flags_2":                 m + "flags 0x2",
			"flags_ff":                m + "flags 0xff",
		}},
	} {
		for _, s := range c.seeds {
			if got := c.decode(s.data); got != c.want[s.name] {
				t.Errorf("%s/%s: %q, want %q", c.what, s.name, got, c.want[s.name])
			}
		}
	}
}

func TestDecodersReportTheFirstFaultInLayoutOrder(t *testing.T) {
	const m = "malformed control message: "
	abort := control.AbortMsg{Generation: 1}.Encode() // request id 0
	ack := control.AbortAck{Outcome: control.AckCut}.Encode()
	fence := control.FenceMsg{Floor: 2}.Encode() // epoch 0, floor above it
	fenceAck := control.FenceAck{}.Encode()
	for _, c := range []struct {
		name, got, want string
	}{
		{"ABORT with its reserved field set and request id 0",
			errText(control.DecodeAbortMsg(patch(abort, 12, 0xff, 0xff, 0xff, 0xff))), m + "ABORT reserved field 0xffffffff is not zero"},
		{"ABORT_ACK with reserved bytes, outcome 0 and request id 0",
			errText(control.DecodeAbortAck(patch(ack, 12, 0, 0, 1))), m + "ABORT_ACK reserved bytes are not zero"},
		{"ABORT_ACK with outcome 9 and request id 0",
			errText(control.DecodeAbortAck(patch(ack, 12, 9))), m + "ABORT_ACK outcome 9"},
		{"FENCE with its reserved field set, epoch 0 and a count past its bytes",
			errText(control.DecodeFenceMsg(patch(fence, 16, 5, 0, 0, 0, 0, 0, 0, 0x80))), m + "FENCE reserved field 0x80000000 is not zero"},
		{"FENCE of epoch 0 with a count past its bytes",
			errText(control.DecodeFenceMsg(patch(fence, 16, 5))), m + "FENCE epoch 0 with floor 2"},
		{"FENCE_ACK with its reserved field set and epoch 0",
			errText(control.DecodeFenceAck(patch(fenceAck, 8, 0, 0, 0, 0, 0, 0, 0, 1))), m + "FENCE_ACK reserved field 0x100000000000000 is not zero"},
	} {
		if c.got != c.want {
			t.Errorf("%s: %q, want %q", c.name, c.got, c.want)
		}
	}
}

func TestMsgTypeAndAckOutcomeNameEveryValue(t *testing.T) {
	types := map[control.MsgType]string{
		control.MsgGetDescriptor: "GET_DESCRIPTOR", control.MsgDescriptor: "DESCRIPTOR", control.MsgPing: "PING",
		control.MsgPong: "PONG", control.MsgError: "ERROR", control.MsgAbort: "ABORT", control.MsgAbortAck: "ABORT_ACK",
		control.MsgNotify: "NOTIFY", control.MsgNotifyAck: "NOTIFY_ACK", control.MsgCanceled: "CANCELED",
		control.MsgTransport: "TRANSPORT", control.MsgTransportRep: "TRANSPORT_REPLY", control.MsgFence: "FENCE",
		control.MsgFenceAck: "FENCE_ACK",
	}
	outcomes := map[control.AckOutcome]string{control.AckDrained: "drained", control.AckCut: "cut", control.AckHeard: "heard"}
	for v := range 256 {
		want, ok := types[control.MsgType(v)]
		if !ok {
			want = fmt.Sprintf("MsgType(%d)", v)
		}
		if got := control.MsgType(v).String(); got != want {
			t.Errorf("MsgType %d: %q, want %q", v, got, want)
		}
		if want, ok = outcomes[control.AckOutcome(v)]; !ok {
			want = fmt.Sprintf("AckOutcome(%d)", v)
		}
		if got := control.AckOutcome(v).String(); got != want {
			t.Errorf("AckOutcome %d: %q, want %q", v, got, want)
		}
	}
}
