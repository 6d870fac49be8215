package bounded_test

import (
	"encoding/binary"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kvferry/kvferry/engine/internal/bounded"
)

// Protection states an entry of the randomized runs moves through.
const (
	free      = iota // Evict, whatever the reason
	guarded          // Keep, whatever the reason: never evicted
	owed             // Keep unless forced
	releasing        // Release
	nstates
)

type mentry struct {
	k  int
	at time.Time
}

// model is a slice-based restatement of the Set's contract: entries oldest
// first by last put; making room walks from the oldest, spares the newest,
// stops at a fresh entry under KeepFresh; Expire walks the aged prefix.
type model struct {
	o     bounded.Options[int, int]
	es    []mentry
	state map[int]int
	st    bounded.Stats
}

func (m *model) verdict(k int, why bounded.Reason) bounded.Verdict {
	switch m.state[k] {
	case guarded:
		return bounded.Keep
	case owed:
		if why != bounded.Forced {
			return bounded.Keep
		}
	case releasing:
		return bounded.Release
	}
	return bounded.Evict
}

func (m *model) aged(e mentry, now time.Time) bool {
	return m.o.TTL > 0 && now.Sub(e.at) >= m.o.TTL
}

func (m *model) drop(k int) {
	m.es = slices.DeleteFunc(m.es, func(e mentry) bool { return e.k == k })
}

// walk asks about each entry of cand in order while more than target
// remain, and returns how many it evicted.
func (m *model) walk(cand []mentry, target int, why bounded.Reason, now time.Time, stopFresh bool) int {
	n := 0
	for _, e := range cand {
		if len(m.es) <= target {
			break
		}
		if stopFresh && !m.aged(e, now) {
			m.st.Spared++
			break
		}
		switch m.verdict(e.k, why) {
		case bounded.Evict:
			m.drop(e.k)
			n++
			switch why {
			case bounded.Aged:
				m.st.Aged++
			case bounded.Room:
				m.st.Evicted++
			case bounded.Forced:
				m.st.Forced++
			}
		case bounded.Release:
			m.drop(e.k)
			m.st.Released++
		default:
			m.st.Spared++
		}
	}
	return n
}

func (m *model) over() bool { return m.o.Cap > 0 && len(m.es) > m.o.Cap }

func (m *model) put(k int, now time.Time) (fresh bool) {
	fresh = !slices.ContainsFunc(m.es, func(e mentry) bool { return e.k == k })
	m.drop(k)
	m.es = append(m.es, mentry{k, now})
	return fresh
}

func (m *model) makeRoom(target int, why bounded.Reason, now time.Time) int {
	return m.walk(slices.Clone(m.es[:len(m.es)-1]), target, why, now, m.o.KeepFresh)
}

func (m *model) trim() int {
	if m.o.Cap > 0 && m.o.Trim > 0 && m.o.Trim < m.o.Cap {
		return m.o.Trim
	}
	return m.o.Cap
}

// runModel drives a Set and the model with the same operations, read from
// ops, and checks after each that they agree, and that no guarded entry
// was ever evicted.
func runModel(t *testing.T, ops []byte) {
	t.Helper()
	if len(ops) < 4 {
		return
	}
	c := newClock()
	m := &model{state: map[int]int{}}
	m.o = bounded.Options[int, int]{
		Cap:       int(ops[0] % 9),
		Trim:      int(ops[1] % 9),
		TTL:       time.Duration(ops[2]%4) * time.Second,
		KeepFresh: ops[3]%2 == 1,
		Now:       c.now,
	}
	o := m.o
	o.Policy = func(k, _ int, why bounded.Reason) bounded.Verdict { return m.verdict(k, why) }
	s := bounded.New(o)
	ops = ops[4:]
	for i := 0; i+1 < len(ops); i += 2 {
		op, k := ops[i]%8, int(ops[i+1]%16)
		guardedBefore := map[int]bool{}
		for _, e := range m.es {
			if m.state[e.k] == guarded {
				guardedBefore[e.k] = true
			}
		}
		now := c.now()
		switch op {
		case 0, 1:
			fresh := m.put(k, now)
			want := true
			if m.over() {
				m.makeRoom(m.trim(), bounded.Room, now)
				if fresh && m.over() {
					m.drop(k)
					m.st.Refused++
					want = false
				}
			}
			if got := s.Put(k, k); got != want {
				t.Fatalf("op %d: Put(%d) = %v, model %v", i, k, got, want)
			}
		case 2:
			m.put(k, now)
			want := 0
			if m.over() {
				m.makeRoom(m.trim(), bounded.Room, now)
				if m.over() {
					m.st.Over++
					want = len(m.es) - m.o.Cap
				}
			}
			if got := s.Push(k, k); got != want {
				t.Fatalf("op %d: Push(%d) = %d, model %d", i, k, got, want)
			}
		case 3:
			want := 0
			if len(m.es) > 0 {
				want = m.makeRoom(k%4, bounded.Forced, now)
			}
			if got := s.Force(k % 4); got != want {
				t.Fatalf("op %d: Force = %d, model %d", i, got, want)
			}
		case 4:
			want := 0
			if m.o.TTL > 0 {
				var aged []mentry
				for _, e := range m.es {
					if !m.aged(e, now) {
						break
					}
					aged = append(aged, e)
				}
				want = m.walk(aged, -1, bounded.Aged, now, false)
			}
			if got := s.Expire(now); got != want {
				t.Fatalf("op %d: Expire = %d, model %d", i, got, want)
			}
		case 5:
			_, want := m.state[k], slices.ContainsFunc(m.es, func(e mentry) bool { return e.k == k })
			m.drop(k)
			delete(guardedBefore, k)
			if _, got := s.Remove(k); got != want {
				t.Fatalf("op %d: Remove(%d) = %v, model %v", i, k, got, want)
			}
		case 6:
			m.state[k] = int(ops[i+1]/16) % nstates
		case 7:
			c.step(time.Duration(ops[i+1]) * 50 * time.Millisecond)
		}
		var got, want []mentry
		for k := range s.All() {
			at, _ := s.Stamp(k)
			got = append(got, mentry{k, at})
		}
		want = m.es
		if !slices.Equal(got, want) {
			t.Fatalf("op %d (%d on %d): set %v, model %v", i, op, k, got, want)
		}
		st := m.st
		st.Len = len(m.es)
		if s.Stats() != st {
			t.Fatalf("op %d: stats %+v, model %+v", i, s.Stats(), st)
		}
		for k := range guardedBefore {
			if !s.Has(k) {
				t.Fatalf("op %d: guarded entry %d evicted", i, k)
			}
		}
	}
}

// TestSetAgreesWithItsModelOnRandomOperations runs seeded random
// operation sequences; FuzzSetAgainstModel explores further.
func TestSetAgreesWithItsModelOnRandomOperations(t *testing.T) {
	for seed := range uint64(300) {
		rng := rand.New(rand.NewPCG(seed, 7))
		ops := make([]byte, 4+2*400)
		for i := range ops {
			ops[i] = byte(rng.Uint32())
		}
		runModel(t, ops)
	}
}

func FuzzSetAgainstModel(f *testing.F) {
	f.Add(binary.LittleEndian.AppendUint64([]byte{3, 2, 1, 1}, 0x0102030405060708))
	f.Add([]byte{4, 0, 2, 0, 0, 1, 0, 2, 0, 3, 0, 4, 6, 0x11, 0, 5, 3, 0})
	f.Fuzz(runModel)
}
