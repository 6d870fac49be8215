package control

import (
	"testing"
)

// FuzzZMTPReader feeds arbitrary bytes, split at arbitrary points, after a
// valid handshake: the reader must never panic, never keep a message past
// its limits, and give back every byte it reserved.
func FuzzZMTPReader(f *testing.F) {
	hello := append(zmtpGreeting(), zmtpReady("DEALER", "127.0.0.1:1")...)
	ping := encodeMessage([][]byte{EncodeEnvelope(Envelope{Type: MsgPing, Corr: 1}), []byte("body")})
	f.Add(append(append([]byte{}, hello...), ping...), uint8(7))
	f.Add(append(append([]byte{}, hello...), 0x03, 0, 0, 0, 0, 0, 0x10, 0, 0), uint8(3))
	f.Add([]byte{0xff, 1, 2, 3}, uint8(1))
	f.Fuzz(func(t *testing.T, data []byte, step uint8) {
		lim := zmtpLimits{maxFrames: 2, maxFrame: 1 << 20, maxBytes: 1<<20 + 16}
		var held, peak uint64
		const budget = 256 << 10
		r := newZMTPReader(lim, func(n uint64) bool {
			if held+n > budget {
				return false
			}
			held += n
			peak = max(peak, held)
			return true
		}, func(n uint64) {
			if n > held {
				t.Fatalf("released %d of %d held", n, held)
			}
			held -= n
		})
		chunk := int(step%64) + 1
		for len(data) > 0 {
			n := min(chunk, len(data))
			err := r.feed(data[:n], func(frames [][]byte, dropped error) {
				if dropped == nil && (len(frames) > lim.maxFrames || len(frames) == 0) {
					t.Fatalf("emitted a message of %d frames", len(frames))
				}
				total := 0
				for _, fr := range frames {
					total += len(fr)
				}
				if uint64(total) > lim.maxBytes {
					t.Fatalf("emitted %d bytes, limit %d", total, lim.maxBytes)
				}
			})
			data = data[n:]
			if err != nil {
				break
			}
		}
		r.drop()
		if held != 0 {
			t.Fatalf("%d bytes still reserved after drop", held)
		}
		if peak > budget {
			t.Fatalf("peak %d past the budget %d", peak, budget)
		}
	})
}
