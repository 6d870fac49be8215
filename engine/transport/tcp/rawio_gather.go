package tcp

// Gathered writes, a frame's parts sent with writev: writevGuards (the
// initiator's) holds every guard around each syscall; writevParts (the
// owner's READ data) holds only the guards of the parts a syscall reads.

import (
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/kvferry/kvferry/engine/transport"
)

// errRefusedMidWrite says a guard refused while an initiator's gathered
// write was under way (our own memory was unregistered): the frame is torn
// and the path must be closed.
var errRefusedMidWrite = fmt.Errorf("%w: memory refused mid-write", transport.ErrRefused)

// writevGuards writes all of iov, entering every guard around each
// syscall; a refusal stops the write (see errRefusedMidWrite). After a
// refusal or a socket error the stream holds a torn frame and the
// connection must be closed. The initiator's sender uses it; the owner,
// whose refusals must leave the connection whole, uses writevParts.
func (c *rawConn) writevGuards(iov [][]byte, user []bool, guards []transport.Guard) error {
	for len(iov) > 0 {
		var n int
		var opErr, refusal error
		// At most maxGuardedCopy bytes per syscall, as for single copies.
		lim, total := iov, 0
		for i, v := range iov {
			if total+len(v) > maxGuardedCopy {
				c.iovLim = append(append(c.iovLim[:0], iov[:i]...), v[:maxGuardedCopy-total])
				lim = c.iovLim
				break
			}
			total += len(v)
		}
		werr := c.rc.Write(func(fd uintptr) bool {
			for i, g := range guards {
				if e := g.Enter(); e != nil {
					for _, h := range guards[:i] {
						h.Leave()
					}
					refusal = e
					return true
				}
			}
			for {
				n, opErr = rawWritev(int(fd), lim, user)
				if opErr != unix.EINTR {
					break
				}
			}
			for _, g := range guards {
				g.Leave()
			}
			return opErr != unix.EAGAIN
		})
		switch {
		case refusal != nil:
			return fmt.Errorf("%w: %w", errRefusedMidWrite, refusal)
		case werr != nil:
			return werr
		case opErr != nil:
			return opErr
		}
		for n > 0 {
			if n >= len(iov[0]) {
				n -= len(iov[0])
				iov, user = iov[1:], user[1:]
			} else {
				iov[0] = iov[0][n:]
				n = 0
			}
		}
		for len(iov) > 0 && len(iov[0]) == 0 {
			iov, user = iov[1:], user[1:]
		}
	}
	return nil
}

// gatherPart is one payload of a gathered write (a READ's data), copied
// from memory that its guard covers.
type gatherPart struct {
	g       transport.Guard
	iov     int   // index of the payload in the write's iov
	sent    int   // payload bytes sent from memory
	refusal error // g's refusal, once it refused
	zeros   int   // after the refusal: zero bytes still to send in its place
}

// span is what one syscall sends of iov entry j: n bytes, from the entry
// or, for a refused part (part >= 0), from zeros.
type span struct{ j, n, part int }

// writevParts writes all of iov, entering around each syscall the guards of
// the parts whose payload that syscall reads, and only those. When a guard
// refuses, zeros stand in for the rest of its payload, so the frame stays
// whole and the connection, with every other part on it, goes on; refused
// is called at once, before any byte after that payload is written, so it
// can rewrite the frame that follows (the READ_DONE saying so). parts are
// in iov order. After a socket error the stream holds a torn frame and the
// connection must be closed.
func (c *rawConn) writevParts(iov [][]byte, parts []gatherPart, refused func(p *gatherPart)) error {
	pos, off := 0, 0 // the first byte not yet written is iov[pos][off] (zeros: parts[k].zeros)
	first := 0       // the first part at pos or after it
	left := func(j int) int {
		if k := partAt(parts, first, j); k >= 0 && parts[k].refusal != nil {
			return parts[k].zeros
		}
		if j == pos {
			return len(iov[j]) - off
		}
		return len(iov[j])
	}
	for {
		for first < len(parts) && parts[first].iov < pos {
			first++
		}
		for pos < len(iov) && left(pos) == 0 {
			pos, off = pos+1, 0
			for first < len(parts) && parts[first].iov < pos {
				first++
			}
		}
		if pos == len(iov) {
			return nil
		}
		// At most maxGuardedCopy bytes per syscall, as for single copies.
		// Zeros come from the one scratch buffer, so they end the list.
		lim, spans, user := c.iovLim[:0], c.spans[:0], c.limUser[:0]
		total := 0
		for j := pos; j < len(iov) && total < maxGuardedCopy && len(lim) < maxRawIov; j++ {
			n := min(left(j), maxGuardedCopy-total)
			if n == 0 {
				continue
			}
			k := partAt(parts, first, j)
			if k >= 0 && parts[k].refusal != nil {
				n = min(n, scratchLen)
				lim = append(lim, c.scratchBuf(false)[:n])
				spans = append(spans, span{j, n, k})
				user = append(user, false)
				break
			}
			start := 0
			if j == pos {
				start = off
			}
			lim = append(lim, iov[j][start:start+n])
			spans = append(spans, span{j, n, k})
			user = append(user, k >= 0)
			total += n
		}
		c.iovLim, c.spans, c.limUser = lim, spans, user
		var n int
		var opErr error
		refusedAt := -1
		werr := c.rc.Write(func(fd uintptr) bool {
			entered := 0
			for ; entered < len(spans); entered++ {
				if k := spans[entered].part; k >= 0 && parts[k].refusal == nil {
					if e := parts[k].g.Enter(); e != nil {
						parts[k].refusal, refusedAt = e, k
						break
					}
				}
			}
			if refusedAt < 0 {
				for {
					n, opErr = rawWritev(int(fd), lim, user)
					if opErr != unix.EINTR {
						break
					}
				}
			}
			for _, sp := range spans[:entered] {
				if k := sp.part; k >= 0 && parts[k].refusal == nil {
					parts[k].g.Leave()
				}
			}
			return refusedAt >= 0 || opErr != unix.EAGAIN
		})
		if refusedAt >= 0 {
			p := &parts[refusedAt]
			c.scratchBuf(true) // the zeros sent from here on
			p.zeros = len(iov[p.iov]) - p.sent
			refused(p)
			continue
		}
		if werr != nil {
			return werr
		}
		if opErr != nil {
			return opErr
		}
		// Spans before the last are written whole when a later one is
		// written at all: the kernel writes an iov in order.
		for _, sp := range spans {
			if n == 0 {
				break
			}
			m := min(n, sp.n)
			n -= m
			if sp.part >= 0 && parts[sp.part].refusal != nil {
				parts[sp.part].zeros -= m
				pos, off = sp.j, 0
				continue
			}
			if sp.part >= 0 {
				parts[sp.part].sent += m
			}
			if sp.j == pos {
				off += m
			} else {
				pos, off = sp.j, m
			}
		}
	}
}

// partAt returns the index of the part whose payload is iov entry j, or
// -1; parts before first lie before j.
func partAt(parts []gatherPart, first, j int) int {
	for k := first; k < len(parts) && parts[k].iov <= j; k++ {
		if parts[k].iov == j {
			return k
		}
	}
	return -1
}
