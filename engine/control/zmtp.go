package control

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// The plane speaks ZMTP 3.0 with the NULL mechanism itself, over libzmq
// STREAM sockets, instead of letting libzmq's ROUTER and DEALER parse it.
// libzmq's own parser checks ZMQ_MAXMSGSIZE per frame only and holds every
// frame of a message until its last one arrives, so one peer sending a
// message of endless frames made the engine buffer without limit. Parsing
// the frames ourselves, the plane decides before it buffers a byte: a frame
// is kept only while the message stays within its limits and the plane's
// budget, and anything beyond is dropped as it streams past. The wire is
// unchanged, so libzmq DEALER and ROUTER sockets remain valid peers.

// zmtpGreetingSize is the fixed size of a ZMTP 3 greeting.
const zmtpGreetingSize = 64

// maxCommandSize caps a ZMTP command frame (READY and any other): a READY
// carries two short properties.
const maxCommandSize = 1024

// ZMTP frame flag bits.
const (
	zmtpMore    = 0x01
	zmtpLong    = 0x02
	zmtpCommand = 0x04
)

// errProtocol marks a connection that broke ZMTP framing: it is closed.
var errProtocol = errors.New("control: ZMTP protocol error")

// zmtpGreeting returns our greeting: ZMTP 3.0, NULL mechanism, not a server.
func zmtpGreeting() []byte {
	g := make([]byte, zmtpGreetingSize)
	g[0], g[9] = 0xff, 0x7f
	g[10], g[11] = 3, 0
	copy(g[12:32], "NULL")
	return g
}

// zmtpReady returns the READY command frame announcing socketType and, when
// not empty, identity (the routing id a ROUTER peer addresses us by).
func zmtpReady(socketType, identity string) []byte {
	return appendFrame(nil, appendProps(append([]byte{5}, "READY"...), socketType, identity), zmtpCommand)
}

// appendProps appends ZMTP metadata: Socket-Type and, when set, Identity.
func appendProps(b []byte, socketType, identity string) []byte {
	prop := func(name, value string) {
		b = append(b, byte(len(name)))
		b = append(b, name...)
		b = binary.BigEndian.AppendUint32(b, uint32(len(value)))
		b = append(b, value...)
	}
	prop("Socket-Type", socketType)
	if identity != "" {
		prop("Identity", identity)
	}
	return b
}

// parseProps reads ZMTP metadata (READY's, or CURVE's INITIATE and READY
// boxes), keeping Socket-Type and Identity; Socket-Type is required.
func parseProps(props []byte) (socketType, identity string, err error) {
	for len(props) > 0 {
		nl := int(props[0])
		if len(props) < 1+nl+4 {
			return "", "", fmt.Errorf("property truncated")
		}
		name := string(props[1 : 1+nl])
		vl := binary.BigEndian.Uint32(props[1+nl:])
		props = props[1+nl+4:]
		if uint64(vl) > uint64(len(props)) {
			return "", "", fmt.Errorf("property %q truncated", name)
		}
		switch name {
		case "Socket-Type":
			socketType = string(props[:vl])
		case "Identity":
			identity = string(props[:vl])
		}
		props = props[vl:]
	}
	if socketType == "" {
		return "", "", fmt.Errorf("no Socket-Type")
	}
	return socketType, identity, nil
}

// appendFrame appends one ZMTP frame holding data, with the given flag bits
// (zmtpMore, zmtpCommand).
func appendFrame(b, data []byte, flags byte) []byte {
	if len(data) > 255 {
		b = append(b, flags|zmtpLong)
		b = binary.BigEndian.AppendUint64(b, uint64(len(data)))
	} else {
		b = append(b, flags, byte(len(data)))
	}
	return append(b, data...)
}

// encodeMessage returns the wire bytes of a message of frames.
func encodeMessage(frames [][]byte) []byte {
	n := 0
	for _, f := range frames {
		n += 9 + len(f)
	}
	b := make([]byte, 0, n)
	for i, f := range frames {
		var flags byte
		if i < len(frames)-1 {
			flags = zmtpMore
		}
		b = appendFrame(b, f, flags)
	}
	return b
}

// smallFrame is the largest frame kept without asking the plane's budget:
// envelopes and most bodies are far smaller, so a peer that spent the budget
// on large messages cannot starve the others' requests, and one message in
// progress per connection keeps these to 64 KiB per connection.
const smallFrame = 64 << 10

// zmtpLimits bound what a zmtpReader keeps of one message.
type zmtpLimits struct {
	maxFrames int    // frames of one message; more make it malformed
	maxFrame  uint64 // one frame's size; more breaks the connection, as ZMQ_MAXMSGSIZE did
	maxBytes  uint64 // all frames of one message; more make it malformed
}

// zmtpReader parses one connection's bytes: the peer's greeting, its READY
// command, then messages. It keeps at most one message's frames, and only
// while they stay within its limits and what reserve grants; a message past
// them is dropped as its bytes arrive.
type zmtpReader struct {
	lim zmtpLimits
	// reserve asks the plane for n more bytes of buffer; false refuses (the
	// plane's budget is spent) and the message is dropped. release returns
	// bytes. Both may be nil (no budget).
	reserve func(n uint64) bool
	release func(n uint64)
	// onReady runs when the peer's READY arrives, before any message; an
	// error breaks the connection.
	onReady func() error

	greeting   [zmtpGreetingSize]byte
	greetingN  int
	ready      bool   // the peer's READY arrived
	socketType string // from READY
	identity   string // from READY; empty when the peer sent none

	hdr   [9]byte
	hdrN  int
	flags byte
	size  uint64 // of the frame being read
	got   uint64 // bytes of it read
	inHdr bool   // between frames: reading a header

	frame    []byte   // the frame being kept, nil when skipped
	frames   [][]byte // kept frames of the message in progress
	nframes  int      // frames of the message in progress, kept or not
	held     uint64   // bytes reserved for frames and frame
	msgBytes uint64
	bad      error // why the message in progress is dropped
	inMsg    bool  // a message has started and not ended
}

func newZMTPReader(lim zmtpLimits, reserve func(uint64) bool, release func(uint64)) *zmtpReader {
	return &zmtpReader{lim: lim, reserve: reserve, release: release, inHdr: true}
}

// inMessage reports whether a message (or the handshake) is partly read.
func (r *zmtpReader) inMessage() bool {
	return r.inMsg || (r.greetingN > 0 && !r.ready)
}

// drop releases whatever the reader holds; call it when its connection ends.
func (r *zmtpReader) drop() {
	if r.held > 0 && r.release != nil {
		r.release(r.held)
	}
	r.held, r.frame, r.frames = 0, nil, nil
}

// feed parses data. For each message that ends it calls emit with the
// frames, or with a nil frames and the reason it was dropped. An error
// means the connection broke the protocol and must be closed; the reader is
// then unusable.
func (r *zmtpReader) feed(data []byte, emit func(frames [][]byte, dropped error)) error {
	for len(data) > 0 {
		if r.greetingN < zmtpGreetingSize {
			n := copy(r.greeting[r.greetingN:], data)
			r.greetingN += n
			data = data[n:]
			if r.greetingN == zmtpGreetingSize {
				if err := checkGreeting(r.greeting[:]); err != nil {
					return err
				}
			}
			continue
		}
		if r.inHdr {
			need := 2
			if r.hdrN > 0 && r.hdr[0]&zmtpLong != 0 {
				need = 9
			}
			n := copy(r.hdr[r.hdrN:need], data)
			r.hdrN += n
			data = data[n:]
			if r.hdrN < need {
				continue
			}
			if need == 2 && r.hdr[0]&zmtpLong != 0 {
				continue // the long size follows
			}
			if err := r.startFrame(); err != nil {
				return err
			}
			if r.size > 0 {
				continue
			}
		} else {
			n := uint64(len(data))
			if left := r.size - r.got; n > left {
				n = left
			}
			if r.frame != nil {
				r.frame = append(r.frame, data[:n]...)
			}
			r.got += n
			data = data[n:]
			if r.got < r.size {
				continue
			}
		}
		if err := r.endFrame(emit); err != nil {
			return err
		}
	}
	return nil
}

func checkGreeting(g []byte) error {
	if g[0] != 0xff || g[9]&1 != 1 {
		return fmt.Errorf("%w: not a ZMTP 3 greeting", errProtocol)
	}
	if g[10] < 3 {
		return fmt.Errorf("%w: ZMTP version %d.%d, want 3", errProtocol, g[10], g[11])
	}
	mech := g[12:32]
	if string(mech[:4]) != "NULL" || !allZero(mech[4:]) {
		return fmt.Errorf("%w: security mechanism %q, want NULL", errProtocol, trimZero(mech))
	}
	return nil
}

// startFrame takes a complete frame header and decides whether the frame
// is kept, dropped with its message, or breaks the connection.
func (r *zmtpReader) startFrame() error {
	r.flags = r.hdr[0]
	if r.flags&^(zmtpMore|zmtpLong|zmtpCommand) != 0 {
		return fmt.Errorf("%w: frame flags %#x", errProtocol, r.flags)
	}
	if r.flags&zmtpLong != 0 {
		r.size = binary.BigEndian.Uint64(r.hdr[1:9])
	} else {
		r.size = uint64(r.hdr[1])
	}
	r.hdrN, r.got, r.inHdr = 0, 0, false
	if r.flags&zmtpCommand != 0 {
		if r.flags&zmtpMore != 0 || r.inMsg {
			return fmt.Errorf("%w: command frame inside a message", errProtocol)
		}
		if r.size > maxCommandSize {
			return fmt.Errorf("%w: command of %d bytes (at most %d)", errProtocol, r.size, maxCommandSize)
		}
		r.frame = make([]byte, 0, r.size)
		return nil
	}
	if !r.ready {
		return fmt.Errorf("%w: message before READY", errProtocol)
	}
	if r.size > r.lim.maxFrame {
		return fmt.Errorf("%w: frame of %d bytes (at most %d)", errProtocol, r.size, r.lim.maxFrame)
	}
	r.inMsg = true
	r.nframes++
	r.msgBytes += r.size
	switch {
	case r.bad != nil:
	case r.nframes > r.lim.maxFrames:
		r.bad = fmt.Errorf("%w: more than %d frames", ErrMalformed, r.lim.maxFrames)
	case r.msgBytes > r.lim.maxBytes:
		r.bad = fmt.Errorf("%w: message of more than %d bytes", ErrMalformed, r.lim.maxBytes)
	case r.size > smallFrame && r.reserve != nil && !r.reserve(r.size):
		r.bad = fmt.Errorf("%w: %d bytes past the control plane's buffer budget", ErrOverBudget, r.size)
	default:
		if r.size > smallFrame {
			r.held += r.size
		}
		r.frame = make([]byte, 0, r.size)
		return nil
	}
	// The message is dropped: free what it held and keep nothing more.
	if r.held > 0 && r.release != nil {
		r.release(r.held)
	}
	r.held, r.frames, r.frame = 0, nil, nil
	return nil
}

// endFrame takes a complete frame.
func (r *zmtpReader) endFrame(emit func([][]byte, error)) error {
	r.inHdr = true
	if r.flags&zmtpCommand != 0 {
		cmd := r.frame
		r.frame = nil
		if !r.ready {
			return r.takeReady(cmd)
		}
		return nil // other commands (ZMTP 3.1 PING, ...) carry nothing we need
	}
	if r.frame != nil {
		r.frames = append(r.frames, r.frame)
		r.frame = nil
	}
	if r.flags&zmtpMore != 0 {
		return nil
	}
	frames, bad := r.frames, r.bad
	if r.held > 0 && r.release != nil {
		r.release(r.held)
	}
	r.frames, r.held, r.nframes, r.msgBytes, r.bad, r.inMsg = nil, 0, 0, 0, nil, false
	if bad != nil {
		emit(nil, bad)
	} else {
		emit(frames, nil)
	}
	return nil
}

// takeReady parses the peer's READY command.
func (r *zmtpReader) takeReady(cmd []byte) error {
	if len(cmd) < 6 || cmd[0] != 5 || string(cmd[1:6]) != "READY" {
		return fmt.Errorf("%w: first command is not READY", errProtocol)
	}
	st, id, err := parseProps(cmd[6:])
	if err != nil {
		return fmt.Errorf("%w: READY: %v", errProtocol, err)
	}
	r.socketType, r.identity = st, id
	r.ready = true
	if r.onReady != nil {
		return r.onReady()
	}
	return nil
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

func trimZero(b []byte) string {
	for i, c := range b {
		if c == 0 {
			return string(b[:i])
		}
	}
	return string(b)
}
