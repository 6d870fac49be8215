package engine

import (
	"fmt"

	"github.com/kvferry/kvferry/cuda"
	"github.com/kvferry/kvferry/engine/memory"
	"github.com/kvferry/kvferry/engine/transport"
)

// initStage is a slice of GPU memory staged through host memory on a path
// that cannot reach GPU memory.
type initStage struct {
	dev  int
	gpu  []byte // the slice's own memory
	greg *memory.Region
	buf  *stageBuf
}

// stageChunk is the most a staging copy moves per driver call: a cancel
// waits for at most one chunk of a staging copy under way.
const stageChunk = 4 << 20

// stageSlice prepares a GPU slice for a path without DirectGPU, on the
// stager (see postStaged), which owns the slice while it is Staging: a
// WRITE's bytes are copied into a staging buffer chunk by chunk, each
// chunk only while its task is live and its memory registered; a READ gets
// a buffer to land in and is copied out when it completes (unstage). It
// reports whether the slice is staged, Queued and ready to post; otherwise
// it ended it.
func (e *Engine) stageSlice(s *sliceT) bool {
	if !s.Advance(transport.StateQueued, transport.StateStaging) {
		return false // canceled (or taken) meanwhile
	}
	fail := func(err error) bool {
		s.Finish(fmt.Errorf("GPU staging: %w", err))
		return false
	}
	dev := gpuOrdinal(s.LocalReg.Location)
	if _, err := e.cuda(); err != nil {
		return fail(err)
	}
	buf, err := e.getStage(dev, len(s.Local))
	if err != nil {
		return fail(err)
	}
	st := &initStage{dev: dev, gpu: s.Local, greg: s.LocalReg, buf: buf}
	if s.Op == transport.Write {
		for off := 0; off < len(s.Local); off += stageChunk {
			if f := s.t.final.Load(); f != 0 {
				e.putStage(buf)
				return fail(fmt.Errorf("%w: task ended", transport.ErrCanceled))
			}
			n := min(stageChunk, len(s.Local)-off)
			if err := st.greg.Enter(); err != nil {
				e.putStage(buf)
				return fail(err)
			}
			err := e.gpu.drv.Copy(dev, cuda.DeviceToHost, memory.AddrOf(buf.mem)+uint64(off), memory.AddrOf(s.Local)+uint64(off), uint64(n))
			st.greg.Leave()
			if err != nil {
				e.putStage(buf)
				return fail(err)
			}
		}
	}
	s.stage = st
	s.Local = buf.mem[:len(st.gpu):len(st.gpu)]
	s.LocalReg = buf.reg
	// Queued: from here a cancel takes it (and unstage frees the buffer).
	// A cancel that came during the last chunk left the slice to us: it
	// set the task's final status first, so it is seen here, or it finds
	// the slice Queued and takes it itself.
	if !s.Advance(transport.StateStaging, transport.StateQueued) {
		return false
	}
	if s.t.final.Load() != 0 && s.TryCancel() {
		s.t.sliceEnded(s, transport.ErrCanceled)
		return false
	}
	return true
}

// unstage ends a staged slice's use of its buffer: a READ that succeeded
// is copied into GPU memory first, unless its task ended meanwhile (then
// its memory must not be touched). It returns the slice's error.
func (e *Engine) unstage(s *sliceT, err error) error {
	st := s.stage
	if st == nil {
		return err
	}
	s.stage = nil
	if err == nil && s.Op == transport.Read {
		switch {
		case s.t.final.Load() != 0:
			err = fmt.Errorf("%w: task ended before its READ was copied to GPU memory", transport.ErrCanceled)
		default:
			if err = st.greg.Enter(); err == nil {
				err = e.gpu.drv.Copy(st.dev, cuda.HostToDevice, memory.AddrOf(st.gpu), memory.AddrOf(s.Local), uint64(len(s.Local)))
				st.greg.Leave()
			}
			if err != nil {
				err = fmt.Errorf("GPU staging: %w", err)
			}
		}
	}
	s.Local, s.LocalReg = st.gpu, st.greg
	e.putStage(st.buf)
	return err
}

// postStaged posts slices on a path. Those in GPU memory, where the path
// cannot reach GPU memory, are staged through host memory first, off the
// caller's goroutine (Submit returns at once, and a deadline or cancel is
// never stuck behind a copy): a stager goroutine stages them in order and
// posts each as soon as its copy is done, so the copy of the next one
// overlaps the network transfer of this one.
func (e *Engine) postStaged(ref *pathRef, slices []*transport.Slice) {
	if d, ok := ref.ep.(transport.DirectGPU); ok && d.DirectGPU() {
		ref.ep.Post(slices)
		return
	}
	plain := slices[:0:0]
	var staged []*transport.Slice
	for _, s := range slices {
		// A slice staged before (a retry) is in host memory already.
		if gpuOrdinal(s.LocalReg.Location) < 0 || s.Tag.(*sliceT).stage != nil {
			plain = append(plain, s)
		} else {
			staged = append(staged, s)
		}
	}
	if len(plain) > 0 {
		ref.ep.Post(plain)
	}
	if len(staged) == 0 {
		return
	}
	if !e.startBackground() {
		for _, s := range staged {
			if s.Advance(transport.StateQueued, transport.StateStaging) {
				s.Finish(ErrClosed)
			}
		}
		return
	}
	e.stats.stagers.Add(1)
	go func() {
		defer e.bg.Done()
		defer e.stats.stagers.Add(-1)
		for _, s := range staged {
			if e.stageSlice(s.Tag.(*sliceT)) {
				ref.ep.Post([]*transport.Slice{s})
			}
		}
	}()
}
