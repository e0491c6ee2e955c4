package actor_test

import (
	"context"
	"errors"
	"fmt"
	"time"
	"unsafe"

	pa "github.com/asynkron/protoactor-go/actor"

	"github.com/troupe-hpc/troupe/actor"
	"github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/gpu"
)

type Hello struct{ Name string }
type Greeting struct{ Text string }

func init() {
	actor.MustRegister[Hello]()
	actor.MustRegister[Greeting]()
}

// Two ranks in one process (real UCX between them): rank 1 hosts a greeter,
// rank 0 asks it for a greeting.
func Example() {
	ctx := context.Background()
	rts, stop, err := actor.StartLocal(ctx, 2, actor.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer stop()
	greeter := rts[1].PropsFromFunc(func(c pa.Context) {
		if h, ok := c.Message().(*Hello); ok {
			c.Respond(&Greeting{Text: fmt.Sprintf("hello %s, from rank %d", h.Name, rts[1].Rank())})
		}
	})
	if _, err := rts[1].Root().SpawnNamed(greeter, "greeter"); err != nil {
		fmt.Println(err)
		return
	}
	res, err := rts[0].Request(rts[0].PID(1, "greeter"), &Hello{Name: "rank 0"}, 5*time.Second)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(res.(*Greeting).Text)
	// Output: hello rank 0, from rank 1
}

// Cell is an element of the example's actor array.
type Cell struct{ el *actor.Element }

// SumIndices asks every element to contribute its linear index to a sum
// whose result goes to Target.
type SumIndices struct{ Target *pa.PID }

func init() { actor.MustRegister[SumIndices]() }

func (c *Cell) Receive(ctx pa.Context) {
	if m, ok := ctx.Message().(*SumIndices); ok {
		if err := c.el.Contribute(float64(c.el.Linear), actor.Sum, m.Target); err != nil {
			ctx.Logger().Error("contribute", "err", err)
		}
	}
}

// An actor array of 4x3 elements spread over three ranks (a Charm++ chare
// array): every rank creates it with the same config, a broadcast reaches
// all elements, and a sum reduction, combined within each rank first and
// then up a tree of ranks, arrives at a future.
func ExampleRuntime_NewArray() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rts, stop, err := actor.StartLocal(ctx, 3, actor.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer stop()

	cfg := actor.ArrayConfig{
		Name:      "cells",
		Dims:      []int{4, 3},
		Placement: actor.Block,
		New:       func(el *actor.Element) pa.Actor { return &Cell{el: el} },
	}
	arrays := make([]*actor.Array, len(rts))
	errs := make(chan error, len(rts))
	for i, rt := range rts { // NewArray is collective: all ranks at once
		go func() {
			var err error
			arrays[i], err = rt.NewArray(ctx, cfg)
			errs <- err
		}()
	}
	for range rts {
		if err := <-errs; err != nil {
			fmt.Println(err)
			return
		}
	}
	a := arrays[0]
	fmt.Println("elements:", a.Len(), "element (3,2) lives on rank", a.RankOf(3, 2))

	f := pa.NewFuture(rts[0].System(), 10*time.Second)
	if err := a.Broadcast(&SumIndices{Target: f.PID()}); err != nil {
		fmt.Println(err)
		return
	}
	res, err := f.Result()
	if err != nil {
		fmt.Println(err)
		return
	}
	sum, err := res.(*actor.Reduced).Result()
	fmt.Println("sum of indices:", sum, err)
	// Output:
	// elements: 12 element (3,2) lives on rank 2
	// sum of indices: 66 <nil>
}

// unregistered is a type no rank registered.
type unregistered struct{ N int }

// A message of a type that was never registered fails at the sender's
// Send, and a request to an actor that does not exist fails at once with
// ErrNoActor instead of waiting for its timeout.
func ExampleRuntime_Send() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rts, stop, err := actor.StartLocal(ctx, 2, actor.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer stop()

	err = rts[0].Send(rts[0].PID(1, "anyone"), &unregistered{N: 1})
	fmt.Println(errors.Is(err, actor.ErrUnregistered))

	t0 := time.Now()
	_, err = rts[0].Request(rts[0].PID(1, "nobody"), &Hello{Name: "?"}, time.Minute)
	fmt.Println(errors.Is(err, actor.ErrNoActor), time.Since(t0) < 30*time.Second)
	// Output:
	// true
	// true true
}

// Column carries one column of a sender's grid as a derived-datatype view.
type Column struct {
	Index int
	Data  actor.Typed
}

func init() { actor.MustRegister[Column]() }

// columnSink lands every Column where dst says: column 0 of its own,
// narrower grid.
type columnSink struct {
	dst    actor.Typed
	landed chan int
}

// PostReceiveTyped names where the elements go: any layout with the same
// type signature (here four float64s) will do.
func (s *columnSink) PostReceiveTyped(*actor.Incoming) actor.Typed { return s.dst }

func (s *columnSink) Receive(c pa.Context) {
	if m, ok := c.Message().(*Column); ok {
		s.landed <- m.Index
	}
}

// float64Bytes views a []float64 as its bytes (the buffer a Typed names).
func float64Bytes(f []float64) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(f))), 8*len(f))
}

// A message field of type Typed carries MPI's (buffer, count, datatype):
// rank 0 sends column 2 of its 4x3 grid (a vector type, nothing packed by
// hand) and rank 1 lands it in column 0 of a 4x2 grid through its
// PostReceiveTyped hook. Small fields travel packed in the active message,
// large ones by the typed-transfer protocol (Options.TypedDirectMin).
func ExampleTyped() {
	ctx := context.Background()
	rts, stop, err := actor.StartLocal(ctx, 2, actor.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer stop()
	mine := make([]float64, 4*2)                             // 4 rows of 2
	myCol, err := datatype.Vector(4, 1, 2, datatype.Float64) // 4 rows, 1 element each, 2 apart
	if err != nil {
		fmt.Println(err)
		return
	}
	sink := &columnSink{dst: actor.Typed{Buf: float64Bytes(mine), Type: myCol, Count: 1}, landed: make(chan int, 1)}
	if _, err := rts[1].Root().SpawnNamed(rts[1].Props(func() pa.Actor { return sink }), "sink"); err != nil {
		fmt.Println(err)
		return
	}
	grid := []float64{
		0, 1, 2,
		10, 11, 12,
		20, 21, 22,
		30, 31, 32,
	}
	col, err := datatype.Vector(4, 1, 3, datatype.Float64) // 4 rows, 1 element each, 3 apart
	if err != nil {
		fmt.Println(err)
		return
	}
	msg := &Column{Index: 2, Data: actor.Typed{Buf: float64Bytes(grid), Type: col, Base: 2 * 8, Count: 1}}
	if err := rts[0].Send(rts[0].PID(1, "sink"), msg); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("column", <-sink.landed, "landed:", mine)
	// Output: column 2 landed: [2 0 12 0 22 0 32 0]
}

// A Typed field may name device memory (Dev): rank 0 sends column 1 of a
// 4x3 grid held on a device and rank 1 lands it in column 0 of a 4x2
// device grid. The sender packs the column into pinned memory inside Send;
// the receiver unpacks it into its device layout before the actor runs.
// The host backend stands in for a GPU here; on the cuda backend the same
// code packs and unpacks with gpupack's kernels.
func ExampleTyped_device() {
	ctx := context.Background()
	sys, err := gpu.OpenBackend(gpu.BackendHost)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer sys.Close()
	dev, err := sys.Device(0)
	if err != nil {
		fmt.Println(err)
		return
	}
	rts, stop, err := actor.StartLocal(ctx, 2, actor.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer stop()
	upload := func(f []float64) (gpu.Buffer, error) {
		b, err := dev.Alloc(8 * len(f))
		if err != nil {
			return gpu.Buffer{}, err
		}
		return b, gpu.CopyFromHost(b, float64Bytes(f))
	}
	grid, err := upload([]float64{0, 1, 2, 10, 11, 12, 20, 21, 22, 30, 31, 32})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer gpu.Free(grid)
	mine, err := upload(make([]float64, 4*2))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer gpu.Free(mine)
	col, err := datatype.Vector(4, 1, 3, datatype.Float64)
	if err != nil {
		fmt.Println(err)
		return
	}
	myCol, err := datatype.Vector(4, 1, 2, datatype.Float64)
	if err != nil {
		fmt.Println(err)
		return
	}
	sink := &columnSink{dst: actor.Typed{Dev: mine, Type: myCol, Count: 1}, landed: make(chan int, 1)}
	if _, err := rts[1].Root().SpawnNamed(rts[1].Props(func() pa.Actor { return sink }), "sink"); err != nil {
		fmt.Println(err)
		return
	}
	msg := &Column{Index: 1, Data: actor.Typed{Dev: grid, Type: col, Base: 1 * 8, Count: 1}}
	if err := rts[0].Send(rts[0].PID(1, "sink"), msg); err != nil {
		fmt.Println(err)
		return
	}
	<-sink.landed
	out := make([]float64, 4*2)
	if err := gpu.CopyToHost(float64Bytes(out), mine); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("landed on the device:", out)
	// Output: landed on the device: [1 0 11 0 21 0 31 0]
}
