package rdma

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/internal/wire"
)

// The rdma transport's own messages ride the control plane as TRANSPORT
// requests: the first byte says which. Every field is little endian and
// every count is checked against the bytes present before anything is
// allocated.
const (
	wireVersion = 3

	kindInfo       = 1 // -> infoReply: the owner's NICs and preference matrix
	kindConnect    = 2 // -> connectReply: responder QPs for the initiator's QPs
	kindKeys       = 3 // -> keysReply: the rkeys of one registration
	kindDisconnect = 4 // -> empty: the initiator gave up a connection
	kindRelease    = 5 // -> empty: the initiator dropped the rkeys of some request ids

	maxRelease = 4096 // request ids per release

	maxNICs      = 32
	maxPairs     = 64
	maxPieces    = 4096
	maxName      = 64
	maxLocations = 64
)

// ErrMalformed marks a handshake message that does not decode, or names
// what does not exist (a NIC past the owner's): the peer's fault. Serve's
// other errors are refusals (a cap reached, a fence owed) or failures here
// (a verbs call), which callers must not count as malformed input.
var ErrMalformed = errors.New("malformed rdma message")

// nicInfo is what a peer needs to address one of our NICs.
type nicInfo struct {
	Name     string
	Port     uint8
	Ethernet bool
	MTU      uint8
	LID      uint16
	GID      [16]byte
	GIDIndex uint8
	NUMA     int16
	PCI      string
}

// infoReply describes an owner's NICs and, per memory location, the order
// in which its NICs should be used (Mooncake's priority matrix) and each
// entry's tier in that order: entries of one tier are equally good, and an
// initiator spreads its work across them.
type infoReply struct {
	NICs   []nicInfo
	Matrix map[string][]uint8
	Tiers  map[string][]uint8 // per location, the tier of each Matrix entry
}

// qpInfo is one end of an RC connection.
type qpInfo struct {
	QPN uint32
	PSN uint32
}

// pairReq asks the owner for a responder QP on its NIC Remote connected to
// the initiator's QP on its NIC Local.
type pairReq struct {
	Slot     uint8 // the initiator's pair slot: a reconnect replaces it
	Local    uint8
	Remote   uint8
	QP       qpInfo
	LID      uint16
	GID      [16]byte
	Ethernet bool
	MTU      uint8
}

type connectReq struct {
	Conn  uint64
	Pairs []pairReq
}

type connectReply struct {
	QPs []qpInfo
}

// keysReq names one registration of the owner and the access about to use
// it (the whole transfer's range), which the owner admits like any other.
type keysReq struct {
	// Conn is the asking path's connection id and Seq its count of keys
	// requests: a release names the Seq it follows, so a release that
	// overtakes a later request of the same request id undoes nothing.
	Conn, Seq  uint64
	Key        uint64
	Op         uint8
	RequestID  uint64
	Generation uint32
	GrantID    uint64
	Addr       uint64
	Len        uint64
	// FenceEpoch is the owner's fence epoch the access was planned under
	// (see transport.Access.Epoch).
	FenceEpoch uint64
}

// piece is one memory region of a registration on every owner NIC (a
// registration larger than a device's max MR size is split).
type piece struct {
	Off   uint64
	Len   uint64
	RKeys []uint32 // per owner NIC
}

type keysReply struct {
	Addr     uint64
	Len      uint64
	Location string
	// Admitted is the range the owner admitted the access for: the
	// initiator uses these rkeys for this request inside it only.
	Admitted transport.Span
	Pieces   []piece
}

// readGID reads a 16-byte GID.
func readGID(r *wire.Reader) (g [16]byte) {
	copy(g[:], r.Take(16))
	return g
}

// newReader reads an rdma message.
func newReader(b []byte) *wire.Reader { return &wire.Reader{B: b, Malformed: ErrMalformed} }

func putStr(b []byte, s string) []byte {
	b = append(b, byte(len(s)))
	return append(b, s...)
}

func (m *infoReply) encode() []byte {
	b := []byte{kindInfo, wireVersion, byte(len(m.NICs))}
	for _, n := range m.NICs {
		b = putStr(b, n.Name)
		b = append(b, n.Port, boolByte(n.Ethernet), n.MTU, n.GIDIndex)
		b = binary.LittleEndian.AppendUint16(b, n.LID)
		b = append(b, n.GID[:]...)
		b = binary.LittleEndian.AppendUint16(b, uint16(n.NUMA))
		b = putStr(b, n.PCI)
	}
	b = append(b, byte(len(m.Matrix)))
	for _, loc := range sortedKeys(m.Matrix) {
		b = putStr(b, loc)
		b = append(b, byte(len(m.Matrix[loc])))
		b = append(b, m.Matrix[loc]...)
		tiers := m.Tiers[loc]
		for i := range m.Matrix[loc] {
			var tier uint8
			if i < len(tiers) {
				tier = tiers[i]
			}
			b = append(b, tier)
		}
	}
	return b
}

func decodeInfo(body []byte) (*infoReply, error) {
	r := newReader(body)
	if r.U8() != kindInfo || r.U8() != wireVersion {
		return nil, fmt.Errorf("%w: not an info reply of version %d", ErrMalformed, wireVersion)
	}
	n := int(r.U8())
	if n == 0 || n > maxNICs {
		return nil, fmt.Errorf("%w: %d NICs", ErrMalformed, n)
	}
	m := &infoReply{NICs: make([]nicInfo, n), Matrix: map[string][]uint8{}, Tiers: map[string][]uint8{}}
	for i := range m.NICs {
		x := &m.NICs[i]
		x.Name = r.Str(maxName)
		x.Port, x.Ethernet, x.MTU, x.GIDIndex = r.U8(), r.U8() == 1, r.U8(), r.U8()
		x.LID = r.U16()
		x.GID = readGID(r)
		x.NUMA = int16(r.U16())
		x.PCI = r.Str(maxName)
		if r.Err == nil && (x.MTU < 1 || x.MTU > 5) {
			return nil, fmt.Errorf("%w: NIC %d has MTU code %d", ErrMalformed, i, x.MTU)
		}
	}
	locs := int(r.U8())
	if locs > maxLocations {
		return nil, fmt.Errorf("%w: %d locations", ErrMalformed, locs)
	}
	for range locs {
		loc := r.Str(maxName)
		k := int(r.U8())
		idx := r.Take(k)
		tiers := r.Take(k)
		if r.Err != nil {
			break
		}
		for i, v := range idx {
			if int(v) >= n {
				return nil, fmt.Errorf("%w: location %q names NIC %d of %d", ErrMalformed, loc, v, n)
			}
			if int(tiers[i]) >= k || (i > 0 && tiers[i] < tiers[i-1]) {
				return nil, fmt.Errorf("%w: location %q: tiers %v are not in order", ErrMalformed, loc, tiers)
			}
		}
		m.Matrix[loc] = append([]uint8(nil), idx...)
		m.Tiers[loc] = append([]uint8(nil), tiers...)
	}
	if err := r.End(); err != nil {
		return nil, err
	}
	return m, nil
}

func (m *connectReq) encode() []byte {
	b := []byte{kindConnect, wireVersion}
	b = binary.LittleEndian.AppendUint64(b, m.Conn)
	b = append(b, byte(len(m.Pairs)))
	for _, p := range m.Pairs {
		b = append(b, p.Slot, p.Local, p.Remote, boolByte(p.Ethernet), p.MTU)
		b = binary.LittleEndian.AppendUint32(b, p.QP.QPN)
		b = binary.LittleEndian.AppendUint32(b, p.QP.PSN)
		b = binary.LittleEndian.AppendUint16(b, p.LID)
		b = append(b, p.GID[:]...)
	}
	return b
}

func decodeConnect(body []byte) (*connectReq, error) {
	r := newReader(body)
	if r.U8() != kindConnect || r.U8() != wireVersion {
		return nil, fmt.Errorf("%w: not a connect request of version %d", ErrMalformed, wireVersion)
	}
	m := &connectReq{Conn: r.U64()}
	n := int(r.U8())
	if n == 0 || n > maxPairs {
		return nil, fmt.Errorf("%w: %d pairs", ErrMalformed, n)
	}
	m.Pairs = make([]pairReq, n)
	for i := range m.Pairs {
		p := &m.Pairs[i]
		p.Slot, p.Local, p.Remote, p.Ethernet, p.MTU = r.U8(), r.U8(), r.U8(), r.U8() == 1, r.U8()
		p.QP.QPN, p.QP.PSN = r.U32(), r.U32()
		p.LID = r.U16()
		p.GID = readGID(r)
		if r.Err == nil && (p.MTU < 1 || p.MTU > 5 || p.QP.QPN == 0 || p.QP.QPN > 0xffffff || p.QP.PSN > 0xffffff) {
			return nil, fmt.Errorf("%w: pair %d: MTU code %d, QPN %#x, PSN %#x", ErrMalformed, i, p.MTU, p.QP.QPN, p.QP.PSN)
		}
	}
	if err := r.End(); err != nil {
		return nil, err
	}
	return m, nil
}

func (m *connectReply) encode() []byte {
	b := []byte{kindConnect, wireVersion, byte(len(m.QPs))}
	for _, q := range m.QPs {
		b = binary.LittleEndian.AppendUint32(b, q.QPN)
		b = binary.LittleEndian.AppendUint32(b, q.PSN)
	}
	return b
}

func decodeConnectReply(body []byte, want int) (*connectReply, error) {
	r := newReader(body)
	if r.U8() != kindConnect || r.U8() != wireVersion {
		return nil, fmt.Errorf("%w: not a connect reply of version %d", ErrMalformed, wireVersion)
	}
	n := int(r.U8())
	if n != want {
		return nil, fmt.Errorf("%w: %d QPs for %d pairs", ErrMalformed, n, want)
	}
	m := &connectReply{QPs: make([]qpInfo, n)}
	for i := range m.QPs {
		m.QPs[i] = qpInfo{QPN: r.U32(), PSN: r.U32()}
		if r.Err == nil && (m.QPs[i].QPN == 0 || m.QPs[i].QPN > 0xffffff || m.QPs[i].PSN > 0xffffff) {
			return nil, fmt.Errorf("%w: QP %d: QPN %#x PSN %#x", ErrMalformed, i, m.QPs[i].QPN, m.QPs[i].PSN)
		}
	}
	if err := r.End(); err != nil {
		return nil, err
	}
	return m, nil
}

func (m *keysReq) encode() []byte {
	b := []byte{kindKeys, wireVersion, m.Op}
	b = binary.LittleEndian.AppendUint64(b, m.Conn)
	b = binary.LittleEndian.AppendUint64(b, m.Seq)
	b = binary.LittleEndian.AppendUint64(b, m.Key)
	b = binary.LittleEndian.AppendUint64(b, m.RequestID)
	b = binary.LittleEndian.AppendUint32(b, m.Generation)
	b = binary.LittleEndian.AppendUint64(b, m.GrantID)
	b = binary.LittleEndian.AppendUint64(b, m.Addr)
	b = binary.LittleEndian.AppendUint64(b, m.Len)
	return binary.LittleEndian.AppendUint64(b, m.FenceEpoch)
}

func decodeKeys(body []byte) (*keysReq, error) {
	r := newReader(body)
	if r.U8() != kindKeys || r.U8() != wireVersion {
		return nil, fmt.Errorf("%w: not a keys request of version %d", ErrMalformed, wireVersion)
	}
	m := &keysReq{Op: r.U8(), Conn: r.U64(), Seq: r.U64(), Key: r.U64(), RequestID: r.U64(), Generation: r.U32(), GrantID: r.U64(), Addr: r.U64(), Len: r.U64(), FenceEpoch: r.U64()}
	if err := r.End(); err != nil {
		return nil, err
	}
	return m, nil
}

// releaseReq tells the owner that a path dropped its rkeys of RequestIDs
// after its keys request Seq and has no work of them out: the owner need
// not cut it when one of them is aborted.
type releaseReq struct {
	Conn, Seq  uint64
	RequestIDs []uint64
}

func (m *releaseReq) encode() []byte {
	b := []byte{kindRelease, wireVersion}
	b = binary.LittleEndian.AppendUint64(b, m.Conn)
	b = binary.LittleEndian.AppendUint64(b, m.Seq)
	b = binary.LittleEndian.AppendUint16(b, uint16(len(m.RequestIDs)))
	for _, rid := range m.RequestIDs {
		b = binary.LittleEndian.AppendUint64(b, rid)
	}
	return b
}

func decodeRelease(body []byte) (*releaseReq, error) {
	r := newReader(body)
	if r.U8() != kindRelease || r.U8() != wireVersion {
		return nil, fmt.Errorf("%w: not a release of version %d", ErrMalformed, wireVersion)
	}
	m := &releaseReq{Conn: r.U64(), Seq: r.U64()}
	n := int(r.U16())
	if r.Err != nil {
		return nil, r.Err
	}
	if n == 0 || n > maxRelease || len(r.B) != 8*n {
		return nil, fmt.Errorf("%w: release of %d request ids in %d bytes", ErrMalformed, n, len(r.B))
	}
	m.RequestIDs = make([]uint64, n)
	for i := range m.RequestIDs {
		m.RequestIDs[i] = r.U64()
	}
	if err := r.End(); err != nil {
		return nil, err
	}
	return m, nil
}

// Statuses of a keys reply that refuses.
const (
	keysOK      = 0
	keysRefused = 1
	keysAborted = 2
	keysFenced  = 3 // planned before a fence of a range it touches
)

// encodeKeysRefusal is the owner's refusal of a keys request, with its
// reason.
func encodeKeysRefusal(status uint8, reason string) []byte {
	if len(reason) > 255 {
		reason = reason[:255]
	}
	return putStr([]byte{kindKeys, wireVersion, status}, reason)
}

func (m *keysReply) encode() []byte {
	b := []byte{kindKeys, wireVersion, keysOK}
	b = binary.LittleEndian.AppendUint64(b, m.Addr)
	b = binary.LittleEndian.AppendUint64(b, m.Len)
	b = putStr(b, m.Location)
	b = binary.LittleEndian.AppendUint64(b, m.Admitted.Addr)
	b = binary.LittleEndian.AppendUint64(b, m.Admitted.Len)
	nics := 0
	if len(m.Pieces) > 0 {
		nics = len(m.Pieces[0].RKeys)
	}
	b = binary.LittleEndian.AppendUint16(b, uint16(len(m.Pieces)))
	b = append(b, byte(nics))
	for _, p := range m.Pieces {
		b = binary.LittleEndian.AppendUint64(b, p.Off)
		b = binary.LittleEndian.AppendUint64(b, p.Len)
		for _, k := range p.RKeys {
			b = binary.LittleEndian.AppendUint32(b, k)
		}
	}
	return b
}

// decodeKeysReply checks that the pieces tile [0, Len) in order, so a
// bad reply cannot make the initiator write outside what the owner named.
func decodeKeysReply(body []byte, wantNICs int) (*keysReply, error) {
	r := newReader(body)
	if r.U8() != kindKeys || r.U8() != wireVersion {
		return nil, fmt.Errorf("%w: not a keys reply of version %d", ErrMalformed, wireVersion)
	}
	switch st := r.U8(); st {
	case keysOK:
	case keysRefused, keysAborted, keysFenced:
		reason := r.Str(255)
		if err := r.End(); err != nil {
			return nil, err
		}
		if st == keysAborted {
			return nil, fmt.Errorf("%w: %w: %s", transport.ErrRefused, transport.ErrAborted, reason)
		}
		if st == keysFenced {
			return nil, fmt.Errorf("%w: %w: %s", transport.ErrRefused, transport.ErrFenced, reason)
		}
		return nil, fmt.Errorf("%w: %s", transport.ErrRefused, reason)
	default:
		return nil, fmt.Errorf("%w: keys status %d", ErrMalformed, st)
	}
	m := &keysReply{Addr: r.U64(), Len: r.U64(), Location: r.Str(maxName)}
	m.Admitted = transport.Span{Addr: r.U64(), Len: r.U64()}
	n := int(r.U16())
	nics := int(r.U8())
	if r.Err != nil {
		return nil, r.Err
	}
	if n == 0 || n > maxPieces || nics != wantNICs || m.Addr+m.Len < m.Addr || m.Len == 0 {
		return nil, fmt.Errorf("%w: %d pieces on %d NICs (want %d) for [%#x, +%d)", ErrMalformed, n, nics, wantNICs, m.Addr, m.Len)
	}
	if a := m.Admitted; a.Len == 0 || a.Addr < m.Addr || a.Addr-m.Addr > m.Len || a.Len > m.Len-(a.Addr-m.Addr) {
		return nil, fmt.Errorf("%w: admitted [%#x, +%d) is not inside the registration [%#x, +%d)", ErrMalformed, a.Addr, a.Len, m.Addr, m.Len)
	}
	if len(r.B) < n*(16+4*nics) {
		return nil, fmt.Errorf("%w: truncated pieces", ErrMalformed)
	}
	m.Pieces = make([]piece, n)
	var next uint64
	for i := range m.Pieces {
		p := &m.Pieces[i]
		p.Off, p.Len = r.U64(), r.U64()
		p.RKeys = make([]uint32, nics)
		for k := range p.RKeys {
			p.RKeys[k] = r.U32()
		}
		if p.Off != next || p.Len == 0 || p.Len > m.Len-p.Off {
			return nil, fmt.Errorf("%w: piece %d at +%d of %d bytes does not follow +%d within %d", ErrMalformed, i, p.Off, p.Len, next, m.Len)
		}
		next = p.Off + p.Len
	}
	if next != m.Len {
		return nil, fmt.Errorf("%w: pieces cover %d of %d bytes", ErrMalformed, next, m.Len)
	}
	if err := r.End(); err != nil {
		return nil, err
	}
	return m, nil
}

func boolByte(b bool) byte {
	if b {
		return 1
	}
	return 0
}
