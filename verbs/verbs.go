// Package verbs is kvferry's thin layer over libibverbs (rdma-core): the
// library is opened at run time with dlopen, so a process without rdma-core
// still loads libkvferry.so and gets ErrNotAvailable, and every call that
// touches the data path (posting work requests, polling completions) crosses
// into C once per batch.
//
// The package knows nothing of the engine: it opens devices, allocates
// protection domains, completion queues and RC queue pairs, registers
// memory, and moves QPs through their states with the attribute masks the
// InfiniBand specification requires for each transition.
package verbs

/*
#cgo CFLAGS: -O2 -Wall
#cgo LDFLAGS: -ldl
#include <stdlib.h>
#include <infiniband/verbs.h>
#include "shim.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"unsafe"
)

// DefaultLibrary is the file opened when no other is named: the soname of
// rdma-core's libibverbs.
const DefaultLibrary = "libibverbs.so.1"

// Errors, matchable with errors.Is.
var (
	// ErrNotAvailable: libibverbs could not be loaded (not installed, or
	// the named file does not exist or is not a libibverbs).
	ErrNotAvailable = errors.New("rdma not available")
	// ErrNoDevice: libibverbs loaded but lists no usable device.
	ErrNoDevice = errors.New("no rdma device")
	// ErrClosed: the object was already destroyed.
	ErrClosed = errors.New("verbs object closed")
)

// Library is an opened libibverbs and its device list.
type Library struct {
	c    *C.kvfv_lib
	path string
	mu   sync.Mutex
}

var (
	libMu  sync.Mutex
	libMap = map[string]*Library{}
)

// Open loads libibverbs from path (DefaultLibrary when empty). A library is
// opened once per process and path and never unloaded: providers start
// threads that must not lose their code.
func Open(path string) (*Library, error) {
	if path == "" {
		path = DefaultLibrary
	}
	libMu.Lock()
	defer libMu.Unlock()
	if l := libMap[path]; l != nil {
		return l, nil
	}
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var errbuf [512]C.char
	var c *C.kvfv_lib
	if rc := C.kvfv_open(cpath, &c, &errbuf[0], C.size_t(len(errbuf))); rc != 0 {
		return nil, fmt.Errorf("%w: load %s: %s", ErrNotAvailable, path, C.GoString(&errbuf[0]))
	}
	l := &Library{c: c, path: path}
	libMap[path] = l
	return l, nil
}

// Path is the file the library was loaded from.
func (l *Library) Path() string { return l.path }

// HasRelaxedOrdering reports whether memory can be registered with relaxed
// PCIe ordering (the iova2 entry point exists; the device may still ignore
// the optional flag).
func (l *Library) HasRelaxedOrdering() bool {
	cs := C.CString("reg_mr_iova2")
	defer C.free(unsafe.Pointer(cs))
	return C.kvfv_has(l.c, cs) != 0
}

// Control calls a fake provider's test entry point fakeverbs_control(cmd).
// Real libibverbs has none: the error says so.
func (l *Library) Control(cmd string) error {
	sym := C.CString("fakeverbs_control")
	defer C.free(unsafe.Pointer(sym))
	cc := C.CString(cmd)
	defer C.free(unsafe.Pointer(cc))
	switch rc := C.kvfv_control(l.c, sym, cc); rc {
	case 0:
		return nil
	case C.ENOSYS:
		return fmt.Errorf("%s has no fakeverbs_control: not a fake provider", l.path)
	default:
		return fmt.Errorf("fakeverbs_control(%q): %w", cmd, syscall.Errno(rc))
	}
}

// WCStatusString is libibverbs' text for a completion status.
func (l *Library) WCStatusString(status uint32) string {
	return C.GoString(C.kvfv_wc_status_str(l.c, C.int(status)))
}

// DeviceAttr holds the device limits the transport uses.
type DeviceAttr struct {
	MaxMRSize       uint64
	NodeGUID        uint64
	MaxQP           int
	MaxQPWR         int
	MaxSGE          int
	MaxCQ           int
	MaxCQE          int
	MaxMR           int
	MaxQPRdAtom     int
	MaxQPInitRdAtom int
	PhysPortCnt     int
	FirmwareVersion string
}

// Link layers of a port.
const (
	LinkLayerUnspecified = C.IBV_LINK_LAYER_UNSPECIFIED
	LinkLayerInfiniBand  = C.IBV_LINK_LAYER_INFINIBAND
	LinkLayerEthernet    = C.IBV_LINK_LAYER_ETHERNET
)

// PortActive is the state of a port that can carry traffic.
const PortActive = C.IBV_PORT_ACTIVE

// Port describes one port of a device.
type Port struct {
	Num        int
	State      int
	MaxMTU     MTU
	ActiveMTU  MTU
	GIDTable   int
	MaxMsgSize uint32
	LID        uint16
	LinkLayer  int
	Speed      uint8 // IBV_SPEED_* code
	Width      uint8 // IBV_WIDTH_* code
	GID        [16]byte
	GIDIndex   int
}

// Active reports whether the port can carry traffic.
func (p Port) Active() bool { return p.State == PortActive }

// Ethernet reports a RoCE port (addressed by GID, never by LID).
func (p Port) Ethernet() bool { return p.LinkLayer == LinkLayerEthernet }

// Gbps is the port's signalling rate, from the speed and width codes.
func (p Port) Gbps() float64 {
	var lane float64
	switch p.Speed {
	case 1:
		lane = 2.5
	case 2:
		lane = 5
	case 4, 8:
		lane = 10
	case 16:
		lane = 14
	case 32:
		lane = 25
	case 64:
		lane = 50
	case 128:
		lane = 100
	}
	var lanes float64
	switch p.Width {
	case 1:
		lanes = 1
	case 2:
		lanes = 4
	case 4:
		lanes = 8
	case 8:
		lanes = 12
	case 16:
		lanes = 2
	}
	return lane * lanes
}

// MTU is an IBV_MTU_* code: 1 = 256 bytes ... 5 = 4096 bytes.
type MTU int

// Bytes is the MTU in bytes (0 for an unknown code).
func (m MTU) Bytes() int {
	if m < 1 || m > 5 {
		return 0
	}
	return 128 << m
}

// Device is one RDMA device as listed, with its limits and ports.
type Device struct {
	Index int
	Name  string
	// Path is the device's sysfs class directory (ibdev_path), where its
	// NUMA node and PCI address are read.
	Path  string
	GUID  uint64
	Attr  DeviceAttr
	Ports []Port
}

// DeviceCount is the number of devices libibverbs lists.
func (l *Library) DeviceCount() int { return int(C.kvfv_device_count(l.c)) }

// Devices lists every device with its attributes and ports; each is opened
// briefly to query it. A device that cannot be opened is skipped and named
// in the returned error's text only when none remains.
func (l *Library) Devices() ([]Device, error) {
	n := l.DeviceCount()
	var out []Device
	var errs []error
	for i := range n {
		d, err := l.describe(i)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		out = append(out, d)
	}
	if len(out) == 0 && len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return out, nil
}

func (l *Library) describe(i int) (Device, error) {
	var name, path [256]C.char
	var guid C.uint64_t
	if rc := C.kvfv_device_names(l.c, C.int(i), &name[0], 256, &path[0], 256, &guid); rc != 0 {
		return Device{}, fmt.Errorf("device %d: %w", i, syscall.Errno(rc))
	}
	d := Device{Index: i, Name: C.GoString(&name[0]), Path: C.GoString(&path[0]), GUID: uint64(guid)}
	ctx, err := l.OpenContext(i)
	if err != nil {
		return Device{}, err
	}
	defer ctx.Close()
	d.Attr = ctx.Attr
	d.Ports = ctx.Ports
	return d, nil
}

// Context is an opened device.
type Context struct {
	lib   *Library
	c     unsafe.Pointer
	Name  string
	Attr  DeviceAttr
	Ports []Port
}

// OpenContext opens device i of the list and queries its limits and ports.
func (l *Library) OpenContext(i int) (*Context, error) {
	var name, path [256]C.char
	var guid C.uint64_t
	if rc := C.kvfv_device_names(l.c, C.int(i), &name[0], 256, &path[0], 256, &guid); rc != 0 {
		return nil, fmt.Errorf("device %d: %w", i, syscall.Errno(rc))
	}
	devName := C.GoString(&name[0])
	var c unsafe.Pointer
	if rc := C.kvfv_open_device(l.c, C.int(i), &c); rc != 0 {
		return nil, fmt.Errorf("open device %s: %w", devName, syscall.Errno(rc))
	}
	ctx := &Context{lib: l, c: c, Name: devName}
	var a C.struct_kvfv_device_attr
	if rc := C.kvfv_query_device(l.c, c, &a); rc != 0 {
		_ = ctx.Close()
		return nil, fmt.Errorf("query device %s: %w", devName, syscall.Errno(rc))
	}
	ctx.Attr = DeviceAttr{
		MaxMRSize: uint64(a.max_mr_size), NodeGUID: uint64(a.node_guid), MaxQP: int(a.max_qp),
		MaxQPWR: int(a.max_qp_wr), MaxSGE: int(a.max_sge), MaxCQ: int(a.max_cq), MaxCQE: int(a.max_cqe),
		MaxMR: int(a.max_mr), MaxQPRdAtom: int(a.max_qp_rd_atom), MaxQPInitRdAtom: int(a.max_qp_init_rd_atom),
		PhysPortCnt: int(a.phys_port_cnt), FirmwareVersion: C.GoString(&a.fw_ver[0]),
	}
	for p := 1; p <= ctx.Attr.PhysPortCnt; p++ {
		var pa C.struct_kvfv_port_attr
		if rc := C.kvfv_query_port(l.c, c, C.int(p), &pa); rc != 0 {
			_ = ctx.Close()
			return nil, fmt.Errorf("query port %s/%d: %w", devName, p, syscall.Errno(rc))
		}
		port := Port{
			Num: p, State: int(pa.state), MaxMTU: MTU(pa.max_mtu), ActiveMTU: MTU(pa.active_mtu),
			GIDTable: int(pa.gid_tbl_len), MaxMsgSize: uint32(pa.max_msg_sz), LID: uint16(pa.lid),
			LinkLayer: int(pa.link_layer), Speed: uint8(pa.active_speed), Width: uint8(pa.active_width),
		}
		port.GIDIndex = -1
		best := -1
		for gi := 0; gi < max(port.GIDTable, 1) && gi < 256; gi++ {
			var gid [16]C.uint8_t
			if C.kvfv_query_gid(l.c, c, C.int(p), C.int(gi), &gid[0]) != 0 {
				break
			}
			var g [16]byte
			for k := range g {
				g[k] = byte(gid[k])
			}
			if g == ([16]byte{}) {
				continue
			}
			score := gidScore(C.GoString(&path[0]), p, gi, g, port.Ethernet())
			if score > best {
				best, port.GID, port.GIDIndex = score, g, gi
			}
		}
		ctx.Ports = append(ctx.Ports, port)
	}
	return ctx, nil
}

// gidScore ranks a GID table entry: on RoCE, RoCE v2 entries (routable,
// what mlx5 and every modern fabric use) beat v1 ones, IPv4-mapped beats
// link-local; sysfs says the type. On InfiniBand the first entry is right.
func gidScore(ibdevPath string, port, index int, g [16]byte, ethernet bool) int {
	if !ethernet {
		return 100 - min(index, 99)
	}
	score := 0
	typ, err := os.ReadFile(fmt.Sprintf("%s/ports/%d/gid_attrs/types/%d", ibdevPath, port, index))
	if err == nil && strings.Contains(strings.ToLower(string(typ)), "v2") {
		score += 4
	}
	ipv4 := g[10] == 0xff && g[11] == 0xff && g == [16]byte{10: 0xff, 11: 0xff, 12: g[12], 13: g[13], 14: g[14], 15: g[15]}
	if ipv4 {
		score += 2
	} else if !(g[0] == 0xfe && g[1]&0xc0 == 0x80) {
		score++ // global IPv6 beats link-local
	}
	return score
}

// Close closes the device. Every object made from it must be destroyed first.
func (c *Context) Close() error {
	if c.c == nil {
		return ErrClosed
	}
	rc := C.kvfv_close_device(c.lib.c, c.c)
	c.c = nil
	if rc != 0 {
		return fmt.Errorf("close device %s: %w", c.Name, syscall.Errno(rc))
	}
	return nil
}

// Port returns port num (1-based) of the device.
func (c *Context) Port(num int) (Port, bool) {
	if num < 1 || num > len(c.Ports) {
		return Port{}, false
	}
	return c.Ports[num-1], true
}

// Library returns the library the device was opened from.
func (c *Context) Library() *Library { return c.lib }

// PD is a protection domain.
type PD struct {
	ctx *Context
	c   unsafe.Pointer
}

// AllocPD allocates a protection domain.
func (c *Context) AllocPD() (*PD, error) {
	var p unsafe.Pointer
	if rc := C.kvfv_alloc_pd(c.lib.c, c.c, &p); rc != 0 {
		return nil, fmt.Errorf("alloc pd on %s: %w", c.Name, syscall.Errno(rc))
	}
	return &PD{ctx: c, c: p}, nil
}

// Dealloc frees the protection domain.
func (p *PD) Dealloc() error {
	if p.c == nil {
		return ErrClosed
	}
	rc := C.kvfv_dealloc_pd(p.ctx.lib.c, p.c)
	p.c = nil
	if rc != 0 {
		return fmt.Errorf("dealloc pd on %s: %w", p.ctx.Name, syscall.Errno(rc))
	}
	return nil
}

// Access flags of a memory registration or a QP.
type Access int

// The access flags.
const (
	AccessLocalWrite  Access = C.IBV_ACCESS_LOCAL_WRITE
	AccessRemoteWrite Access = C.IBV_ACCESS_REMOTE_WRITE
	AccessRemoteRead  Access = C.IBV_ACCESS_REMOTE_READ
)

// MR is a registered memory region.
type MR struct {
	pd   *PD
	c    unsafe.Pointer
	Addr uint64
	Len  uint64
	LKey uint32
	RKey uint32
}

// RegMR registers [addr, addr+n). relaxed asks for relaxed PCIe ordering
// where the library offers it. The memory must stay mapped until Dereg.
func (p *PD) RegMR(addr uint64, n uint64, access Access, relaxed bool) (*MR, error) {
	var m unsafe.Pointer
	var lkey, rkey C.uint32_t
	rel := C.int(0)
	if relaxed {
		rel = 1
	}
	if rc := C.kvfv_reg_mr(p.ctx.lib.c, p.c, C.uint64_t(addr), C.uint64_t(n), C.int(access), rel, &m, &lkey, &rkey); rc != 0 {
		return nil, fmt.Errorf("register [%#x, +%d) on %s: %w", addr, n, p.ctx.Name, syscall.Errno(rc))
	}
	return &MR{pd: p, c: m, Addr: addr, Len: n, LKey: uint32(lkey), RKey: uint32(rkey)}, nil
}

// RegDmabufMR registers n bytes of a dma-buf (GPU memory exported by the
// CUDA driver) from offset, seen by the NIC at address iova.
func (p *PD) RegDmabufMR(offset, n, iova uint64, fd int, access Access) (*MR, error) {
	var m unsafe.Pointer
	var lkey, rkey C.uint32_t
	if rc := C.kvfv_reg_dmabuf_mr(p.ctx.lib.c, p.c, C.uint64_t(offset), C.uint64_t(n), C.uint64_t(iova), C.int(fd), C.int(access), &m, &lkey, &rkey); rc != 0 {
		return nil, fmt.Errorf("register dma-buf %d [+%d, %d bytes] on %s: %w", fd, offset, n, p.ctx.Name, syscall.Errno(rc))
	}
	return &MR{pd: p, c: m, Addr: iova, Len: n, LKey: uint32(lkey), RKey: uint32(rkey)}, nil
}

// Dereg deregisters the region: once it returns, the device no longer reads
// or writes the range.
func (m *MR) Dereg() error {
	if m.c == nil {
		return ErrClosed
	}
	rc := C.kvfv_dereg_mr(m.pd.ctx.lib.c, m.c)
	if rc != 0 {
		// Still registered: the caller may try again; the range must
		// not be reused meanwhile.
		return fmt.Errorf("deregister [%#x, +%d) on %s: %w", m.Addr, m.Len, m.pd.ctx.Name, syscall.Errno(rc))
	}
	m.c = nil
	return nil
}

// CQ is a completion queue, polled (no completion channel).
type CQ struct {
	ctx  *Context
	c    unsafe.Pointer
	Size int
}

// CreateCQ creates a completion queue of at least n entries.
func (c *Context) CreateCQ(n int) (*CQ, error) {
	var q unsafe.Pointer
	if rc := C.kvfv_create_cq(c.lib.c, c.c, C.int(n), &q); rc != 0 {
		return nil, fmt.Errorf("create cq of %d on %s: %w", n, c.Name, syscall.Errno(rc))
	}
	return &CQ{ctx: c, c: q, Size: n}, nil
}

// Destroy destroys the queue; its QPs must be destroyed first.
func (q *CQ) Destroy() error {
	if q.c == nil {
		return ErrClosed
	}
	rc := C.kvfv_destroy_cq(q.ctx.lib.c, q.c)
	q.c = nil
	if rc != 0 {
		return fmt.Errorf("destroy cq on %s: %w", q.ctx.Name, syscall.Errno(rc))
	}
	return nil
}

// WC is one work completion. Its layout is struct kvfv_wc's.
type WC struct {
	ID        uint64
	Status    uint32
	Opcode    uint32
	ByteLen   uint32
	Imm       uint32
	QPNum     uint32
	VendorErr uint32
	Flags     uint32
	_         uint32
}

// Completion statuses the transport tells apart.
const (
	WCSuccess      = C.IBV_WC_SUCCESS
	WCLocLenErr    = C.IBV_WC_LOC_LEN_ERR
	WCLocProtErr   = C.IBV_WC_LOC_PROT_ERR
	WCFlushErr     = C.IBV_WC_WR_FLUSH_ERR
	WCRemAccessErr = C.IBV_WC_REM_ACCESS_ERR
	WCRemInvReqErr = C.IBV_WC_REM_INV_REQ_ERR
	WCRemOpErr     = C.IBV_WC_REM_OP_ERR
	WCRetryExcErr  = C.IBV_WC_RETRY_EXC_ERR
	WCRNRRetryErr  = C.IBV_WC_RNR_RETRY_EXC_ERR
)

// Completion opcodes of receives.
const (
	WCOpRecv        = C.IBV_WC_RECV
	WCOpRecvImm     = C.IBV_WC_RECV_RDMA_WITH_IMM
	WCFlagWithImm   = C.IBV_WC_WITH_IMM
	WCOpRDMAWrite   = C.IBV_WC_RDMA_WRITE
	WCOpRDMARead    = C.IBV_WC_RDMA_READ
	WCOpSend        = C.IBV_WC_SEND
	wcSizeAssertion = unsafe.Sizeof(WC{}) - C.sizeof_struct_kvfv_wc
)

// Poll takes up to len(out) completions in one call and returns how many.
// A negative count is the provider's error.
func (q *CQ) Poll(out []WC) int {
	if len(out) == 0 || q.c == nil {
		return 0
	}
	n := C.kvfv_poll_cq(q.c, (*C.struct_kvfv_wc)(unsafe.Pointer(&out[0])), C.int(len(out)))
	return int(n)
}

// Opcodes of work requests.
const (
	OpWrite    = C.KVFV_OP_WRITE
	OpWriteImm = C.KVFV_OP_WRITE_IMM
	OpRead     = C.KVFV_OP_READ
	OpSend     = C.KVFV_OP_SEND
)

// Flags of work requests.
const (
	FlagSignaled = C.KVFV_WR_SIGNALED
	FlagInline   = C.KVFV_WR_INLINE
	FlagFence    = C.KVFV_WR_FENCE
)

// MaxInline is the most bytes a WR carries inline.
const MaxInline = 64

// WR is one send-queue work request. Its layout is struct kvfv_wr's: a batch
// crosses into C as it is, with addresses, never Go pointers.
type WR struct {
	ID         uint64
	LocalAddr  uint64
	RemoteAddr uint64
	Length     uint32
	LKey       uint32
	RKey       uint32
	Imm        uint32
	Opcode     uint8
	Flags      uint8
	InlineLen  uint8
	_          [5]uint8
	Inline     [MaxInline]byte
}

// RecvWR is one receive work request (struct kvfv_recv_wr).
type RecvWR struct {
	ID     uint64
	Addr   uint64
	Length uint32
	LKey   uint32
}

// The Go structs must match the C ones byte for byte; these fail to
// compile otherwise.
var (
	_ [unsafe.Sizeof(WR{}) - C.sizeof_struct_kvfv_wr]byte
	_ [C.sizeof_struct_kvfv_wr - unsafe.Sizeof(WR{})]byte
	_ [unsafe.Sizeof(RecvWR{}) - C.sizeof_struct_kvfv_recv_wr]byte
	_ [C.sizeof_struct_kvfv_recv_wr - unsafe.Sizeof(RecvWR{})]byte
	_ [C.sizeof_struct_kvfv_wc - unsafe.Sizeof(WC{})]byte
	_ [wcSizeAssertion]byte
)

// QP states.
const (
	StateReset = C.IBV_QPS_RESET
	StateInit  = C.IBV_QPS_INIT
	StateRTR   = C.IBV_QPS_RTR
	StateRTS   = C.IBV_QPS_RTS
	StateErr   = C.IBV_QPS_ERR
)

// AttrMask is a set of IBV_QP_* bits saying which attributes a modify sets.
type AttrMask int

// The attribute bits.
const (
	AttrState         AttrMask = C.IBV_QP_STATE
	AttrCurState      AttrMask = C.IBV_QP_CUR_STATE
	AttrAccessFlags   AttrMask = C.IBV_QP_ACCESS_FLAGS
	AttrPKeyIndex     AttrMask = C.IBV_QP_PKEY_INDEX
	AttrPort          AttrMask = C.IBV_QP_PORT
	AttrAV            AttrMask = C.IBV_QP_AV
	AttrPathMTU       AttrMask = C.IBV_QP_PATH_MTU
	AttrTimeout       AttrMask = C.IBV_QP_TIMEOUT
	AttrRetryCnt      AttrMask = C.IBV_QP_RETRY_CNT
	AttrRNRRetry      AttrMask = C.IBV_QP_RNR_RETRY
	AttrRQPSN         AttrMask = C.IBV_QP_RQ_PSN
	AttrMaxQPRdAtomic AttrMask = C.IBV_QP_MAX_QP_RD_ATOMIC
	AttrMinRNRTimer   AttrMask = C.IBV_QP_MIN_RNR_TIMER
	AttrSQPSN         AttrMask = C.IBV_QP_SQ_PSN
	AttrMaxDestRdAtom AttrMask = C.IBV_QP_MAX_DEST_RD_ATOMIC
	AttrDestQPN       AttrMask = C.IBV_QP_DEST_QPN
	MaskInit                   = AttrState | AttrPKeyIndex | AttrPort | AttrAccessFlags
	MaskRTR                    = AttrState | AttrAV | AttrPathMTU | AttrDestQPN | AttrRQPSN | AttrMaxDestRdAtom | AttrMinRNRTimer
	MaskRTS                    = AttrState | AttrSQPSN | AttrTimeout | AttrRetryCnt | AttrRNRRetry | AttrMaxQPRdAtomic
	MaskState                  = AttrState
)

// QPAttr is what a QP transition sets.
type QPAttr struct {
	State           int
	Port            int
	Access          Access
	PathMTU         MTU
	DestQPN         uint32
	RQPSN           uint32
	SQPSN           uint32
	DLID            uint16
	Global          bool
	DGID            [16]byte
	SGIDIndex       int
	TrafficClass    uint8
	HopLimit        uint8
	Timeout         uint8
	RetryCnt        uint8
	RNRRetry        uint8
	MinRNRTimer     uint8
	MaxRdAtomic     uint8
	MaxDestRdAtomic uint8
}

// QP is an RC queue pair.
type QP struct {
	pd  *PD
	c   unsafe.Pointer
	mu  sync.Mutex // serialises posts and Modify against Destroy
	Num uint32
}

// CreateQP creates an RC queue pair in RESET.
func (p *PD) CreateQP(send, recv *CQ, maxSend, maxRecv, maxInline int) (*QP, error) {
	var q unsafe.Pointer
	var qpn C.uint32_t
	if rc := C.kvfv_create_qp(p.ctx.lib.c, p.c, send.c, recv.c, C.int(maxSend), C.int(maxRecv), C.int(maxInline), &q, &qpn); rc != 0 {
		return nil, fmt.Errorf("create qp on %s: %w", p.ctx.Name, syscall.Errno(rc))
	}
	return &QP{pd: p, c: q, Num: uint32(qpn)}, nil
}

// Modify applies the attributes named by mask.
func (q *QP) Modify(a *QPAttr, mask AttrMask) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.c == nil {
		return ErrClosed
	}
	ca := C.struct_kvfv_qp_attr{
		state: C.int32_t(a.State), port: C.int32_t(a.Port), access: C.int32_t(a.Access),
		path_mtu: C.int32_t(a.PathMTU), dest_qpn: C.uint32_t(a.DestQPN), rq_psn: C.uint32_t(a.RQPSN),
		sq_psn: C.uint32_t(a.SQPSN), dlid: C.uint16_t(a.DLID), sgid_index: C.uint8_t(a.SGIDIndex),
		hop_limit: C.uint8_t(a.HopLimit), traffic_class: C.uint8_t(a.TrafficClass), timeout: C.uint8_t(a.Timeout),
		retry_cnt: C.uint8_t(a.RetryCnt), rnr_retry: C.uint8_t(a.RNRRetry), min_rnr_timer: C.uint8_t(a.MinRNRTimer),
		max_rd_atomic: C.uint8_t(a.MaxRdAtomic), max_dest_rd_atomic: C.uint8_t(a.MaxDestRdAtomic),
	}
	if a.Global {
		ca.is_global = 1
		for i, b := range a.DGID {
			ca.dgid[i] = C.uint8_t(b)
		}
	}
	if rc := C.kvfv_modify_qp(q.pd.ctx.lib.c, q.c, &ca, C.int(mask)); rc != 0 {
		return fmt.Errorf("modify qp %#x to state %d (mask %#x): %w", q.Num, a.State, int(mask), syscall.Errno(rc))
	}
	return nil
}

// State queries the QP's current state.
func (q *QP) State() (int, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.c == nil {
		return 0, ErrClosed
	}
	var s C.int
	if rc := C.kvfv_query_qp_state(q.pd.ctx.lib.c, q.c, &s); rc != 0 {
		return 0, fmt.Errorf("query qp %#x: %w", q.Num, syscall.Errno(rc))
	}
	return int(s), nil
}

// Remote is what a QP needs of its peer to reach RTR: exchanged over the
// control plane.
type Remote struct {
	QPN    uint32
	PSN    uint32
	LID    uint16
	GID    [16]byte
	Global bool // address by GID (RoCE always; IB across subnets)
	MTU    MTU
}

// ToInit moves a RESET QP to INIT on port with the remote access it grants.
func (q *QP) ToInit(port int, access Access) error {
	return q.Modify(&QPAttr{State: StateInit, Port: port, Access: access}, MaskInit)
}

// ToRTR moves an INIT QP to RTR, connected to r; mtu is the path MTU both
// ends support and sgid the local GID index (for GID addressing).
func (q *QP) ToRTR(r Remote, port int, mtu MTU, sgid int) error {
	return q.Modify(&QPAttr{
		State: StateRTR, Port: port, PathMTU: mtu, DestQPN: r.QPN, RQPSN: r.PSN,
		DLID: r.LID, Global: r.Global, DGID: r.GID, SGIDIndex: max(sgid, 0), HopLimit: 64,
		MaxDestRdAtomic: uint8(min(max(q.pd.ctx.Attr.MaxQPRdAtom, 1), 16)), MinRNRTimer: 12,
	}, MaskRTR)
}

// ToRTS moves an RTR QP to RTS with our send PSN. timeout is the local ACK
// timeout exponent (4.096 us << timeout), retry the transport retry count.
func (q *QP) ToRTS(psn uint32, timeout, retry uint8) error {
	return q.Modify(&QPAttr{
		State: StateRTS, SQPSN: psn, Timeout: timeout, RetryCnt: retry, RNRRetry: 7,
		MaxRdAtomic: uint8(min(max(q.pd.ctx.Attr.MaxQPInitRdAtom, 1), 16)),
	}, MaskRTS)
}

// ToError moves the QP to the error state: once it returns, the device
// executes no further work of it, in either direction; posted work is
// flushed.
func (q *QP) ToError() error { return q.Modify(&QPAttr{State: StateErr}, MaskState) }

// Destroy destroys the QP.
func (q *QP) Destroy() error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.c == nil {
		return ErrClosed
	}
	rc := C.kvfv_destroy_qp(q.pd.ctx.lib.c, q.c)
	q.c = nil
	if rc != 0 {
		return fmt.Errorf("destroy qp %#x: %w", q.Num, syscall.Errno(rc))
	}
	return nil
}

// PostSend posts wrs in order with one cgo call and returns how many were
// posted; on an error the first unposted one is wrs[n].
func (q *QP) PostSend(wrs []WR) (int, error) {
	return q.post(len(wrs), "work requests", func(c unsafe.Pointer, posted *C.int) C.int {
		rc := C.kvfv_post_send(c, (*C.struct_kvfv_wr)(unsafe.Pointer(&wrs[0])), C.int(len(wrs)), posted)
		runtime.KeepAlive(wrs)
		return rc
	})
}

// PostRecv posts receive work requests with one cgo call.
func (q *QP) PostRecv(wrs []RecvWR) (int, error) {
	return q.post(len(wrs), "receives", func(c unsafe.Pointer, posted *C.int) C.int {
		rc := C.kvfv_post_recv(c, (*C.struct_kvfv_recv_wr)(unsafe.Pointer(&wrs[0])), C.int(len(wrs)), posted)
		runtime.KeepAlive(wrs)
		return rc
	})
}

// post runs call, one cgo post of n work requests (what names them in the
// error), under q's lock so that it cannot race Destroy; it returns how
// many were posted.
func (q *QP) post(n int, what string, call func(c unsafe.Pointer, posted *C.int) C.int) (int, error) {
	if n == 0 {
		return 0, nil
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	c := q.c
	if c == nil {
		return 0, ErrClosed
	}
	var posted C.int
	if rc := call(c, &posted); rc != 0 {
		return int(posted), fmt.Errorf("post %d %s on qp %#x: %w", n, what, q.Num, syscall.Errno(rc))
	}
	return int(posted), nil
}
