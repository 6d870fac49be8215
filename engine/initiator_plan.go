package engine

import (
	"context"
	"fmt"
	"slices"

	"github.com/kvferry/kvferry/engine/transport"
)

// plan validates the requests and cuts them into slices.
func (b *Batch) plan(ctx context.Context, reqs []Request) ([]*task, *slab, error) {
	e := b.e
	slice := uint64(e.opts.SliceSize)
	nslices := 0
	for i := range reqs {
		r := &reqs[i]
		if r.Op != Read && r.Op != Write {
			return nil, nil, fmt.Errorf("request %d: %w: op %d", i, ErrInvalidArg, r.Op)
		}
		if r.Length == 0 || r.Local+r.Length < r.Local || r.Remote+r.Length < r.Remote {
			return nil, nil, fmt.Errorf("request %d: %w: length %d at local %#x, remote %#x", i, ErrInvalidArg, r.Length, r.Local, r.Remote)
		}
		if r.Segment == nil || r.Segment.e != e {
			return nil, nil, fmt.Errorf("request %d: %w: segment is not open on this engine", i, ErrInvalidArg)
		}
		// Before anything is allocated for it: the slice records below
		// are bounded by memory really registered here, so an absurd
		// length is an error, never an allocation the process dies of.
		if _, err := e.reg.Find(r.Local, r.Length); err != nil {
			return nil, nil, fmt.Errorf("request %d: local memory: %w", i, err)
		}
		nslices += int((r.Length + slice - 1) / slice)
	}
	sl := e.getSlab(len(reqs), nslices)
	tasks, slab, out := sl.tasks, sl.slices, sl.ptrs
	var refreshed map[*Segment]bool
	local := true
	for i := range reqs {
		r := reqs[i]
		t := &tasks[i]
		t.b, t.req = b, r
		out[i] = t
		lreg, err := e.reg.Find(r.Local, r.Length)
		if err != nil {
			return nil, nil, fmt.Errorf("request %d: local memory: %w", i, err)
		}
		var key BufferKey
		if r.Segment.self {
			reg, err := e.reg.Find(r.Remote, r.Length)
			if err != nil {
				return nil, nil, fmt.Errorf("request %d: remote memory at %s: %w", i, r.Segment.name, err)
			}
			key = reg.Key
		} else {
			local = false
			if refreshed == nil {
				refreshed = map[*Segment]bool{}
			}
			done := refreshed[r.Segment]
			key, err = r.Segment.resolve(ctx, r.Remote, r.Length, &done)
			refreshed[r.Segment] = done
			if err != nil {
				return nil, nil, fmt.Errorf("request %d: %w", i, err)
			}
		}
		n := int((r.Length + slice - 1) / slice)
		t.slices, slab = slab[:n:n], slab[n:]
		t.remaining.Store(int32(n))
		recheck := t.recheck
		for j := range t.slices {
			off := uint64(j) * slice
			ln := min(slice, r.Length-off)
			s := &t.slices[j]
			s.t = t
			s.Op, s.Key, s.Remote, s.RequestID = r.Op, key, r.Remote+off, r.RequestID
			s.Generation, s.GrantID = r.Generation, r.GrantID
			s.Extent = transport.Span{Addr: r.Remote, Len: r.Length}
			s.Local, s.LocalReg = lreg.Bytes(r.Local+off, ln), lreg
			s.Done, s.Tag, s.Recheck = sliceDone, s, recheck
		}
	}
	sl.local = local
	return out, sl, nil
}

// post spreads the slices over each segment's paths, one Post per path.
// The pointer arrays handed to the paths are cut from the slab.
func (b *Batch) post(ctx context.Context, tasks []*task, sl *slab) {
	type group struct {
		seg      *Segment
		k        uint32
		n, start int
	}
	var groups []group // few: (segment, path slot) pairs of this submit
	find := func(seg *Segment, k uint32, last int) int {
		if last < len(groups) && groups[last].seg == seg && groups[last].k == k {
			return last
		}
		for i := range groups {
			if groups[i].seg == seg && groups[i].k == k {
				return i
			}
		}
		groups = append(groups, group{seg: seg, k: k})
		return len(groups) - 1
	}
	// Each path takes SliceSize bytes of the submit before the next one
	// does, starting at a path that rotates per submit: a large request
	// spreads over every path, while small batches from several threads
	// each keep to one path instead of all waiting on all of them.
	type spread struct {
		seg   *Segment
		start uint32
		bytes uint64
	}
	var spreads []spread
	unit := uint64(b.e.opts.SliceSize)
	gi, si := 0, 0
	for _, t := range tasks {
		// A cancel may have ended the task already (Close, Batch.Cancel
		// racing this Submit): never overwrite a final state.
		t.status.CompareAndSwap(int32(Waiting), int32(Pending))
		seg := t.req.Segment
		if si >= len(spreads) || spreads[si].seg != seg {
			si = slices.IndexFunc(spreads, func(sp spread) bool { return sp.seg == seg })
			if si < 0 {
				spreads = append(spreads, spread{seg: seg, start: seg.next.Add(1)})
				si = len(spreads) - 1
			}
		}
		sp := &spreads[si]
		for j := range t.slices {
			s := &t.slices[j]
			s.hint = sp.start + uint32(sp.bytes/unit)
			sp.bytes += uint64(len(s.Local))
			gi = find(seg, s.hint%uint32(len(seg.paths)), gi)
			groups[gi].n++
		}
	}
	off := 0
	for i := range groups {
		groups[i].start = off
		off += groups[i].n
		groups[i].n = 0
	}
	ptrs := sl.sptrs[:off]
	for _, t := range tasks {
		seg := t.req.Segment
		for j := range t.slices {
			s := &t.slices[j]
			gi = find(seg, s.hint%uint32(len(seg.paths)), gi)
			g := &groups[gi]
			ptrs[g.start+g.n] = &s.Slice
			g.n++
		}
	}
	for _, g := range groups {
		slices := ptrs[g.start : g.start+g.n : g.start+g.n]
		ref, err := g.seg.path(ctx, g.k)
		for _, s := range slices {
			if err != nil {
				s.Finish(err)
			} else {
				s.Tag.(*sliceT).path.Store(ref)
			}
		}
		if err == nil {
			b.e.postStaged(ref, slices)
		}
	}
}
