package engine

import (
	"sync"
	"sync/atomic"
)

// taskIndex lists the tasks in flight by request id, so that an owner's
// ABORT visits only the tasks of its request instead of every task of every
// batch. A task is listed from the moment it becomes visible in its batch
// (Submit, under abortMu shared) until it is final (task.finish, before its
// batch can be freed and its record reused). Tasks of request id 0 are not
// listed: no ABORT names it.
//
// It is keyed by request id alone, not by owner: a task's owner is known by
// two names (Segment.knownAs), one of which its descriptor may change, so
// the owner is checked per task, as the full scan did, and the index can
// miss no task the scan would have found. The tasks of one request id are
// the application's own, so a lookup costs what the request holds, whatever
// a peer sends.
type taskIndex struct {
	shards [taskIndexShards]taskShard
	// visited counts the tasks lookups looked at: a test checks that an
	// ABORT looks only at its request's.
	visited atomic.Uint64
}

const taskIndexShards = 64

type taskShard struct {
	mu sync.Mutex
	m  map[uint64]*task // request id -> first task of its list
}

func (x *taskIndex) shard(rid uint64) *taskShard {
	return &x.shards[(rid*0x9E3779B97F4A7C15)>>(64-6)]
}

// add lists tasks (those of request id 0 are skipped). Called once per task,
// before any cancel can find it.
func (x *taskIndex) add(tasks []*task) {
	var sh *taskShard
	for _, t := range tasks {
		rid := t.req.RequestID
		if rid == 0 {
			continue
		}
		// Consecutive tasks of one request share a shard: lock it once.
		if s := x.shard(rid); s != sh {
			if sh != nil {
				sh.mu.Unlock()
			}
			sh = s
			sh.mu.Lock()
			if sh.m == nil {
				sh.m = map[uint64]*task{}
			}
		}
		head := sh.m[rid]
		t.idxPrev, t.idxNext = nil, head
		if head != nil {
			head.idxPrev = t
		}
		sh.m[rid] = t
		t.indexed = true
	}
	if sh != nil {
		sh.mu.Unlock()
	}
}

// remove unlists t, if it was listed.
func (x *taskIndex) remove(t *task) {
	rid := t.req.RequestID
	if rid == 0 {
		return
	}
	sh := x.shard(rid)
	sh.mu.Lock()
	if t.indexed {
		if t.idxPrev != nil {
			t.idxPrev.idxNext = t.idxNext
		} else if t.idxNext != nil {
			sh.m[rid] = t.idxNext
		} else {
			delete(sh.m, rid)
		}
		if t.idxNext != nil {
			t.idxNext.idxPrev = t.idxPrev
		}
		t.idxPrev, t.idxNext, t.indexed = nil, nil, false
	}
	sh.mu.Unlock()
}

// lookup returns the tasks in flight of request rid to owner below
// generation gen, and keeps their batches' records out of the pool while
// the caller holds them. A task found here cannot be unlisted (so its batch
// cannot be freed) before its batch is marked.
func (x *taskIndex) lookup(owner string, rid uint64, gen uint32) []*task {
	sh := x.shard(rid)
	var out []*task
	n := uint64(0)
	sh.mu.Lock()
	for t := sh.m[rid]; t != nil; t = t.idxNext {
		n++
		if t.req.Generation < gen && t.req.Segment.knownAs(owner) && !TaskStatus(t.status.Load()).Final() {
			t.b.tainted.Store(true) // records stay out of the pool while we hold them
			out = append(out, t)
		}
	}
	sh.mu.Unlock()
	x.visited.Add(n)
	return out
}

// len returns the number of tasks listed.
func (x *taskIndex) len() int {
	n := 0
	for i := range x.shards {
		sh := &x.shards[i]
		sh.mu.Lock()
		for _, head := range sh.m {
			for t := head; t != nil; t = t.idxNext {
				n++
			}
		}
		sh.mu.Unlock()
	}
	return n
}
