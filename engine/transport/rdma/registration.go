// Memory registration: each registered region becomes MRs on every NIC,
// split into pieces no larger than the smallest device's max MR size.

package rdma

import (
	"fmt"
	"strings"
	"syscall"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
	"github.com/kvferry/kvferry/verbs"
)

// Registered implements memory.Watcher: each region is registered on every
// NIC, split at the devices' max MR size.
func (t *Transport) Registered(regs []*memory.Region) error {
	done := make([]*regMRs, 0, len(regs))
	for _, r := range regs {
		rm, err := t.register(r)
		if err != nil {
			for _, d := range done {
				t.deregister(d)
			}
			return fmt.Errorf("rdma: %w", err)
		}
		done = append(done, rm)
	}
	t.mrMu.Lock()
	for _, rm := range done {
		t.mrs[rm.region.Key] = rm
	}
	t.mrMu.Unlock()
	return nil
}

func (t *Transport) register(r *memory.Region) (*regMRs, error) {
	step := uint64(1) << 62
	for _, n := range t.nics {
		step = min(step, n.maxMR)
	}
	rm := &regMRs{region: r}
	access := verbs.AccessLocalWrite | verbs.AccessRemoteWrite | verbs.AccessRemoteRead
	relaxed := t.lib.HasRelaxedOrdering()
	for off := uint64(0); off < r.Len; off += step {
		p := mrPiece{off: off, len: min(step, r.Len-off)}
		for _, n := range t.nics {
			mr, err := t.regPiece(n, r, off, p.len, access, relaxed)
			if err != nil {
				rm.pieces = append(rm.pieces, p)
				t.deregister(rm)
				return nil, err
			}
			p.mrs = append(p.mrs, mr)
		}
		rm.pieces = append(rm.pieces, p)
	}
	return rm, nil
}

// regPiece registers one piece of a region on n. GPU memory goes through
// dma-buf when the driver and the NIC take it, else as is (which needs
// nvidia-peermem on real hardware).
func (t *Transport) regPiece(n *NIC, r *memory.Region, off, length uint64, access verbs.Access, relaxed bool) (*verbs.MR, error) {
	if strings.HasPrefix(r.Location, "cuda:") {
		if t.opts.DmaBuf != nil {
			fd, at, err := t.opts.DmaBuf(r.Location, r.Addr+off, length)
			if err == nil {
				mr, err := n.pd.RegDmabufMR(at, length, r.Addr+off, fd, access)
				_ = syscall.Close(fd)
				if err == nil {
					t.stats.DmabufMRs.Add(1)
					return mr, nil
				}
				t.log.Debug("kvferry: dma-buf registration refused; registering GPU memory as is", "nic", n.Name, "err", err)
			} else {
				t.log.Debug("kvferry: no dma-buf for GPU memory; registering it as is", "err", err)
			}
		}
		mr, err := n.pd.RegMR(r.Addr+off, length, access, relaxed)
		if err != nil {
			return nil, fmt.Errorf("GPU memory %s on %s (dma-buf and nvidia-peermem both failed): %w", r.Location, n.Name, err)
		}
		t.stats.PeermemMRs.Add(1)
		return mr, nil
	}
	return n.pd.RegMR(r.Addr+off, length, access, relaxed)
}

func (t *Transport) deregister(rm *regMRs) {
	for _, p := range rm.pieces {
		for _, mr := range p.mrs {
			if err := mr.Dereg(); err != nil {
				t.log.Error("kvferry: rdma deregistration failed; the range may still be reachable", "err", err)
			}
		}
	}
}

// Unregistered implements memory.Watcher: deregistration returns once the
// NICs no longer reach the ranges.
func (t *Transport) Unregistered(regs []*memory.Region) error {
	for _, r := range regs {
		t.mrMu.Lock()
		rm := t.mrs[r.Key]
		delete(t.mrs, r.Key)
		t.mrMu.Unlock()
		if rm != nil {
			t.deregister(rm)
		}
	}
	return nil
}

// localKey finds the lkey for [addr, addr+n) of region key on NIC nic; ok
// is false when the range is not registered with this transport or
// crosses a piece boundary (see localSpans).
func (t *Transport) localSpans(key memory.Key, addr, n uint64, nic int) ([]span, error) {
	t.mrMu.RLock()
	rm := t.mrs[key]
	t.mrMu.RUnlock()
	if rm == nil || !rm.region.Contains(addr, n) {
		return nil, fmt.Errorf("%w: local memory [%#x, +%d) is not registered with rdma", transport.ErrRefused, addr, n)
	}
	var out []span
	off := addr - rm.region.Addr
	end := off + n
	for _, p := range rm.pieces {
		if p.off+p.len <= off || p.off >= end {
			continue
		}
		s := max(off, p.off)
		e := min(end, p.off+p.len)
		out = append(out, span{addr: rm.region.Addr + s, len: e - s, key: p.mrs[nic].LKey})
	}
	return out, nil
}

type span struct {
	addr, len uint64
	key       uint32
}
