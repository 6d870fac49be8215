package engine_test

import (
	"context"
	"fmt"
	"time"

	"github.com/kvferry/kvferry/engine"
)

// Two engines in one process: b registers a buffer, a writes into it and
// reads it back. Across processes the only change is that b runs elsewhere
// and a opens it by name.
func Example() {
	a, _ := engine.New(engine.Options{IgnoreEnv: true})
	defer a.Close()
	b, _ := engine.New(engine.Options{IgnoreEnv: true})
	defer b.Close()

	src, _ := a.AllocBuffer(1<<20, "cpu")
	dst, _ := b.AllocBuffer(1<<20, "cpu")
	copy(src, "hello, decode")

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	seg, err := a.OpenSegment(ctx, b.Name()) // fetches b's descriptor from b itself
	if err != nil {
		fmt.Println(err)
		return
	}
	_, err = a.Transfer(ctx, []engine.Request{{
		Op: engine.Write, Local: engine.AddrOf(src), Segment: seg,
		Remote: engine.AddrOf(dst), Length: 13, RequestID: 42,
	}})
	fmt.Println(string(dst[:13]), err)
	// Output: hello, decode <nil>
}

// An asynchronous batch: submit many requests in one call, wait with a
// deadline, then read each task's status.
func ExampleBatch() {
	e, _ := engine.New(engine.Options{IgnoreEnv: true})
	defer e.Close()
	buf, _ := e.AllocBuffer(8<<20, "cpu")
	self, _ := e.OpenSegment(context.Background(), e.Name()) // the local segment: memcpy

	batch, _ := e.AllocateBatch(64)
	var reqs []engine.Request
	for i := 0; i < 64; i++ {
		reqs = append(reqs, engine.Request{
			Op: engine.Write, Local: engine.AddrOf(buf) + uint64(i)*4096, Segment: self,
			Remote: engine.AddrOf(buf) + 4<<20 + uint64(i)*4096, Length: 4096,
		})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := batch.Submit(ctx, reqs); err != nil {
		fmt.Println(err)
		return
	}
	if err := batch.Wait(ctx); err != nil {
		batch.Cancel() // returns once no task touches memory
	}
	st, _ := batch.Status(63)
	fmt.Println(st.Status, st.Transferred)
	_ = batch.Free()
	// Output: COMPLETED 4096
}

// RegisterMemory refuses overlapping ranges with an error matchable by
// errors.Is.
func ExampleEngine_RegisterMemory() {
	e, _ := engine.New(engine.Options{IgnoreEnv: true})
	defer e.Close()
	mem, _ := e.AllocBuffer(1<<20, "cpu") // already registered
	_, err := e.RegisterMemory(mem[4096:8192], "cpu")
	fmt.Println(err != nil)
	// Output: true
}
