// The owner's key service: an initiator gets rkeys only by asking, and the
// owner admits each request as it admits a tcp access.

package rdma

import (
	"errors"
	"fmt"
	"strings"

	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
)

func (t *Transport) serveKeys(from string, req *keysReq) ([]byte, error) {
	refused := true // until the reply is built
	t.stats.KeyRequests.Add(1)
	if req.RequestID != 0 {
		// Recorded before the admission: an Abort bumps the generation
		// first and reads the holders after, so either this admission
		// sees the new generation or the Abort sees this holder.
		added, evict := t.holds.add(from, req.Conn, req.Seq, req.RequestID)
		if evict != "" {
			// Cut before the reply goes out: rkeys of this reply then
			// reach only QPs already cut, and the initiator asks again.
			t.forgetByFence(evict)
			added = added && evict != from
		}
		if added {
			defer func() {
				if refused {
					t.holds.remove(from, req.Conn, req.RequestID)
				}
			}()
		}
	}
	t.mrMu.RLock()
	rm := t.mrs[memory.Key(req.Key)]
	t.mrMu.RUnlock()
	if t.owner != nil {
		// The owner admits the access as it would on tcp: key, range,
		// request state and grants. Nothing is copied here; the target
		// is dropped.
		tgt, err := t.owner.Admit(transport.Access{
			Op: transport.Op(req.Op), Initiator: from, RequestID: req.RequestID, Generation: req.Generation,
			GrantID: req.GrantID, Epoch: req.FenceEpoch, Key: memory.Key(req.Key), Addr: req.Addr, Length: req.Len, Direct: true,
		})
		if err == nil && tgt.Stage != nil {
			tgt.Stage.Release()
		}
		if err != nil {
			if errors.Is(err, transport.ErrAborted) {
				return encodeKeysRefusal(keysAborted, err.Error()), nil
			}
			if errors.Is(err, transport.ErrFenced) {
				// The status says fenced; the reason need not again.
				return encodeKeysRefusal(keysFenced, strings.TrimPrefix(err.Error(), transport.ErrFenced.Error()+": ")), nil
			}
			return encodeKeysRefusal(keysRefused, err.Error()), nil
		}
	}
	if rm == nil {
		return encodeKeysRefusal(keysRefused, fmt.Sprintf("key %#x is not registered with rdma", req.Key)), nil
	}
	m := &keysReply{Addr: rm.region.Addr, Len: rm.region.Len, Location: trunc(rm.region.Location)}
	// Request id 0 is admitted for the whole registration (only a fence
	// by range or unregistration stops it); a request for what it asked.
	m.Admitted = transport.Span{Addr: rm.region.Addr, Len: rm.region.Len}
	stale := false
	if fe, ok := t.owner.(transport.FenceEpocher); ok {
		// Planned before the last fence: admitted for what it asked only,
		// which the owner checked against the fenced ranges above.
		stale = req.FenceEpoch < fe.FenceEpoch()
	}
	if req.RequestID != 0 || stale {
		if !rm.region.Contains(req.Addr, req.Len) {
			return encodeKeysRefusal(keysRefused, fmt.Sprintf("[%#x, +%d) is outside key %#x", req.Addr, req.Len, req.Key)), nil
		}
		m.Admitted = transport.Span{Addr: req.Addr, Len: req.Len}
	}
	for _, p := range rm.pieces {
		pc := piece{Off: p.off, Len: p.len}
		for _, mr := range p.mrs {
			pc.RKeys = append(pc.RKeys, mr.RKey)
		}
		m.Pieces = append(m.Pieces, pc)
	}
	if len(m.Pieces) > maxPieces {
		return nil, fmt.Errorf("rdma: key %#x has %d pieces (at most %d)", req.Key, len(m.Pieces), maxPieces)
	}
	refused = false
	return m.encode(), nil
}
