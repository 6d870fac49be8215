package control

import (
	"testing"
	"time"
)

// A field not set (zero, or negative where it can be) takes its default;
// a set one is kept.
func TestPlaneOptionsFillTakesTheDefaultOfEveryFieldNotPositive(t *testing.T) {
	def := Options{MaxConns: DefaultMaxConns, MaxConnsPerHost: DefaultMaxConnsPerHost, BufferBytes: DefaultBufferBytes,
		HandshakeTimeout: DefaultHandshakeTimeout, MessageTimeout: DefaultMessageTimeout, MaxQueued: DefaultMaxQueued,
		PeerIdleTimeout: DefaultPeerIdleTimeout}
	set := Options{MaxConns: 1, MaxConnsPerHost: 2, BufferBytes: 1<<64 - 1, HandshakeTimeout: time.Nanosecond,
		MessageTimeout: 4, MaxQueued: 5, PeerIdleTimeout: 6}
	for _, c := range []struct{ in, want Options }{
		{Options{}, def},
		{Options{MaxConns: -1, MaxConnsPerHost: -1, HandshakeTimeout: -1, MessageTimeout: -time.Hour, MaxQueued: -1,
			PeerIdleTimeout: -1}, def},
		{set, set},
	} {
		got := c.in
		got.fill()
		if got != c.want {
			t.Errorf("%+v filled to %+v, want %+v", c.in, got, c.want)
		}
	}
}
